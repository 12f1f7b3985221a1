"""`dflash-agent run` and `dflash-agent chat`: the coding agent in a terminal."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from ..engine import SamplingParams
from ..options import (
    FiniteRange,
    close_engine,
    load_engine,
    model_options,
    sandbox_options,
    server_api_key,
    user_errors,
)
from ..tools.bash import DEFAULT_DENY
from ..tools.registry import workspace_tools
from ..tools.sandbox import Sandbox
from ..tools.workspace import Workspace, printable
from .backend import Backend
from .loop import EXIT_CODES, Agent, AgentConfig, RunResult
from .prompt import system_prompt
from .remote import RemoteBackend
from .transcript import Transcript, default_transcript_path
from .view import TerminalView, print_welcome

# Options of model_options that only mean something for the in-process engine.
ENGINE_ONLY = ("device", "dtype", "ctx_size", "draft", "draft_quant", "draft_ctx", "spec_block", "no_spec", "weights",
               "prefill", "threads", "sampling_defaults")
EXIT_HELP = ("Exit codes: 0 the model answered (no tool call); 1 an error; "
             f"{EXIT_CODES['max_steps']} the step limit ran out; {EXIT_CODES['max_tokens']} a token limit ran out "
             f"or the context is full; {EXIT_CODES['interrupted']} interrupted (Ctrl-C); {128 + signal.SIGTERM} / "
             f"{128 + signal.SIGHUP} stopped by SIGTERM / SIGHUP.")


def agent_options(f):
    """Options shared by `run` and `chat`."""
    options = [
        click.option("--repo", type=click.Path(file_okay=False, path_type=Path), default=".", show_default=True,
                     help="The workspace: the tools read, write and run commands only inside it."),
        click.option("--server", default=None, metavar="URL",
                     help="Use a running OpenAI-compatible server (e.g. `dflash-agent serve` at http://127.0.0.1:8080; "
                          "/v1 is added to a URL without a path) instead of loading the model here; --model then "
                          "names the served model (default: the first the server lists)."),
        click.option("--read-only", is_flag=True, help="No writes and no bash: list, read and search only."),
        click.option("--max-steps", type=click.IntRange(min=1), default=30, show_default=True,
                     help="Model turns per task."),
        click.option("--max-tokens", type=click.IntRange(min=1), default=None,
                     help="Generated tokens per task, all turns together [default: no limit]."),
        click.option("--max-turn-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
                     help="Generated tokens per model turn."),
        click.option("--temperature", type=FiniteRange(min=0), default=None,
                     help="0 is greedy [default: the model's recommended sampling (see --sampling-defaults; with "
                          "--server, as the server lists it), else 0]."),
        click.option("--enable-thinking", is_flag=True, help="Let the model reason before each turn (Gemma 4)."),
        click.option("--tool-choice", type=click.Choice(["auto", "required"]), default="auto", show_default=True,
                     help="'required' forces a tool call every turn (for testing the wiring)."),
        click.option("--deny", multiple=True, metavar="REGEX",
                     help="Refuse bash commands matching REGEX (repeatable), besides the built-in deny-list "
                          "(sudo, git push, rm -rf /, mkfs, ...)."),
        click.option("--transcript", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="Where to write the JSONL transcript [default: REPO/.dflash-agent/transcripts/"
                          "run-TIME-PID.jsonl, or $TMPDIR/dflash-agent-UID/transcripts/ with --read-only]."),
    ]
    for option in reversed(options):
        f = option(f)
    return sandbox_options(f)


CHAT_HELP = "/exit (or Ctrl-D) ends the session, /clear starts a new conversation, Ctrl-C interrupts a turn."


class StopSignals:
    """What stops a command as a user stops it: Ctrl-C, and `kill`, `timeout` or an editor's stop button (SIGTERM),
    a closed terminal (SIGHUP). Installed once for the whole command (so no signal falls between two handlers): in a
    turn each interrupts it, and the turn then says how the command should end; outside one, SIGINT raises
    KeyboardInterrupt and the others SystemExit(128 + the signal), so that what the command opened is closed (the
    sandbox's /tmp, the transcript, the model's worker). SIGTERM and SIGHUP win over a Ctrl-C before them."""

    def __init__(self) -> None:
        self.received: int | None = None  # in the current turn
        self._turn: tuple[asyncio.AbstractEventLoop, Agent] | None = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._handle)

    @contextmanager
    def turn(self, agent: Agent) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        # The kernel may hand a signal to another thread (a tool's): its byte on the wakeup fd wakes the event loop,
        # so that the main thread runs the handler now, not at the loop's next event (as add_signal_handler does).
        wake_read, wake_write = socket.socketpair()
        wake_read.setblocking(False)
        wake_write.setblocking(False)
        loop.add_reader(wake_read.fileno(), wake_read.recv, 4096)
        previous = signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
        self.received, self._turn = None, (loop, agent)
        try:
            yield
        finally:
            self._turn = None
            signal.set_wakeup_fd(previous)
            loop.remove_reader(wake_read.fileno())
            wake_read.close()
            wake_write.close()

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:  # the terminal is gone: writing to it would fail (EIO) on the way out
            _detach_from_terminal()
        if self.received in (None, signal.SIGINT):
            self.received = signum
        if self._turn is not None:
            loop, agent = self._turn
            loop.call_soon_threadsafe(agent.interrupt)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)


def _detach_from_terminal() -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


@dataclass
class Session:
    agent: Agent
    console: Console
    transcript: Transcript
    close_backend: Callable[[], Awaitable]  # inside the event loop (an HTTP client's connections)
    signals: StopSignals
    result: RunResult | None = None  # the last turn's

    async def turn(self, task: str) -> int:
        """Run `task`; a stopping signal meanwhile interrupts it. Its exit code, 128 + the signal if one came."""
        with self.signals.turn(self.agent):
            self.result = await self.agent.run(task)
        stopped = self.signals.received
        return 128 + stopped if stopped is not None else self.result.exit_code

    @property
    def ended(self) -> bool:
        """SIGTERM or SIGHUP came in the last turn: the command ends after it."""
        return self.signals.received in (signal.SIGTERM, signal.SIGHUP)


def open_session(stack: ExitStack, params: dict, console: Console, signals: StopSignals) -> Session:
    """Workspace, tools, model, transcript and view from the command's options; `stack` closes them."""
    ctx = click.get_current_context()
    workspace = Workspace(params["repo"], read_only=params["read_only"])
    sandbox = Sandbox(params["sandbox"], params["sandbox_network"])
    sandboxing = sandbox.describe()  # now, not at the first command: a required sandbox that cannot start ends here
    registry = workspace_tools(workspace, (*DEFAULT_DENY, *params["deny"]), sandbox)
    backend, model_name, close_backend = _backend(stack, ctx, params)
    transcript = Transcript(params["transcript"] or default_transcript_path(workspace.root, params["read_only"]))
    stack.callback(transcript.close)
    where = {"server": params["server"]} if params["server"] else {}
    view = TerminalView(console)
    stack.callback(view.close)
    config = AgentConfig(max_steps=params["max_steps"], max_tokens=params["max_tokens"],
                         max_turn_tokens=params["max_turn_tokens"], tool_choice=params["tool_choice"],
                         enable_thinking=params["enable_thinking"])
    transcript.event("start", command=ctx.info_name, repo=str(workspace.root), model=model_name,
                     server=params["server"], read_only=workspace.read_only, tools=registry.names,
                     config={"max_steps": config.max_steps, "max_tokens": config.max_tokens,
                             "max_turn_tokens": config.max_turn_tokens, "tool_choice": config.tool_choice,
                             "enable_thinking": config.enable_thinking, "temperature": params["temperature"]})
    agent = Agent(backend, registry, system_prompt(workspace), config, view, transcript)
    print_welcome(console, {**where, "model": model_name, "repo": workspace.root, "tools": ", ".join(registry.names),
                            "sandbox": sandboxing, "transcript": transcript.path})
    return Session(agent, console, transcript, close_backend, signals)


async def _nothing() -> None:
    pass


def _backend(stack: ExitStack, ctx: click.Context, params: dict) -> tuple[Backend, str, Callable[[], Awaitable]]:
    """The model the options name, its display name, and what closes it inside the event loop."""
    if params["server"]:
        given = [f"--{name.replace('_', '-')}" for name in ENGINE_ONLY
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"{', '.join(given)}: only for a model loaded here; with --server, the server "
                                   "has its own settings")
        model_given = ctx.get_parameter_source("model") is not click.core.ParameterSource.DEFAULT
        # The key `dflash-agent serve --api-key` reads from the environment, or an OpenAI-style one.
        api_key = server_api_key()
        backend = RemoteBackend(params["server"], params["model"] if model_given else None,
                                temperature=params["temperature"], api_key=api_key)
        return backend, params["model"] if model_given else "(the server's first)", backend.close
    # Imported here: the in-process model needs torch, a --server run must not load it.
    from ..chat.chat_format import ChatFormat
    from .engine_backend import EngineBackend

    engine = load_engine(**{name: params[name] for name in ("model", *ENGINE_ONLY)})
    stack.callback(close_engine, engine)
    # Unset, the temperature (and top-k / top-p) are the model's; greedy where it has none.
    sampling = engine.sampling_defaults.resolve(SamplingParams(), temperature=params["temperature"])
    backend = EngineBackend(engine, ChatFormat.for_engine(engine), sampling)
    return backend, engine.model_name, _nothing


async def _run_task(session: Session, task: str) -> int:
    try:
        return await session.turn(task)
    finally:
        await session.close_backend()


async def _chat(session: Session) -> int:
    """The session's exit code: 0, or 128 + the signal that ended it. At the prompt Ctrl-C ends the session
    (KeyboardInterrupt, from StopSignals); during a turn it interrupts the turn."""
    console = session.console
    console.print(f"[dim]Type a task; {CHAT_HELP}[/]")
    try:
        if sys.stdin is None:  # closed (`<&-`): no task can come
            return 0
        if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 become U+FFFD (printable), not an error
            sys.stdin.reconfigure(errors="surrogateescape")
        while True:
            try:
                line = printable(console.input("[bold green]you>[/] ")).strip()
            except (EOFError, KeyboardInterrupt):
                console.print()
                return 0
            command = line.lower() if line.startswith("/") and " " not in line else None
            if command in ("/exit", "/quit"):
                return 0
            if command == "/clear":
                session.agent.clear()
                console.print("[dim]a new conversation: the model no longer sees the earlier tasks[/]")
                continue
            if command is not None:  # /help, or one that does not exist
                console.print(f"[dim]{'' if command == '/help' else f'no command {escape(line)}; '}{CHAT_HELP}[/]")
                continue
            if not line:
                continue
            code = await session.turn(line)
            if session.ended:
                return code
            if session.result.outcome == "context_full":
                console.print(f"[dim]{_context_full_hint(session)}[/]")
    finally:
        await session.close_backend()


def _context_full_hint(session: Session) -> str:
    earlier = len(session.agent.messages) > 1  # more than the system prompt
    if session.result.steps == 0:  # the message itself did not fit: the agent dropped it
        return ("this message does not fit in the model's context" + (" beside the conversation so far" if earlier
                else "") + ": it was dropped" + ("; /clear starts a new conversation" if earlier else ""))
    return "the conversation fills the model's context: /clear starts a new one"


@click.command(epilog=EXIT_HELP)
@click.argument("task")
@agent_options
@model_options
@user_errors
def run(task: str, **params) -> None:
    """Run the coding agent on TASK in a repository: the model reads, edits and runs commands through
    sandboxed tools until it answers without a tool call or a limit runs out."""
    task = printable(task).strip()  # an argument's bytes that are not UTF-8 become U+FFFD
    if not task:
        raise click.UsageError("TASK is empty: say what the agent should do")
    signals = StopSignals()
    signals.install()
    console = Console(highlight=False)
    with ExitStack() as stack:
        session = open_session(stack, params, console, signals)
        code = asyncio.run(_run_task(session, task))
        console.print(f"[dim]transcript: {session.transcript.path}[/]", soft_wrap=True)
    sys.exit(code)


@click.command()
@agent_options
@model_options
@user_errors
def chat(**params) -> None:
    """An interactive session with the coding agent: each message is a task, run with the same tools in
    one growing conversation (so the model's prefix cache carries over)."""
    signals = StopSignals()
    signals.install()
    console = Console(highlight=False)
    with ExitStack() as stack:
        session = open_session(stack, params, console, signals)
        code = asyncio.run(_chat(session))
        console.print(f"[dim]transcript: {session.transcript.path}[/]", soft_wrap=True)
    sys.exit(code)
