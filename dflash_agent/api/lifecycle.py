"""One ASGI wrapper around every HTTP request: an access-log line for each (status and seconds, or that the
client left), and the cancellation of a request whose client disconnects before its response starts, so a
non-streamed generation stops with its client as a stream does. (Once a stream has started, Litestar's
send loop hears the disconnect and closes the stream, which cancels its generation.)"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send

access_log = logging.getLogger("dflash_agent.api.access")
# What each client sends (`serve --log-requests`): the way to see a new client's dialect. Off by default, since
# bodies carry whole conversations.
request_log = logging.getLogger("dflash_agent.api.requests")
_SECRET_HEADERS = {b"authorization", b"x-api-key", b"cookie", b"proxy-authorization"}
# Health checks that answer as expected (ready, or loading) are polls: a line each would bury the real requests.
_POLLS = frozenset({"/health", "/v1/health"})


def with_lifecycle(app: ASGIApp) -> ASGIApp:
    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        request = _Request(scope, receive, send)
        handler = asyncio.create_task(app(scope, request.receive, request.send))
        request.handler = handler
        try:
            await handler
        except asyncio.CancelledError:
            if not request.gone or asyncio.current_task().cancelling():
                raise  # the server is stopping, not the client leaving
        except BaseException:
            request.status = request.status or 500
            raise
        finally:
            request.stop_watching()
            request.log()

    return handle


class _Request:
    """Relays one request's messages. After the app has read the body, a watcher owns the server's
    `receive` and hands the app the disconnect when it comes; a disconnect before the response has
    started cancels the app's task."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope, self._receive, self._send = scope, receive, send
        self.handler: asyncio.Task | None = None
        self.started = time.perf_counter()
        self.status: int | None = None
        self.gone = False  # the client disconnected
        self._body_read = False
        self._complete = False
        self._watcher: asyncio.Task | None = None
        self._disconnect: asyncio.Future = asyncio.get_running_loop().create_future()
        self._body: list[bytes] | None = [] if request_log.isEnabledFor(logging.INFO) else None

    async def receive(self) -> Message:
        if self._body_read:
            return await asyncio.shield(self._disconnect)
        message = await self._receive()
        if self._body is not None and message["type"] == "http.request":
            self._body.append(message.get("body", b""))
            if not message.get("more_body", False):
                self._log_body()
        if message["type"] == "http.disconnect":
            self._body_read = True
            self._client_left(message)
        elif not message.get("more_body", False):
            self._body_read = True
            self._watcher = asyncio.create_task(self._watch())
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self._complete = True  # before sending: the server's receive() says "disconnect" once it is sent
        await self._send(message)

    async def _watch(self) -> None:
        while (message := await self._receive())["type"] != "http.disconnect":
            pass
        self._client_left(message)

    def _client_left(self, message: Any) -> None:
        if not self._disconnect.done():
            self._disconnect.set_result(message)
        if self._complete:
            return  # the whole response was sent: nobody left early
        self.gone = True
        if self.status is None and self.handler is not None:
            self.handler.cancel()

    def _log_body(self) -> None:
        headers = {name.decode("latin-1"): "<redacted>" if name.lower() in _SECRET_HEADERS else value.decode("latin-1")
                   for name, value in self.scope.get("headers", [])}
        body = b"".join(self._body or []).decode("utf-8", errors="replace")
        request_log.info("%s %s headers=%s body=%s", self.scope["method"], self.scope["path"], headers, body)
        self._body = None

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()

    def log(self) -> None:
        if self.scope["path"] in _POLLS and self.status in (200, 503):
            return
        client = self.scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        path = self.scope.get("raw_path", b"").decode("latin-1") or self.scope["path"]
        line = f'{self.scope["method"]} {path} HTTP/{self.scope.get("http_version", "1.1")}'
        seconds = time.perf_counter() - self.started
        if self.status is None and self.gone:
            access_log.info('%s "%s" 499 client disconnected, cancelled after %.2f s', who, line, seconds)
        elif self.gone:
            access_log.info('%s "%s" %d client disconnected after %.2f s', who, line, self.status, seconds)
        else:
            access_log.info('%s "%s" %s %.2f s', who, line, self.status or "-", seconds)
