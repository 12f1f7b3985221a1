"""`dflash-agent serve`: the HTTP API under uvicorn, with MCP at /mcp on the same model. The port opens at once;
the model loads behind it. The one place the HTTP app and /mcp are wired together."""

from __future__ import annotations

import errno
import logging
import socket
import sys

import click
import uvicorn

from .agent.backend import BackendError
from .api.app import DEFAULT_MAX_BODY_BYTES, create_app
from .api.connections import ConnectionLimits, protocol_class
from .api.errors import APIError
from .api.lifecycle import access_log, request_log
from .api.service import API_SAMPLING, DEFAULT_MAX_TOKENS, ServerSettings, ServerState, answered_hosts
from .chat.chat_format import LoadedModel
from .engine.progress import progress_log
from .mcp.http import MCPPlugin, mcp_serve_options
from .mcp.model import Admit
from .options import (
    FiniteRange,
    check_spec_options,
    kv_cache_option,
    load_engine,
    model_options,
    report_error,
    sandbox_options,
    user_errors,
)
from .tools.sandbox import Sandbox

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


def mcp_admission(state: ServerState) -> Admit:
    """/mcp's calls to the model admitted as the HTTP API's requests are: one queue (--max-queue), one count of
    requests processing and queued in /metrics; a full queue is the call's error."""
    def admit():
        try:
            return state.admission.admit()
        except APIError as exc:
            raise BackendError(exc.message) from None
    return admit


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes it).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--allowed-hosts", multiple=True, metavar="NAME",
              help="A name requests may give in their Host header beside this machine's and --host's (repeatable; "
                   "* for any); others get 421, so a web page on a name that resolves here (DNS rebinding) cannot "
                   "use the server. [default: bound to 0.0.0.0 or ::, any]")
@model_options
@click.option("--api-key", envvar="DFLASH_AGENT_API_KEY", default=None,
              help="Require this key (Authorization: Bearer or x-api-key) on every endpoint but /health. "
                   "Env: DFLASH_AGENT_API_KEY.")
@click.option("--alias", default=None, help="The model id clients see (default: the model's name).")
@click.option("--no-prefix-cache", is_flag=True, help="Prefill every prompt in full; no KV reuse across requests.")
@kv_cache_option
@click.option("--parallel", "-np", type=click.IntRange(min=1), default=None,
              help="Requests served at once (slots, as llama-server's -np), each with a --ctx-size context of its "
                   "own: their decode steps share one forward, so 4 streams cost little more than one. [default: 4 "
                   "on the CPU; 1 on CUDA, where each slot's context divides the card's memory and the batched "
                   "steps are not yet timed to earn it (README: GPU path)]")
@click.option("--max-queue", type=click.IntRange(min=0), default=32, show_default=True,
              help="Requests that may wait for a free slot; more get 503 with Retry-After.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=-1), default=DEFAULT_MAX_TOKENS, show_default=True,
              help="Output limit of a request that sets none (Codex CLI and aider send none; a model that does not "
                   "stop would write to the end of the context); it then ends with finish_reason length. A request's "
                   "own limit wins, above this too (Anthropic's max_tokens is required). /v1/completions keeps "
                   "OpenAI's 16 unless this is lower. 0 or -1: no limit but the context.")
@click.option("--max-body-mb", type=FiniteRange(min=0.001), default=DEFAULT_MAX_BODY_BYTES / 2**20,
              show_default=True, help="Largest request body accepted (413 above).")
@click.option("--max-connections", type=click.IntRange(min=1), default=ConnectionLimits.max_connections,
              show_default=True, help="Open connections at most; a new one closes the longest-idle one (a "
                                      "half-sent request), or gets a 503 when every connection is being answered.")
@click.option("--request-timeout", type=FiniteRange(min=0.1), default=ConnectionLimits.header_timeout_s,
              show_default=True, help="Seconds a client may take to send a request's headers, and pause inside its "
                                      "body, before it is disconnected.")
@click.option("--chat-template", default=None,
              help="gemma4, gemma3 or a .jinja file instead of the checkpoint's own template.")
@click.option("--no-access-log", is_flag=True,
              help="No log line per request (method, path, status, seconds; tokens and speed of a generation), "
                   "nor the progress lines of a long one (every 10 s: tokens done, tok/s).")
@click.option("--log-requests", is_flag=True,
              help="Log each request's headers (secrets redacted) and body: what a client sends.")
@mcp_serve_options
@sandbox_options
@user_errors
def serve(host, port, allowed_hosts, model, device, dtype, ctx_size, draft, draft_quant, draft_ctx, spec_block, no_spec,
          weights, prefill, threads, sampling_defaults, api_key, alias, no_prefix_cache, kv_cache, parallel, max_queue,
          max_tokens, max_body_mb, max_connections, request_timeout, chat_template, no_access_log, log_requests,
          mcp_repo, mcp_expose_tools, mcp_read_only, sandbox, sandbox_network) -> None:
    """OpenAI- and Anthropic-compatible HTTP server (/v1/chat/completions, /v1/messages, ...), and MCP
    (streamable HTTP) at /mcp."""
    check_spec_options(no_spec, draft, spec_block, draft_ctx)
    settings = ServerSettings(alias=alias, api_key=api_key, max_queue=max_queue, chat_template=chat_template,
                              max_tokens=max_tokens if max_tokens > 0 else None,
                              allowed_hosts=answered_hosts(host, allowed_hosts))
    failure: list[Exception] = []

    def load():
        engine = load_engine(model, device, dtype, ctx_size, draft, draft_quant, spec_block, no_spec, weights, threads,
                             prefix_cache=not no_prefix_cache, kv_dtype=kv_cache, sampling_defaults=sampling_defaults,
                             parallel=parallel, prefill=prefill, draft_ctx=draft_ctx)
        log.info("sampling defaults for what a request leaves out: %s%s",
                 engine.sampling_defaults.describe(API_SAMPLING),
                 "; --sampling-defaults none" if sampling_defaults == "none" else "")
        return engine

    def on_load_error(exc: Exception) -> None:
        failure.append(exc)
        server.should_exit = True

    if mcp_expose_tools and mcp_repo is None:
        raise click.UsageError("--mcp-expose-tools needs --mcp-repo")
    tool_sandbox = Sandbox(sandbox, sandbox_network)
    if mcp_repo is not None:
        tool_sandbox.enabled()  # now: a required sandbox that cannot start ends here, before the model loads

    def mcp(state: ServerState) -> list[MCPPlugin]:
        return [MCPPlugin(state.loaded, alias or "the served model", mcp_repo, mcp_expose_tools, mcp_read_only,
                          host=host, sandbox=tool_sandbox, admit=mcp_admission(state))]

    listener = _listen(host, port)  # before the model loads: a busy port is told at once, not after the load
    port = listener.getsockname()[1]  # --port 0 picks a free one
    def on_ready(model: LoadedModel) -> None:
        log.info("ready: %s, context %d tokens x %d slots, on http://%s:%d (OpenAI /v1, Anthropic /v1/messages, "
                 "MCP /mcp)", model.name, model.engine.n_ctx, model.engine.parallel, host, port)

    app = create_app(settings, load, max_body_bytes=int(max_body_mb * 2**20), plugins=mcp,
                     on_load_error=on_load_error, on_ready=on_ready)
    limits = ConnectionLimits(max_connections, header_timeout_s=request_timeout, body_timeout_s=request_timeout)
    # The backlog is also how many connections asyncio accepts at once: no more than the limit, so closing the
    # excess cannot fall behind accepting it and run the process out of file descriptors.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                            http=protocol_class(limits), backlog=max_connections)
    server = _Server(config, app.state.server)
    logging.getLogger(log.name).setLevel(logging.INFO)  # the startup lines (sampling defaults)
    if not no_access_log:
        logging.getLogger(access_log.name).setLevel(logging.INFO)
        logging.getLogger(progress_log.name).setLevel(logging.INFO)
    if log_requests:
        logging.getLogger(request_log.name).setLevel(logging.INFO)
    click.echo(f"dflash-agent: serving on http://{host}:{port} (loading {model}; /health says 503 until ready)",
               err=True)
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:
        pass  # uvicorn has shut down cleanly and re-raises the Ctrl-C it caught: a normal stop
    if failure:
        report_error(failure[0])
        sys.exit(1)
    if not server.started:
        sys.exit(1)  # uvicorn has said why


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound: an OSError with a one-line reason when the address cannot be had."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        return sock
    except OSError as exc:
        if sock is not None:
            sock.close()
        hint = {errno.EADDRINUSE: " (is another server running there? choose another --port)",
                errno.EACCES: " (ports below 1024 need privileges: choose another --port)"}.get(exc.errno, "")
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
