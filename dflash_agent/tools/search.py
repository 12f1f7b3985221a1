"""Search tools: glob (file names) and grep (file contents). Results come in path order, so the same
search gives the same text every time (the model's context, and its cache, stay stable).

Both walk the tree by directory descriptor (workspace.walk_tree): symlinks are listed, never followed,
so a link to `/`, a loop of links or a directory swapped for a link mid-walk leads nowhere outside.
glob runs in a thread, off the event loop, with a deadline. grep runs in a child process (Python's
regex engine holds the GIL for a whole match, and a thread cannot be killed): `python -I` started
outside the workspace with an empty environment, so nothing in the repo is imported (grep_worker.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Annotated

import msgspec

from .glob_match import Glob, GlobError
from .grep_worker import MAX_COUNTED, GrepJob, GrepReport
from .sandbox import Sandbox, SandboxError
from .tool import ToolError, ToolSpec
from .workspace import SKIP_DIRS, TreeEntry, Workspace, printable, walk_tree

MAX_GLOB_RESULTS = 200
MAX_PATTERN_CHARS = 2000
GREP_TIMEOUT_S = 60  # the grep process is killed after this; it stops by itself a little earlier
GLOB_TIMEOUT_S = 30.0
# The grep process: our package, found where this process found it (not on the workspace's path).
_HELPER_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from dflash_agent.tools.grep_worker import main; main()"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

SearchPath = Annotated[str, msgspec.Meta(description="Directory (or file) to search, relative to the workspace root.")]


class GlobArgs(msgspec.Struct, forbid_unknown_fields=True):
    pattern: Annotated[str, msgspec.Meta(max_length=MAX_PATTERN_CHARS,
                                         description="Glob such as '**/*.py' (any depth) or 'src/*.ts'.")]
    path: SearchPath = "."


class GrepArgs(msgspec.Struct, forbid_unknown_fields=True):
    pattern: Annotated[str, msgspec.Meta(max_length=MAX_PATTERN_CHARS,
                                         description="Regular expression to find in file contents.")]
    path: SearchPath = "."
    glob: Annotated[str, msgspec.Meta(max_length=MAX_PATTERN_CHARS,
                                      description="Only files matching this glob, e.g. '*.py'.")] = ""
    ignore_case: bool = False


def compile_glob(pattern: str) -> Glob:
    try:
        return Glob(pattern)
    except GlobError as exc:
        raise ToolError(str(exc)) from None


class SearchTools:
    def __init__(self, workspace: Workspace, sandbox: Sandbox | None = None) -> None:
        self.ws = workspace
        self.sandbox = sandbox if sandbox is not None else Sandbox()

    async def glob(self, args: GlobArgs) -> str:
        if args.pattern.startswith("/") or ".." in args.pattern.split("/"):
            raise ToolError("the pattern must be relative and stay inside the search path (no leading '/', no '..')")
        matcher = compile_glob(args.pattern)
        stop = threading.Event()
        try:
            return await asyncio.to_thread(self._glob, args, matcher, stop)
        finally:
            stop.set()  # a cancelled call's thread ends at its next entry

    def _glob(self, args: GlobArgs, matcher: Glob, stop: threading.Event) -> str:
        real, fd = self._open_directory(args.path)
        deadline = time.monotonic() + GLOB_TIMEOUT_S
        prefix = "" if real == self.ws.root else self.ws.display(real) + "/"
        hits, more, stopped = [], 0, False

        def skipped(entry: TreeEntry) -> bool:
            return entry.kind == "dir" and entry.name in SKIP_DIRS and not matcher.names(entry.name)

        def descend(entry: TreeEntry) -> bool:
            return not skipped(entry) and matcher.may_contain(entry.path)

        try:
            with contextlib.closing(walk_tree(fd, descend)) as walk:
                for entry in walk:
                    if stop.is_set() or time.monotonic() > deadline:
                        stopped = True
                        break
                    if skipped(entry) or not matcher.match(entry.path):
                        continue
                    if len(hits) < MAX_GLOB_RESULTS:
                        hits.append(prefix + printable(entry.path) + ("/" if entry.kind == "dir" else ""))
                    else:
                        more += 1
        finally:
            os.close(fd)
        notes = [f"[{more:,} more paths; narrow the pattern]"] if more else []
        if stopped:
            notes.append(f"[stopped after {GLOB_TIMEOUT_S:g} s; narrow the pattern or the path]")
        if not hits:
            return "\n".join([f"no paths match {args.pattern!r} under {self.ws.display(real)}", *notes])
        return "\n".join(hits + notes)

    def _open_directory(self, path: str) -> tuple[Path, int]:
        try:
            real, fd = self.ws.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            raise ToolError(f"{path} does not exist") from None
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            raise ToolError(f"{path} is not a directory")
        return real, fd

    async def grep(self, args: GrepArgs) -> str:
        target = self.ws.resolve(args.path)
        if not target.exists():
            raise ToolError(f"{args.path} does not exist")
        try:
            re.compile(args.pattern, re.IGNORECASE if args.ignore_case else 0)
        except (re.error, OverflowError, RecursionError) as exc:  # a{4294967296}; a thousand nested groups
            raise ToolError(f"{args.pattern!r} is not a valid regular expression: {exc}") from None
        if args.glob:
            compile_glob(args.glob)
        job = GrepJob(str(self.ws.root), target.relative_to(self.ws.root).as_posix(), args.pattern,
                      args.ignore_case, args.glob, time_limit_s=GREP_TIMEOUT_S * 0.8)
        argv = [sys.executable, "-I", "-c", _HELPER_BOOT, _PACKAGE_ROOT]
        # The stdlib's JSON: it carries the lone surrogates of names that are not UTF-8, msgspec's refuses them.
        code, out, err = await self._run(argv, json.dumps(msgspec.to_builtins(job)).encode())
        if code != 0:
            raise ToolError(f"grep failed: {err.decode(errors='replace').strip()[-500:]}")
        report = msgspec.json.decode(out, type=GrepReport)
        lines = report.lines or [f"no matches for {args.pattern!r} under {self.ws.display(target)}"]
        if report.more:
            at_least = "at least " if report.more >= MAX_COUNTED else ""
            lines.append(f"[{at_least}{report.more:,} more matching lines; narrow the pattern, path or glob]")
        if report.stopped:
            lines.append(f"[stopped after {job.time_limit_s:g} s; narrow the pattern, path or glob]")
        return "\n".join(lines)

    async def _run(self, argv: list[str], stdin: bytes | None = None) -> tuple[int, bytes, bytes]:
        """Run a search process: in `/` with an empty environment, so neither the workspace nor the
        server's variables reach it, and in the sandbox where it starts (sandbox.py: no writes, no
        network, no sight of the server's processes); killed past GREP_TIMEOUT_S or when the call is
        cancelled. In a thread, which kills and reaps it even when the cancelled call cannot wait."""
        cancel = threading.Event()
        running = asyncio.ensure_future(asyncio.to_thread(self.sandbox.run_helper, argv, stdin, GREP_TIMEOUT_S,
                                                          cancel))
        try:
            done = await asyncio.shield(running)
        except asyncio.CancelledError:
            cancel.set()
            raise
        except SandboxError as exc:
            raise ToolError(f"{exc}; grep did not run") from None
        if done.returncode is None:
            raise ToolError(f"grep took longer than {GREP_TIMEOUT_S} s; narrow the pattern, path or glob")
        return done.returncode, done.stdout, done.stderr


def search_tools(workspace: Workspace, sandbox: Sandbox | None = None) -> list[ToolSpec]:
    tools = SearchTools(workspace, sandbox)
    return [
        ToolSpec("glob", "Find files and directories whose path matches a glob; in path order.",
                 GlobArgs, tools.glob, read_only=True, idempotent=True),
        ToolSpec("grep", "Search file contents for a regular expression; prints path:line:text per matching line.",
                 GrepArgs, tools.grep, read_only=True, idempotent=True),
    ]
