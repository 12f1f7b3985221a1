"""`dflash-agent serve`: the HTTP API under uvicorn, with MCP at /mcp on the same model. The port opens at once;
the model loads behind it. The one place the HTTP app and /mcp are wired together."""

from __future__ import annotations

import logging
import sys

import click
import uvicorn

from .api.app import DEFAULT_MAX_BODY_BYTES, create_app
from .api.lifecycle import access_log, request_log
from .api.service import API_SAMPLING, ServerSettings, ServerState
from .mcp.http import MCPPlugin, mcp_serve_options
from .options import check_spec_options, kv_cache_option, load_engine, model_options, report_error, user_errors

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """Ends running generations when told to stop (SIGTERM, Ctrl-C), so a stream closes with an error event
    saying why instead of being cut, and the server does not wait out the graceful-shutdown timeout."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        self.state.shut_down()
        super().handle_exit(sig, frame)


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
@click.option("--no-access-log", is_flag=True,
              help="No log line per request (method, path, status, seconds; tokens and speed of a generation).")
@click.option("--log-requests", is_flag=True,
              help="Log each request's headers (secrets redacted) and body: what a client sends.")
@mcp_serve_options
@user_errors
def serve(host, port, model, device, dtype, ctx_size, draft, draft_quant, spec_block, no_spec, weights, threads,
          sampling_defaults, api_key, alias, no_prefix_cache, kv_cache, max_queue, max_body_mb, chat_template,
          no_access_log, log_requests,
          mcp_repo, mcp_expose_tools, mcp_read_only) -> None:
    """OpenAI- and Anthropic-compatible HTTP server (/v1/chat/completions, /v1/messages, ...), and MCP
    (streamable HTTP) at /mcp."""
    check_spec_options(no_spec, draft, spec_block)
    settings = ServerSettings(alias=alias, api_key=api_key, max_queue=max_queue, chat_template=chat_template)
    failure: list[Exception] = []

    def load():
        engine = load_engine(model, device, dtype, ctx_size, draft, draft_quant, spec_block, no_spec, weights, threads,
                             prefix_cache=not no_prefix_cache, kv_dtype=kv_cache, sampling_defaults=sampling_defaults)
        log.info("sampling defaults for what a request leaves out: %s%s",
                 engine.sampling_defaults.describe(API_SAMPLING),
                 "; --sampling-defaults none" if sampling_defaults == "none" else "")
        return engine

    def on_load_error(exc: Exception) -> None:
        failure.append(exc)
        server.should_exit = True

    if mcp_expose_tools and mcp_repo is None:
        raise click.UsageError("--mcp-expose-tools needs --mcp-repo")

    def mcp(state: ServerState) -> list[MCPPlugin]:
        return [MCPPlugin(state.loaded, alias or "the served model", mcp_repo, mcp_expose_tools, mcp_read_only,
                          host=host)]

    app = create_app(settings, load, max_body_bytes=int(max_body_mb * 2**20), plugins=mcp,
                     on_load_error=on_load_error)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = _Server(config, app.state.server)
    logging.getLogger(log.name).setLevel(logging.INFO)  # the startup lines (sampling defaults)
    if not no_access_log:
        logging.getLogger(access_log.name).setLevel(logging.INFO)
    if log_requests:
        logging.getLogger(request_log.name).setLevel(logging.INFO)
    click.echo(f"dflash-agent: serving on http://{host}:{port} (loading {model}; /health says 503 until ready)",
               err=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # uvicorn has shut down cleanly and re-raises the Ctrl-C it caught: a normal stop
    if failure:
        report_error(failure[0])
        sys.exit(1)
    if not server.started:
        sys.exit(1)  # uvicorn has said why (port in use, bad address)
