"""MCP over streamable HTTP at /mcp of `dflash-agent serve`, on the server's own engine.

A Litestar plugin, because the mount needs the app's lifespan (the SDK's session manager runs exactly
as long as the app). `serve` wires it to the HTTP server's model, loaded in the background, through a
poll function, so neither surface imports the other. The app's guards (the API key) cover /mcp like
every other route."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import anyio
import click
from litestar import asgi
from litestar.config.app import AppConfig
from litestar.plugins import InitPluginProtocol
from litestar.types import Receive, Scope, Send
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings

from ..chat.chat_format import LoadedModel
from ..tools.sandbox import Sandbox
from .model import Admit, LocalModel
from .server import workspace_server

log = logging.getLogger(__name__)

MCP_PATH = "/mcp"
_LOCALHOST = ("127.0.0.1", "localhost", "::1")


def mcp_serve_options(f):
    """`serve`'s options for its /mcp endpoint."""
    options = [
        click.option("--mcp-repo", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
                     help="Workspace for /mcp's run_task agent (and --mcp-expose-tools). Without it /mcp offers "
                          "only the model (complete, chat, status): a network server touches no files unless told."),
        click.option("--mcp-expose-tools", is_flag=True, help="Also offer the workspace tools over /mcp."),
        click.option("--mcp-read-only", is_flag=True, help="/mcp's agent and tools only list, read and search."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


class MCPPlugin(InitPluginProtocol):
    """`served` returns the model once loaded (None while loading; it raises if the load failed)."""

    def __init__(self, served: Callable[[], LoadedModel | None], name: str, repo: Path | None = None,
                 expose_tools: bool = False, read_only: bool = False, host: str = "127.0.0.1",
                 sandbox: Sandbox | None = None, admit: Admit | None = None) -> None:
        if expose_tools and repo is None:
            raise click.UsageError("--mcp-expose-tools needs --mcp-repo")
        self.served = served
        self.name = name
        self.repo = repo
        self.expose_tools = expose_tools
        self.read_only = read_only
        self.host = host
        self.sandbox = sandbox
        self.admit = admit

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        model = LocalModel(self.served, self.name, self.admit)
        manager = StreamableHTTPSessionManager(
            workspace_server(model, self.repo, self.expose_tools, self.read_only, sandbox=self.sandbox),
            security_settings=_security(self.host), max_request_body_size=app_config.request_max_body_size)

        @asgi(MCP_PATH, is_mount=True, copy_scope=True)
        async def mcp_endpoint(scope: Scope, receive: Receive, send: Send) -> None:
            await _cancelling_on_disconnect(manager, scope, receive, send)

        app_config.route_handlers.append(mcp_endpoint)
        app_config.lifespan.append(manager.run())
        return app_config


async def _cancelling_on_disconnect(manager: StreamableHTTPSessionManager, scope: Scope, receive: Receive,
                                    send: Send) -> None:
    """The session manager's app, and for a POST whose client leaves before its response is complete, the
    cancellation of the requests it carried, as the client's own `notifications/cancelled` would. This server keeps
    no event store, so a result whose stream is gone cannot be resumed: left running, a `complete` would hold a
    slot to its last token, and a `run_task` agent would go on running commands for no one."""
    if scope["method"] != "POST":
        await manager.asgi_app(scope, receive, send)
        return
    body = bytearray()
    left = complete = False

    async def watched_receive():
        nonlocal left
        message = await receive()
        if message["type"] == "http.request":
            body.extend(message.get("body", b""))
        elif message["type"] == "http.disconnect":
            left = True
        return message

    async def watched_send(message) -> None:
        nonlocal complete
        complete = complete or (message["type"] == "http.response.body" and not message.get("more_body", False))
        await send(message)

    try:
        await manager.asgi_app(scope, watched_receive, watched_send)
    finally:
        if left and not complete:
            await _cancel(manager, scope, _request_ids(bytes(body)))


def _request_ids(body: bytes) -> list[str | int]:
    """The JSON-RPC request ids in a POST's body (notifications and responses have none to cancel)."""
    try:
        messages = json.loads(body)
    except ValueError:
        return []
    messages = messages if isinstance(messages, list) else [messages]
    return [m["id"] for m in messages if isinstance(m, dict) and "method" in m and isinstance(m.get("id"), str | int)]


async def _cancel(manager: StreamableHTTPSessionManager, scope: Scope, ids: list[str | int]) -> None:
    """Send the session `notifications/cancelled` for `ids`, through the manager as the client would post it."""
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-length", b"content-type", b"accept")]
    for request_id in ids:
        body = json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                           "params": {"requestId": request_id, "reason": "the client disconnected"}}).encode()
        posted = {**scope, "headers": [*headers, (b"content-type", b"application/json"),
                                       (b"accept", b"application/json, text/event-stream"),
                                       (b"content-length", str(len(body)).encode())]}
        sent = False

        async def once():
            nonlocal sent
            if sent:
                await anyio.sleep_forever()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def discard(message) -> None:
            pass

        try:
            with anyio.fail_after(5):
                await manager.asgi_app(posted, once, discard)
        except Exception:  # noqa: BLE001 - the session may be gone too; nothing is left to cancel then
            log.debug("could not cancel request %r of a disconnected MCP client", request_id, exc_info=True)
        else:
            log.info("MCP request %r cancelled: its client disconnected", request_id)


def _security(host: str) -> TransportSecuritySettings | None:
    """DNS-rebinding protection when bound to this machine only (the SDK's own rule): a web page cannot
    then drive the local agent through a name that resolves to 127.0.0.1."""
    if host not in _LOCALHOST:
        return None
    return TransportSecuritySettings(enable_dns_rebinding_protection=True,
                                     allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
                                     allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"])
