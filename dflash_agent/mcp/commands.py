"""`dflash-agent mcp`: the MCP server over stdio, the way editors and coding agents spawn one.

Editors start their MCP servers with the editor and expect the handshake at once, while a 31B model
takes minutes to load: so the server answers immediately and the model comes either from a running
`dflash-agent serve` (no second copy of the weights) or from a load started in the background, which
the tools that need the model wait for. A failed load ends the process with one line on stderr, as
`serve` does."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import anyio
import click
import httpx
from mcp.server import Server
from mcp.server.stdio import stdio_server

from ..agent.commands import ENGINE_ONLY
from ..chat.chat_format import LoadedModel
from ..engine import Engine
from ..options import check_spec_options, load_engine, model_options, report_error, user_errors
from ..tools.bash import DEFAULT_DENY
from .model import LocalModel, ModelAccess, RemoteModel
from .server import workspace_server

DEFAULT_SERVER = "http://127.0.0.1:8080"  # where `dflash-agent serve` listens by default
PROBE_TIMEOUT_S = 0.5  # the handshake must not wait on a server that is not there


@click.command()
@click.option("--repo", type=click.Path(file_okay=False, path_type=Path), default=".", show_default=True,
              help="The workspace: run_task's agent and the exposed tools act only inside it.")
@click.option("--expose-tools", is_flag=True,
              help="Also offer the workspace tools (bash, read_file, write_file, edit_file, list_dir, glob, grep) as "
                   "MCP tools, with read-only / destructive annotations.")
@click.option("--read-only", is_flag=True, help="No writes and no bash: list, read and search only.")
@click.option("--server", envvar="DFLASH_AGENT_SERVER", default=None, metavar="URL",
              help="Use a running OpenAI-compatible server for the model (e.g. http://127.0.0.1:8080/v1; its key "
                   "from DFLASH_AGENT_API_KEY or OPENAI_API_KEY); --model then names the served model. Default: a "
                   "server at 127.0.0.1:8080 if one answers and no model option is given, else the model loads in "
                   "this process. Env: DFLASH_AGENT_SERVER.")
@click.option("--local", is_flag=True, help="Load the model in this process even if a server is running.")
@click.option("--deny", multiple=True, metavar="REGEX",
              help="Refuse bash commands matching REGEX (repeatable), besides the built-in deny-list.")
@model_options
@user_errors
def mcp(repo: Path, expose_tools: bool, read_only: bool, server: str | None, local: bool, deny: tuple[str, ...],
        **model_params) -> None:
    """MCP server over stdio (what editors spawn): run_task (the coding agent, with a progress notification
    per step, cancellable), complete and chat (the local model), a status resource, and with
    --expose-tools the workspace tools. stdout carries the protocol; logs go to stderr."""
    ctx = click.get_current_context()
    given = [name for name in ("model", *ENGINE_ONLY)
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if server and local:
        raise click.UsageError("--server and --local exclude each other")
    if server is None and not local and not given and _server_answers(DEFAULT_SERVER):
        server = DEFAULT_SERVER
    loading: Future[LoadedModel] | None = None
    if server:
        engine_given = [f"--{name.replace('_', '-')}" for name in given if name != "model"]
        if engine_given:
            raise click.UsageError(f"{', '.join(engine_given)} configure the in-process model; with --server the "
                                   "server has its own")
        api_key = os.environ.get("DFLASH_AGENT_API_KEY") or os.environ.get("OPENAI_API_KEY")
        remote = RemoteModel(server, model_params["model"] if "model" in given else None, api_key)
        model: ModelAccess = remote
        where = f"the model at {remote.base_url}"
    else:
        check_spec_options(model_params["no_spec"], model_params["draft"], model_params["spec_block"])
        loading = Future()
        model = LocalModel(lambda: loading.result() if loading.done() else None, model_params["model"])
        where = f"{model_params['model']} (loading in this process)"
    mcp_server = workspace_server(model, repo, expose_tools, read_only, (*DEFAULT_DENY, *deny))
    if loading is not None:
        _load_in_background(lambda: load_engine(**model_params), loading)
    click.echo(f"dflash-agent mcp: serving MCP on stdio; workspace {repo.resolve()}"
               f"{' (read-only)' if read_only else ''}; model: {where}", err=True)
    try:
        anyio.run(_serve, mcp_server, model, loading)
    finally:
        if loading is not None and loading.done() and loading.exception() is None:
            loading.result().engine.close()


async def _serve(server: Server, model: ModelAccess, loading: Future[LoadedModel] | None) -> None:
    try:
        async with anyio.create_task_group() as tasks:
            if loading is not None:
                tasks.start_soon(_watch_load, loading)
            async with stdio_server() as (read, write):
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

    def run() -> None:
        try:
            future.set_result(LoadedModel.of(load()))
        except Exception as exc:  # handed to the server, which reports it and exits
            future.set_exception(exc)

    threading.Thread(target=run, name="dflash-agent-load", daemon=True).start()


def _server_answers(root: str) -> bool:
    """A server at `root` is up: ready (200) or still loading its model (503), either way better than a
    second copy of the weights in this process."""
    try:
        return httpx.get(f"{root}/health", timeout=PROBE_TIMEOUT_S).status_code in (200, 503)
    except httpx.HTTPError:
        return False
