"""Search tools: glob (file names) and grep (file contents). Results are sorted by path, so the
same search gives the same text every time (the model's context, and its cache, stay stable)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import msgspec

from .files import BINARY_SNIFF_BYTES, is_binary, split_lines
from .tool import ToolError, ToolSpec
from .workspace import Workspace

MAX_GLOB_RESULTS = 200
MAX_GREP_MATCHES = 200
MAX_MATCH_CHARS = 500
GREP_TIMEOUT_S = 60  # ripgrep, or the Python fallback's process, is killed after this
# Never worth searching: version control, caches, environments.
SKIP_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", "node_modules", ".venv", ".tox", ".mypy_cache",
                       ".pytest_cache", ".ruff_cache", ".hypothesis", ".dflash-agent"})

SearchPath = Annotated[str, msgspec.Meta(description="Directory (or file) to search, relative to the workspace root.")]


class GlobArgs(msgspec.Struct, forbid_unknown_fields=True):
    pattern: Annotated[str, msgspec.Meta(description="Glob such as '**/*.py' (any depth) or 'src/*.ts'.")]
    path: SearchPath = "."


class GrepArgs(msgspec.Struct, forbid_unknown_fields=True):
    pattern: Annotated[str, msgspec.Meta(description="Regular expression to find in file contents.")]
    path: SearchPath = "."
    glob: Annotated[str, msgspec.Meta(description="Only files matching this glob, e.g. '*.py'.")] = ""
    ignore_case: bool = False


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob as a regular expression over '/'-separated relative paths: `*` and `?` stay within one
    name, `**/` spans directories, `[...]` and `{a,b}` as in shells."""
    return re.compile(_translate(pattern) + r"\Z")


def _translate(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1:end].replace("\\", "\\\\")
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end
        elif c == "{" and (end := pattern.find("}", i)) > 0:
            out.append("(?:" + "|".join(_translate(alt) for alt in pattern[i + 1:end].split(",")) + ")")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def walk(base: Path, skip_hidden: bool) -> Iterator[tuple[str, bool]]:
    """(path relative to base, is a directory) for everything under base, in no particular order;
    SKIP_DIRS (and hidden names, if asked) pruned, symlinked directories not entered."""
    for top, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not (skip_hidden and d.startswith("."))]
        rel_top = Path(top).relative_to(base)
        for d in dirs:
            yield (rel_top / d).as_posix(), True
        for f in files:
            if not (skip_hidden and f.startswith(".")):
                yield (rel_top / f).as_posix(), False


class SearchTools:
    def __init__(self, workspace: Workspace) -> None:
        self.ws = workspace
        self.rg = shutil.which("rg")

    async def glob(self, args: GlobArgs) -> str:
        if args.pattern.startswith("/") or ".." in Path(args.pattern).parts:
            raise ToolError("the pattern must be relative and stay inside the search path (no leading '/', no '..')")
        base = self._directory(args.path)
        regex = glob_regex(args.pattern)
        hits = []
        for rel, is_dir in walk(base, skip_hidden=False):
            if regex.match(rel) and self.ws.contains((base / rel).resolve()):
                hits.append(self.ws.display(base / rel) + ("/" if is_dir else ""))
        if not hits:
            return f"no paths match {args.pattern!r} under {self.ws.display(base)}"
        hits.sort()
        more = len(hits) - MAX_GLOB_RESULTS
        if more > 0:
            hits = hits[:MAX_GLOB_RESULTS] + [f"[{more:,} more paths; narrow the pattern]"]
        return "\n".join(hits)

    async def grep(self, args: GrepArgs) -> str:
        target = self.ws.resolve(args.path)
        if not target.exists():
            raise ToolError(f"{args.path} does not exist")
        try:
            re.compile(args.pattern, re.IGNORECASE if args.ignore_case else 0)
        except re.error as exc:
            raise ToolError(f"{args.pattern!r} is not a valid regular expression: {exc}") from None
        if self.rg is not None:
            lines = await self._ripgrep(args, target)
        else:
            lines = await self._python_grep_process(args, target)
        if not lines:
            return f"no matches for {args.pattern!r} under {self.ws.display(target)}"
        more = len(lines) - MAX_GREP_MATCHES
        if more > 0:
            lines = lines[:MAX_GREP_MATCHES] + [f"[{more:,} more matching lines; narrow the pattern, path or glob]"]
        return "\n".join(lines)

    def _directory(self, path: str) -> Path:
        real = self.ws.resolve(path)
        if not real.is_dir():
            raise ToolError(f"{path} is not a directory" if real.exists() else f"{path} does not exist")
        return real

    async def _ripgrep(self, args: GrepArgs, target: Path) -> list[str]:
        argv = [self.rg, "--no-config", "--line-number", "--with-filename", "--no-heading", "--color", "never",
                "--sort", "path", "--max-columns", str(MAX_MATCH_CHARS), "--max-columns-preview"]
        if args.ignore_case:
            argv.append("--ignore-case")
        if args.glob:
            argv += ["--glob", args.glob]
        for skipped in sorted(SKIP_DIRS):
            argv += ["--glob", f"!{skipped}/"]
        argv += ["--regexp", args.pattern]
        if target != self.ws.root:  # no path: rg prints paths relative to the root, as display() does
            argv += ["--", self.ws.display(target)]
        code, out, err = await self._run(argv)
        if code == 1:  # ripgrep's "no match"
            return []
        if code != 0:
            raise ToolError(f"grep failed: {err.decode(errors='replace').strip()}")
        return out.decode("utf-8", errors="replace").splitlines()

    async def _python_grep_process(self, args: GrepArgs, target: Path) -> list[str]:
        """`_python_grep` in a child process: Python's regex engine holds the GIL for a whole match, so a
        catastrophic pattern run in a thread would stall the event loop too, and a thread cannot be killed."""
        request = {"root": str(self.ws.root), "target": str(target), "pattern": args.pattern,
                   "ignore_case": args.ignore_case, "glob": args.glob}
        code, out, err = await self._run([sys.executable, "-m", __name__], json.dumps(request).encode())
        if code != 0:
            raise ToolError(f"grep failed: {err.decode(errors='replace').strip()[-500:]}")
        return json.loads(out)

    async def _run(self, argv: list[str], stdin: bytes | None = None) -> tuple[int, bytes, bytes]:
        """Run a search process in the root; killed past GREP_TIMEOUT_S or when the call is cancelled."""
        env = dict(os.environ)
        # The fallback imports this package: find it where this process did, installed or not.
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=self.ws.root, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), GREP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ToolError(f"grep took longer than {GREP_TIMEOUT_S} s; narrow the pattern, path or glob") from None
        finally:
            if proc.returncode is None:  # timed out or cancelled
                proc.kill()
                await proc.wait()
        assert proc.returncode is not None
        return proc.returncode, out, err

    def _python_grep(self, regex: re.Pattern[str], target: Path, glob: str) -> list[str]:
        """What ripgrep prints, for machines without it (hidden and binary files skipped, like rg;
        .gitignore is not read)."""
        if target.is_file():
            files = [target]
        else:
            # rg's --glob: without a '/' it matches a file's name at any depth, with one the path from
            # the directory rg runs in (the root).
            only = glob_regex(glob) if glob else None
            files = [target / rel for rel, is_dir in walk(target, skip_hidden=True) if not is_dir
                     and (only is None or only.match(self.ws.display(target / rel) if "/" in glob
                                                     else rel.rsplit("/", 1)[-1]))]
        out = []
        for path in sorted(files, key=lambda p: self.ws.display(p)):
            real = path.resolve()
            if not self.ws.contains(real) or not real.is_file():
                continue
            try:
                with open(real, "rb") as f:
                    head = f.read(BINARY_SNIFF_BYTES)
                    if is_binary(head):
                        continue
                    data = head + f.read()
            except OSError:
                continue
            name = self.ws.display(path)
            for n, line in enumerate(split_lines(data.decode("utf-8", errors="replace")), 1):
                if regex.search(line):
                    if len(line) > MAX_MATCH_CHARS:
                        line = f"{line[:MAX_MATCH_CHARS]} [... omitted end of long line]"
                    out.append(f"{name}:{n}:{line}")
        return out


def search_tools(workspace: Workspace) -> list[ToolSpec]:
    search = SearchTools(workspace)
    return [
        ToolSpec("glob", "Find files and directories whose path matches a glob; sorted by path.",
                 GlobArgs, search.glob, read_only=True, idempotent=True),
        ToolSpec("grep", "Search file contents for a regular expression; prints path:line:text per matching line.",
                 GrepArgs, search.grep, read_only=True, idempotent=True),
    ]


def _grep_worker() -> None:
    """The Python fallback's process: a JSON request on stdin, the matching lines as JSON on stdout."""
    request = json.load(sys.stdin)
    regex = re.compile(request["pattern"], re.IGNORECASE if request["ignore_case"] else 0)
    search = SearchTools(Workspace(Path(request["root"])))
    json.dump(search._python_grep(regex, Path(request["target"]), request["glob"]), sys.stdout)


if __name__ == "__main__":
    _grep_worker()
