"""MCP over streamable HTTP at /mcp of `dflash-agent serve`, on the server's own engine.

A Litestar plugin, because the mount needs the app's lifespan (the SDK's session manager runs exactly
as long as the app). `serve` wires it to the HTTP server's model, loaded in the background, through a
poll function, so neither surface imports the other. The app's guards (the API key) cover /mcp like
every other route."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click
from litestar import asgi
from litestar.config.app import AppConfig
from litestar.plugins import InitPluginProtocol
from litestar.types import Receive, Scope, Send
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings

from ..chat.chat_format import LoadedModel
from ..tools.sandbox import Sandbox
from .model import LocalModel
from .server import workspace_server

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
                 sandbox: Sandbox | None = None) -> None:
        if expose_tools and repo is None:
            raise click.UsageError("--mcp-expose-tools needs --mcp-repo")
        self.served = served
        self.name = name
        self.repo = repo
        self.expose_tools = expose_tools
        self.read_only = read_only
        self.host = host
        self.sandbox = sandbox

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        model = LocalModel(self.served, self.name)
        manager = StreamableHTTPSessionManager(
            workspace_server(model, self.repo, self.expose_tools, self.read_only, sandbox=self.sandbox),
            security_settings=_security(self.host), max_request_body_size=app_config.request_max_body_size)

        @asgi(MCP_PATH, is_mount=True, copy_scope=True)
        async def mcp_endpoint(scope: Scope, receive: Receive, send: Send) -> None:
            await manager.asgi_app(scope, receive, send)

        app_config.route_handlers.append(mcp_endpoint)
        app_config.lifespan.append(manager.run())
        return app_config


def _security(host: str) -> TransportSecuritySettings | None:
    """DNS-rebinding protection when bound to this machine only (the SDK's own rule): a web page cannot
    then drive the local agent through a name that resolves to 127.0.0.1."""
    if host not in _LOCALHOST:
        return None
    return TransportSecuritySettings(enable_dns_rebinding_protection=True,
                                     allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
                                     allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"])
