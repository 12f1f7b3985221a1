"""`dflash-agent mcp`: the MCP server over stdio, the way editors and coding agents spawn one.

Editors start their MCP servers with the editor and expect the handshake at once, while a 31B model
takes minutes to load: so the server answers immediately and the model comes either from the server the
user names (`--server`: no second copy of the weights) or from a load started in the background, which
the tools that need the model wait for. A failed load ends the process with one line on stderr, as
`serve` does. No server is ever guessed: whatever listens on a well-known port is not trusted with
prompts, file contents or an API key."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import anyio
import click
from mcp.server import Server
from mcp.server.stdio import stdio_server

from ..agent.commands import ENGINE_ONLY
from ..chat.chat_format import LoadedModel
from ..engine import Engine
from ..options import (
    check_spec_options,
    close_engine,
    load_engine,
    model_options,
    report_error,
    sandbox_options,
    server_api_key,
    user_errors,
)
from ..tools.bash import DEFAULT_DENY
from ..tools.sandbox import Sandbox
from .model import LocalModel, ModelAccess, RemoteModel
from .server import workspace_server
from .wire import answered

log = logging.getLogger(__name__)


@click.command()
@click.option("--repo", type=click.Path(file_okay=False, path_type=Path), default=".", show_default=True,
              help="The workspace: run_task's agent and the exposed tools act only inside it.")
@click.option("--expose-tools", is_flag=True,
              help="Also offer the workspace tools (bash, read_file, write_file, edit_file, list_dir, glob, grep) as "
                   "MCP tools, with read-only / destructive annotations.")
@click.option("--read-only", is_flag=True, help="No writes and no bash: list, read and search only.")
@click.option("--server", envvar="DFLASH_AGENT_SERVER", default=None, metavar="URL",
              help="Use this running OpenAI-compatible server for the model (e.g. http://127.0.0.1:8080/v1), "
                   "sending it DFLASH_AGENT_API_KEY (else OPENAI_API_KEY) as its key; --model then names the served "
                   "model. Without it the model loads in this process: no server is guessed. "
                   "Env: DFLASH_AGENT_SERVER.")
@click.option("--local", is_flag=True,
              help="Load the model in this process (the default without --server; kept for existing configs).")
@click.option("--deny", multiple=True, metavar="REGEX",
              help="Refuse bash commands matching REGEX (repeatable), besides the built-in deny-list.")
@sandbox_options
@model_options
@user_errors
def mcp(repo: Path, expose_tools: bool, read_only: bool, server: str | None, local: bool, deny: tuple[str, ...],
        sandbox: str, sandbox_network: bool, **model_params) -> None:
    """MCP server over stdio (what editors spawn): run_task (the coding agent, with a progress notification
    per step, cancellable), complete and chat (the local model), a status resource, and with
    --expose-tools the workspace tools. stdout carries the protocol; logs go to stderr."""
    ctx = click.get_current_context()
    given = [name for name in ("model", *ENGINE_ONLY)
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if server and local:
        raise click.UsageError("--server and --local exclude each other")
    loading: Future[LoadedModel] | None = None
    if server:
        engine_given = [f"--{name.replace('_', '-')}" for name in given if name != "model"]
        if engine_given:
            raise click.UsageError(f"{', '.join(engine_given)} configure the in-process model; with --server the "
                                   "server has its own")
        api_key = server_api_key()
        remote = RemoteModel(server, model_params["model"] if "model" in given else None, api_key)
        model: ModelAccess = remote
        where = f"the model at {remote.base_url}"
    else:
        check_spec_options(model_params["no_spec"], model_params["draft"], model_params["spec_block"],
                           model_params["draft_ctx"])
        loading = Future()
        model = LocalModel(lambda: loading.result() if loading.done() else None, model_params["model"])
        where = f"{model_params['model']} (loading in this process)"
    tool_sandbox = Sandbox(sandbox, sandbox_network)
    sandboxing = tool_sandbox.describe()  # before the handshake: a required sandbox that cannot start ends here
    mcp_server = workspace_server(model, repo, expose_tools, read_only, (*DEFAULT_DENY, *deny), tool_sandbox)
    if loading is not None:
        _load_in_background(lambda: load_engine(**model_params), loading)
    click.echo(f"dflash-agent mcp: serving MCP on stdio; workspace {repo.resolve()}"
               f"{' (read-only)' if read_only else ''}; model: {where}; sandbox: {sandboxing}", err=True)
    try:
        anyio.run(_serve, mcp_server, model, loading)
    finally:
        if loading is not None and loading.done() and loading.exception() is None:
            close_engine(loading.result().engine)
        elif loading is not None and not loading.done():
            log.info("the client left before the model had loaded")


async def _serve(server: Server, model: ModelAccess, loading: Future[LoadedModel] | None) -> None:
    try:
        async with anyio.create_task_group() as tasks:
            if loading is not None:
                tasks.start_soon(_watch_load, loading)
            async with stdio_server() as transport, answered(*transport) as (read, write):
                await server.run(read, write, server.create_initialization_options())
            tasks.cancel_scope.cancel()  # the client closed stdin: stop watching the load
    finally:
        await model.aclose()


async def _watch_load(loading: Future[LoadedModel]) -> None:
    """Say on stderr when the model is ready. A failed load ends the process: one line and exit 1, at
    once (the stdio transport's reader sits in a thread on stdin, which no cancellation reaches)."""
    try:
        loaded = await asyncio.wrap_future(loading)
    except Exception as exc:
        report_error(exc)
        sys.stderr.flush()
        os._exit(1)
    click.echo(f"dflash-agent mcp: model ready ({loaded.name}, context {loaded.engine.n_ctx} tokens)", err=True)


def _load_in_background(load: Callable[[], Engine], future: Future[LoadedModel]) -> None:
    """The load in a daemon thread, so a client that quits early does not wait for it to finish."""
    # Running, as an executor marks its futures: cancelling the watcher's asyncio view of it (the client
    # left) then leaves it be, where a pending one would be cancelled under the thread.
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            future.set_result(LoadedModel.of(load()))
        except Exception as exc:  # handed to the server, which reports it and exits
            future.set_exception(exc)

    threading.Thread(target=run, name="dflash-agent-load", daemon=True).start()

