"""Connections that send part of a request and then nothing (slowloris) must not take the server down: uvicorn
times out idle keep-alive connections but not a request whose headers or body stall, so ~1,100 such connections
once used up the process's file descriptors and asyncio then logged every failed accept (335 MB in 144 s).

`protocol_class(limits)` is uvicorn's h11 protocol with a deadline for a request's headers, an idle timeout
inside its body, and a cap on open connections where a new connection closes the one that has waited longest for
its client (a half-sent request, or an idle kept-alive connection), so a real client always gets in while stalled
ones hold the slots; it is refused with a 503 only when every slot carries a request being answered. Idle
kept-alive connections last longer than clients keep them (`ConnectionLimits.keep_alive_s`).
`AcceptErrorLimiter` lets one accept-failure line through per period."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError, openai_payload

log = logging.getLogger(__name__)

_ACCEPT_FAILED = "socket.accept() out of system resource"


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 256  # open at once, idle keep-alive and long streams included
    header_timeout_s: float = 30.0  # from a request's first byte (or the connection's start) to its last header
    body_timeout_s: float = 30.0  # the longest pause between two pieces of a request's body
    # Clients keep an idle connection about 5 s (httpx, Node's agent) and the server must be the one that waits
    # longer: at uvicorn's own 5 s both close at once, and a request written into the connection the server is
    # closing fails (the openai SDK without retries saw it). Idle ones are still closed first at the limit.
    keep_alive_s: float = 75.0


def protocol_class(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's `http=` protocol enforcing `limits` (one class per server: the limits are its own)."""
    return type("GuardedH11Protocol", (_GuardedH11Protocol,), {"limits": limits})


class _GuardedH11Protocol(H11Protocol):
    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.limits.keep_alive_s
        self._malformed: str | None = None  # what made the request a protocol error, where we decided it
        self.conn.next_event = self._next_event(self.conn.next_event)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse (then it closes the connection), as a JSON error."""
        err = APIError(400, f"malformed HTTP request: {self._malformed or 'h11 could not parse it'}; the connection "
                       "is closed", code="malformed_request")
        body = msgspec.json.encode(openai_payload(err))
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _next_event(self, next_event: Any) -> Any:
        """h11's events, but a request framed by both Content-Length and Transfer-Encoding is a protocol error:
        h11 takes the chunked body and keeps the connection, so what a proxy in front read as the body (a
        second request hidden in it) would be served as a request (smuggling; RFC 9112 section 6.1 says close).
        uvicorn answers a protocol error with a 400 and closes the connection."""

        def checked() -> Any:
            event = next_event()
            if isinstance(event, h11.Request):
                names = {name.lower() for name, _ in event.headers}
                if b"content-length" in names and b"transfer-encoding" in names:
                    self._malformed = "Content-Length with Transfer-Encoding"
                    raise h11.RemoteProtocolError(self._malformed)
            return event

        return checked

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._timer: asyncio.TimerHandle | None = None
        self.active = time.monotonic()  # when the client last sent something
        super().connection_made(transport)
        n_open = sum(not c.transport.is_closing() for c in self.connections)  # closed ones leave on the next turn
        if n_open > self.limits.max_connections and not self._evict_one():
            self._refuse(transport)
            return
        self._arm(self.limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        self.active = time.monotonic()
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm(self.limits.body_timeout_s)  # an idle timeout: each piece of the body restarts it
        elif state is h11.IDLE:
            if self._timer is None:  # the first bytes of a next request on a kept-alive connection
                self._arm(self.limits.header_timeout_s)
        else:
            self._disarm()  # the request is in: answering it may take as long as it takes

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self._timer is not None:  # mid-request: the rest would come after the shutdown's grace period
            self._disarm()
            self.transport.close()
        else:
            super().shutdown()

    @property
    def answering(self) -> bool:
        """A whole request is in and its response not yet sent; any other connection is waiting for the client
        (the rest of a request, or the next one on a kept-alive connection) and may be closed for a new one."""
        return self.cycle is not None and not self.cycle.response_complete and self._timer is None

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.flow.read_paused:  # we stopped reading (the app is behind), not the client
            self._arm(self.limits.body_timeout_s)
            return
        log.debug("closing a connection from %s that stalled mid-request", self.client)
        self.transport.close()

    def _evict_one(self) -> bool:
        waiting = [c for c in self.connections if isinstance(c, _GuardedH11Protocol) and c is not self
                   and not c.answering and not c.transport.is_closing()]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.active)
        log.debug("at %d connections: closing the longest idle, from %s", self.limits.max_connections, oldest.client)
        oldest._disarm()
        oldest.transport.close()
        return True

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Every slot carries a request being answered: a 503 the client can retry, before reading anything."""
        err = APIError(503, f"the server has {self.limits.max_connections} connections open, its limit; "
                       "retry later", code="too_many_connections")
        body = msgspec.json.encode(openai_payload(err))
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        transport.close()


class AcceptErrorLimiter:
    """An event-loop exception handler: when the process runs out of file descriptors asyncio reports every
    failed accept, so one such report goes through per `period_s` (saying how many were left out); anything
    else goes to the handler that was there before."""

    def __init__(self, previous: Any = None, period_s: float = 10.0) -> None:
        self.previous, self.period_s = previous, period_s
        self._last = float("-inf")
        self._left_out = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if str(context.get("message", "")).startswith(_ACCEPT_FAILED):
            now = time.monotonic()
            if now - self._last < self.period_s:
                self._left_out += 1
                return
            self._last = now
            if self._left_out:
                context = {**context, "message": f"{context['message']} ({self._left_out} more such failures in "
                           f"the last {self.period_s:g} s not logged; see serve --max-connections)"}
            self._left_out = 0
        if self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)
