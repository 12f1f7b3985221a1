"""JSON-RPC's answers where the SDK gives none or a misleading one.

- The stdio transport hands a line that is not JSON, or not a JSON-RPC message (no method), to the session as an
  exception, which drops it; and it reads a request whose id is not a string or an integer (1.5, true, null) as a
  notification, dropping the id: either way the client waits for a reply that never comes. `answered` sits between
  the transport and the server and answers those as JSON-RPC 2.0 §5.1 says: -32700 for a parse error, -32600 for
  an invalid request, with the request's id where it could be read, else null. A "notification" of a method that
  is not one (MCP's are all `notifications/...`) is such a request.
- A request before `initialize` gets "Invalid request parameters" from the SDK's gate; `initialize_first` says
  what is wrong instead."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pydantic
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from mcp_types import INVALID_PARAMS, INVALID_REQUEST, PARSE_ERROR, ErrorData, JSONRPCError, JSONRPCNotification

_EXEMPT = frozenset({"initialize", "ping"})
_NOTIFICATIONS = "notifications/"


@asynccontextmanager
async def answered(read: Any, write: Any) -> AsyncIterator[tuple[Any, Any]]:
    """The transport's (read, write) streams, with what it could not parse answered on `write`, not passed on."""
    forward, receive = anyio.create_memory_object_stream[SessionMessage | Exception](0)

    async def relay() -> None:
        async with forward:
            async for item in read:
                if isinstance(item, Exception):
                    await write.send(SessionMessage(JSONRPCError(jsonrpc="2.0", id=_readable_id(item),
                                                                 error=error_for(item))))
                elif isinstance(item.message, JSONRPCNotification) and not item.message.method.startswith(
                        _NOTIFICATIONS):
                    await write.send(SessionMessage(JSONRPCError(jsonrpc="2.0", id=None, error=ErrorData(
                        code=INVALID_REQUEST, message=f"Invalid Request: {item.message.method} needs an id that is "
                                                      f"a string or an integer"))))
                else:
                    await forward.send(item)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(relay)
        try:
            yield receive, write
        finally:
            tasks.cancel_scope.cancel()


def error_for(exc: Exception) -> ErrorData:
    """The JSON-RPC error for a line the transport could not read as a message."""
    if isinstance(exc, pydantic.ValidationError) and any(e["type"] == "json_invalid" for e in exc.errors()):
        return ErrorData(code=PARSE_ERROR, message="Parse error: the line is not JSON")
    return ErrorData(code=INVALID_REQUEST, message="Invalid Request: not a JSON-RPC 2.0 request, notification or "
                                                   "response (jsonrpc \"2.0\", a method name, an id that is a string "
                                                   "or an integer)")


def _raw(exc: Exception) -> Any:
    """The message the transport failed to validate, where the error carries it: a field missing from one of the
    union's variants (loc: variant, field) comes with the whole message as its input."""
    if isinstance(exc, pydantic.ValidationError):
        for error in exc.errors():
            if error["type"] == "missing" and len(error["loc"]) == 2:
                return error.get("input")
    return None


def _readable_id(exc: Exception) -> str | int | None:
    message = _raw(exc)
    return message["id"] if isinstance(message, dict) and _valid_id(message.get("id")) else None


def _valid_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


async def initialize_first(ctx: ServerRequestContext, call_next: Callable[..., Awaitable[Any]]) -> Any:
    """Server middleware: the SDK's refusal of a request before `initialize`, said as what it is."""
    try:
        return await call_next(ctx)
    except MCPError as exc:
        gate = exc.error.code == INVALID_PARAMS and exc.error.message == "Invalid request parameters"
        if gate and ctx.method not in _EXEMPT and ctx.session.client_params is None:
            raise MCPError(code=INVALID_REQUEST, message=f"{ctx.method} before initialize: the session is not "
                                                         f"initialized; send initialize first") from exc
        raise
