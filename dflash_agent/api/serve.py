"""`dflash-agent serve`: the HTTP API under uvicorn. The port opens at once; the model loads behind it."""

from __future__ import annotations

import logging
import sys

import click
import uvicorn

from ..cli import kv_cache_option, load_engine, model_options
from ..mcp.http import MCPPlugin, mcp_serve_options
from .app import DEFAULT_MAX_BODY_BYTES, create_app
from .service import ServerSettings

log = logging.getLogger(__name__)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes it).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@model_options
@click.option("--api-key", envvar="DFLASH_AGENT_API_KEY", default=None,
              help="Require this key (Authorization: Bearer or x-api-key) on every endpoint but /health. "
                   "Env: DFLASH_AGENT_API_KEY.")
@click.option("--alias", default=None, help="The model id clients see (default: the model's name).")
@click.option("--no-prefix-cache", is_flag=True, help="Prefill every prompt in full; no KV reuse across requests.")
@kv_cache_option
@click.option("--max-queue", type=click.IntRange(min=0), default=32, show_default=True,
              help="Requests that may wait behind the running one; more get 429 with Retry-After.")
@click.option("--max-body-mb", type=click.FloatRange(min=0.001), default=DEFAULT_MAX_BODY_BYTES / 2**20,
              show_default=True, help="Largest request body accepted (413 above).")
@click.option("--chat-template", default=None,
              help="gemma4, gemma3 or a .jinja file instead of the checkpoint's own template.")
@mcp_serve_options
def serve(host, port, model, device, dtype, ctx_size, draft, draft_quant, spec_block, no_spec, weights, threads,
          api_key, alias,
          no_prefix_cache, kv_cache, max_queue, max_body_mb, chat_template, mcp_repo, mcp_expose_tools,
          mcp_read_only) -> None:
    """OpenAI- and Anthropic-compatible HTTP server (/v1/chat/completions, /v1/messages, ...), and MCP
    (streamable HTTP) at /mcp."""
    if no_spec and (draft or spec_block):
        raise click.UsageError("--no-spec cannot be combined with --draft or --spec-block")
    settings = ServerSettings(alias=alias, api_key=api_key, max_queue=max_queue, chat_template=chat_template)
    failure: list[str] = []

    def load():
        return load_engine(model, device, dtype, ctx_size, draft, draft_quant, spec_block, no_spec, weights, threads,
                           prefix_cache=not no_prefix_cache, kv_dtype=kv_cache)

    def on_load_error(message: str) -> None:
        failure.append(message)
        server.should_exit = True

    mcp = MCPPlugin(mcp_repo, mcp_expose_tools, mcp_read_only, host=host)
    app = create_app(settings, load, max_body_bytes=int(max_body_mb * 2**20), plugins=[mcp],
                     on_load_error=on_load_error)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    click.echo(f"dflash-agent: serving on http://{host}:{port} (loading {model}; /health says 503 until ready)",
               err=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # uvicorn has shut down cleanly and re-raises the Ctrl-C it caught: a normal stop
    if failure:
        click.echo(f"error: {failure[0]}", err=True)
        sys.exit(1)
    if not server.started:
        sys.exit(1)  # uvicorn has said why (port in use, bad address)
