"""The bash tool. Each call is a fresh, non-interactive `bash -c` with no secrets in its environment,
in the sandbox (sandbox.py: its own PID namespace, the filesystem read-only but the workspace and a
private /tmp) or, where that cannot start, under a launcher (launcher.py) that sees every process the
command starts. Either way the timeout kills them all, and so does the command's end (nothing it
started outlives it, not even what left its session with `setsid`). Only the working directory
carries over from one call to the next, and it never leaves the workspace. Without the sandbox this
confines the agent's habits, not a hostile program."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import selectors
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from ..errors import UserError
from .git_metadata import disable_new, git_metadata
from .pipes import pipe_above_std
from .sandbox import Sandbox, SandboxError
from .terminal import terminal_text
from .tool import ToolError, ToolSpec, elision_note
from .workspace import Workspace

DEFAULT_TIMEOUT = 120
MAX_TIMEOUT = 600
MAX_OUTPUT_BYTES = 30_000  # kept of a command's output: half from its start, half from its end
# A variable whose name holds one of these is kept from commands (OPENAI_API_KEY, MYSQL_PASSWORD, SMTP_PASS...)
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASS", "CREDENTIAL", "COOKIE")
# or one of these as a word between underscores (SSH_AUTH_SOCK, SENTRY_DSN, CI_JOB_JWT, MYSQL_PWD, GH_PAT; not
# GIT_AUTHOR_NAME or PATH; PWD itself goes too, which bash sets anew)
SECRET_WORDS = frozenset({"AUTH", "DSN", "JWT", "PWD", "PAT"})
# or whose value is a URL holding a password, whatever its name (DATABASE_URL=postgres://app:pw@db/app); but for
# proxies, which the network the sandbox is allowed goes through
CREDENTIAL_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#@\s:]*:[^/?#@\s]+@", re.IGNORECASE)
# sockets to processes that run commands for whoever connects
SESSION_SOCKETS = ("DBUS_SESSION_BUS_ADDRESS",)
NON_INTERACTIVE = {
    "PAGER": "cat", "GIT_PAGER": "cat", "MANPAGER": "cat", "TERM": "dumb", "CI": "1", "NO_COLOR": "1",
    "GIT_TERMINAL_PROMPT": "0", "GIT_EDITOR": "true", "EDITOR": "true", "VISUAL": "true",
    "PIP_PROGRESS_BAR": "off", "TQDM_DISABLE": "1", "DEBIAN_FRONTEND": "noninteractive", "PYTHONUNBUFFERED": "1",
}
# Regular expressions searched in a command; a hit refuses it. `--deny` adds to these.
DEFAULT_DENY = (
    r"\bsudo\b",
    r"\bgit\s+push\b",
    r"\brm\s+(-\S+\s+)*(/|/\*|~|~/|\$HOME/?)(\s|;|&|\||$)",
    r"\bmkfs(\.\w+)?\b",
    r"\bdd\b.*\bof=/dev/",
    r"\b(shutdown|reboot|halt|poweroff)\b",
    r":\(\)\s*\{\s*:\s*\|\s*:\s*&\s*\}\s*;\s*:",
)
_POLL_S = 0.05
_MAX_CWD_BYTES = 4096  # PATH_MAX: the EXIT trap's `pwd -P` is never longer
_STOP_S = 10.0  # how long the launcher may take to kill and reap everything below it
_DRAIN_S = 2.0  # after that, how long the pipe may stay open (held by a process that escaped the launcher)


class BashArgs(msgspec.Struct, forbid_unknown_fields=True):
    command: Annotated[str, msgspec.Meta(description="The bash command line.")]
    timeout: Annotated[int, msgspec.Meta(ge=1, le=MAX_TIMEOUT, description="Seconds before it is killed.")] = (
        DEFAULT_TIMEOUT)


def _secret(name: str, value: str) -> bool:
    upper = name.upper()
    return (any(marker in upper for marker in SECRET_MARKERS) or not SECRET_WORDS.isdisjoint(upper.split("_"))
            or (not upper.endswith("_PROXY") and CREDENTIAL_URL.search(value) is not None))


def sandbox_env(base: Mapping[str, str]) -> dict[str, str]:
    """`base` without secrets, made non-interactive."""
    env = {k: v for k, v in base.items() if not _secret(k, v) and k not in SESSION_SOCKETS}
    env.update(NON_INTERACTIVE)
    return env


def compile_deny(patterns: Sequence[str]) -> list[re.Pattern[str]]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise UserError(f"deny-list pattern {pattern!r} is not a valid regular expression: {exc}") from None
    return compiled


class OutputCapture:
    """The first and last `limit / 2` bytes of a stream, and how long it was, in bounded memory; its text
    as a terminal shows it."""

    def __init__(self, limit: int) -> None:
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > 2 * self.tail_limit:  # trimmed in batches, not on every chunk
                del self.tail[:-self.tail_limit]

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_limit:]) if self.tail_limit else b""
        elided = self.total - len(self.head) - len(tail)
        if elided <= 0:
            return terminal_text((bytes(self.head) + tail).decode("utf-8", errors="replace"))
        head = terminal_text(self.head.decode("utf-8", errors="replace"))
        return (f"{head}\n{elision_note(elided, 'bytes of output')}\n"
                f"{terminal_text(tail.decode('utf-8', errors='replace'))}")


@dataclass
class CommandOutcome:
    capture: OutputCapture
    exit_code: int | None  # None: we killed it (timeout or cancel) before it exited
    timed_out: bool
    detached: bool  # a process outside the group kept the output open; reading stopped


class _Streams:
    """A command's output, and the launcher's status pipe if any, read as they come without blocking."""

    def __init__(self, selector: selectors.BaseSelector, out_fd: int, capture: OutputCapture,
                 status_fd: int | None = None) -> None:
        self.selector = selector
        self.capture = capture
        self.status_fd = status_fd
        self.status = bytearray()
        self.eof = False
        self.finished = False  # the status pipe closed: the launcher is done
        selector.register(out_fd, selectors.EVENT_READ)
        if status_fd is not None:
            selector.register(status_fd, selectors.EVENT_READ)

    def pump(self, wait: float) -> None:
        for key, _ in self.selector.select(wait):
            chunk = os.read(key.fd, 65536)
            if key.fd == self.status_fd:
                self.status.extend(chunk)
                self.finished = not chunk
            else:
                self.capture.add(chunk)
                self.eof = not chunk
            if not chunk:
                self.selector.unregister(key.fd)

    def drain(self) -> None:
        """Output still in the pipe after the command ended."""
        until = time.monotonic() + _DRAIN_S
        while not self.eof and time.monotonic() < until:
            self.pump(_POLL_S)


LAUNCHER = Path(__file__).with_name("launcher.py")


def run_command(argv: list[str], cwd: Path, env: Mapping[str, str], timeout: float, max_output: int,
                cancel: threading.Event) -> CommandOutcome:
    """Run argv through the launcher (see launcher.py) with stdin closed, stdout and stderr together;
    blocking (call it in a thread). Setting `cancel` kills it as the timeout does. However it ends, the
    launcher kills every process the command started, those that left its session included."""
    status_r, status_w = pipe_above_std()
    control_r, control_w = pipe_above_std()
    try:
        # -I -S: the launcher needs only the standard library and starts with every call.
        proc = subprocess.Popen([sys.executable, "-I", "-S", str(LAUNCHER), str(status_w), str(control_r), "--",
                                 *argv], cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, pass_fds=(status_w, control_r))
    except BaseException:
        os.close(status_r)
        os.close(control_w)
        raise
    finally:
        os.close(status_w)
        os.close(control_r)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    timed_out = False
    with selectors.DefaultSelector() as selector:
        streams = _Streams(selector, proc.stdout.fileno(), OutputCapture(max_output), status_r)
        try:
            proc.wait()  # the launcher's first process, which exits as soon as it has detached
            while not streams.finished:
                now = time.monotonic()
                if cancel.is_set() or now >= deadline:
                    timed_out = not cancel.is_set()
                    break
                streams.pump(min(_POLL_S, deadline - now))
        finally:
            # Hanging up tells the launcher to kill everything; it reports once that is done.
            os.close(control_w)
        until = time.monotonic() + _STOP_S
        while not streams.finished and time.monotonic() < until:
            streams.pump(_POLL_S)
        streams.drain()
    os.close(status_r)
    proc.stdout.close()
    code = streams.status.decode(errors="replace").strip()
    killed = timed_out or cancel.is_set() or not code.lstrip("-").isdigit()
    return CommandOutcome(streams.capture, None if killed else int(code), timed_out, detached=not streams.eof)


def run_sandboxed(sandbox: Sandbox, argv: list[str], cwd: Path, writable: list[Path], read_only: list[Path],
                  tmp: Path, env: Mapping[str, str], timeout: float, max_output: int,
                  cancel: threading.Event) -> CommandOutcome:
    """Run argv in the sandbox (see sandbox.py), as run_command does through the launcher. No launcher:
    the PID namespace is the process group that cannot be left, and its init is out of the command's
    reach, so the command's end, or killing that init (timeout, cancel), ends everything it started.
    bwrap's exit code is the command's (128 + N for a signal)."""
    started = sandbox.start(argv, cwd, writable=writable, read_only=read_only, tmp=tmp, env=env,
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc = started.proc
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    timed_out = killed = False
    with selectors.DefaultSelector() as selector:
        streams = _Streams(selector, proc.stdout.fileno(), OutputCapture(max_output))
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if cancel.is_set() or now >= deadline:
                    timed_out = not cancel.is_set()
                    killed = True
                    break
                streams.pump(min(_POLL_S, deadline - now))
        finally:
            started.stop()  # kills what is left, if anything
        streams.drain()
    proc.stdout.close()
    code = proc.returncode
    return CommandOutcome(streams.capture, None if killed or code is None else code, timed_out,
                          detached=not streams.eof)


class Shell:
    """The bash tool's state: the working directory, carried from call to call, and in the sandbox the
    private /tmp, kept from call to call as a shell's would be (removed with the Shell)."""

    def __init__(self, workspace: Workspace, deny: Sequence[str] = DEFAULT_DENY,
                 max_output: int = MAX_OUTPUT_BYTES, sandbox: Sandbox | None = None) -> None:
        self.ws = workspace
        self.cwd = workspace.root
        self.deny = compile_deny(deny)
        self.max_output = max_output
        self.bash_path = shutil.which("bash")
        self.sandbox = sandbox if sandbox is not None else Sandbox()
        self._tmp: Path | None = None

    async def bash(self, args: BashArgs) -> str:
        if self.bash_path is None:
            raise ToolError("bash is not installed on this machine")
        for pattern in self.deny:
            if pattern.search(args.command):
                raise ToolError(f"refused: the command matches the deny-list pattern {pattern.pattern!r}; "
                                "destructive commands are blocked in this workspace")
        try:
            sandboxed = await asyncio.to_thread(self.sandbox.enabled)  # probes bwrap on the first call
        except SandboxError as exc:
            raise ToolError(f"{exc}; the command did not run") from None
        notes = []
        if not self.cwd.is_dir():  # removed by an earlier command
            notes.append(f"[working directory {self.ws.display(self.cwd)} no longer exists; back at the root]")
            self.cwd = self.ws.root
        env = sandbox_env(os.environ)
        tmp = self._private_tmp() if sandboxed else None
        fd, cwd_file = tempfile.mkstemp(prefix="dflash-agent-cwd-", dir=tmp)
        os.close(fd)
        seen = (lambda path: path) if tmp is None else (lambda path: "/tmp/" + Path(path).name)  # in the sandbox
        # The EXIT trap records where the command left the shell, even when it calls `exit`. Set from BASH_ENV,
        # which bash runs before the command (and then forgets, so the command's own bash scripts do not), so
        # that the command is the script itself: its errors quote it alone, with its own line numbers.
        fd, setup_file = tempfile.mkstemp(prefix="dflash-agent-setup-", dir=tmp)
        with open(fd, "w") as f:
            f.write(f"__dflash_cwd={shlex.quote(seen(cwd_file))}\ntrap 'pwd -P > \"$__dflash_cwd\"' EXIT\n"
                    "unset BASH_ENV\n")
        env["BASH_ENV"] = seen(setup_file)
        argv = [self.bash_path, "-c", args.command]
        cancel = threading.Event()
        git = await asyncio.to_thread(git_metadata, self.ws.root)  # read-only in the sandbox
        if tmp is not None:
            # The real ones are read-only in there: pip, uv, go and the like put their caches in
            # XDG_CACHE_HOME, npm in its own.
            env.update(TMPDIR="/tmp", XDG_CACHE_HOME="/tmp/.cache", npm_config_cache="/tmp/.npm")
            run = functools.partial(run_sandboxed, self.sandbox, argv, self.cwd, [self.ws.root], sorted(git), tmp)
        else:
            run = functools.partial(run_command, argv, self.cwd)
        running = asyncio.ensure_future(asyncio.to_thread(run, env, args.timeout, self.max_output, cancel))
        try:
            outcome = await asyncio.shield(running)
        except asyncio.CancelledError:
            # The thread kills the group within a poll interval; once it has, the cancel goes on.
            cancel.set()
            await asyncio.wait({running})
            disable_new(self.ws.root, git)  # as below, with no one left to tell
            raise
        finally:
            moved_to = _read_and_remove(cwd_file)
            with contextlib.suppress(OSError):
                os.unlink(setup_file)
        # what git would run outside the sandbox, made by this command (a `git init`, a nested repository)
        notes += await asyncio.to_thread(disable_new, self.ws.root, git)
        notes += self._follow_cwd(moved_to)
        text = outcome.capture.text().rstrip("\n") or "(no output)"
        if outcome.timed_out:
            notes.append(f"[timed out after {args.timeout} s: the command and its child processes were killed]")
        elif outcome.exit_code is not None and outcome.exit_code < 0:
            notes.append(f"[killed by signal {-outcome.exit_code}]")
        else:
            notes.append(f"[exit code {outcome.exit_code}]")
        if outcome.detached:
            notes.append("[a process that escaped the command still holds its output; stopped reading]")
        return "\n".join([text, *notes])

    def _private_tmp(self) -> Path:
        """The sandbox's /tmp: a directory of the machine's own, made on first use."""
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="dflash-agent-tmp-"))
            weakref.finalize(self, shutil.rmtree, self._tmp, ignore_errors=True)
        return self._tmp

    def _follow_cwd(self, moved_to: str) -> list[str]:
        if not moved_to:
            return []
        real = Path(moved_to).resolve()
        if real == self.cwd:
            return []
        if not self.ws.contains(real):
            return [f"[the working directory stays {self.ws.display(self.cwd)}: {moved_to} is outside the workspace]"]
        self.cwd = real
        return [f"[working directory is now {self.ws.display(real)}]"]


def _read_and_remove(path: str) -> str:
    """The directory the command's EXIT trap wrote, or "" where the file is anything else. The command can write
    where it lies (the sandbox's /tmp) and may have swapped it for a symlink to a host file (the server would read
    and echo what the sandbox hides), a FIFO (the read would hang the event loop) or /dev/zero: only a regular file
    is read, never through a link, and no more than a path's length."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        fd = None
    try:
        if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        text = os.read(fd, _MAX_CWD_BYTES + 1).decode("utf-8", errors="replace").strip()
        return "" if len(text) > _MAX_CWD_BYTES or "\0" in text else text
    except OSError:
        return ""
    finally:
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


def bash_tool(shell: Shell) -> ToolSpec:
    return ToolSpec(
        "bash",
        "Run a bash command in the workspace; returns its output (stdout and stderr) and exit code. The working "
        "directory carries over between calls, nothing else does. No stdin and no terminal: use non-interactive "
        "flags. Output reads as a terminal shows it (no colours; progress bars in their last state). Long output "
        "is cut in the middle; processes still running when the command ends are killed. "
        "In the sandbox the repository's .git is read-only: git status, diff, log and show work, but not commit, add, "
        "stash, checkout or restore; to undo a change to a file, `git show HEAD:path > path`. A .git a command "
        "makes (git init, a nested repository) is renamed away after it.",
        BashArgs, shell.bash, destructive=True,
    )
