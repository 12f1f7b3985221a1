"""The grep tool's process (run by search.py as `python -I`, outside the workspace): a GrepJob as
JSON on stdin, a GrepReport as JSON on stdout. It walks by descriptor (workspace.walk_tree), never
through a symlink, streams each file a chunk at a time, keeps the first MAX_GREP_MATCHES lines and
counts the rest, so memory stays bounded whatever the files hold. Imports stay light: it starts with
every call."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from .files import BINARY_SNIFF_BYTES, MAX_READ_BYTES, decode_text, is_binary, split_lines, text_encoding
from .glob_match import Glob
from .tool import ToolError
from .workspace import SKIP_DIRS, TreeEntry, Workspace, printable, walk_tree

MAX_GREP_MATCHES = 200
MAX_COUNTED = 10_000  # matching lines counted (not kept) past the shown ones, then "at least"
MAX_MATCH_CHARS = 500
READ_CHUNK = 2**20
MAX_LINE_BYTES = 2**20  # a longer line (minified code, a log without newlines) is searched in its first MB


class GrepJob(msgspec.Struct):
    """What the grep process is asked: `target` relative to `root`, a real path (no symlinks)."""
    root: str
    target: str
    pattern: str
    ignore_case: bool
    glob: str
    time_limit_s: float


class GrepReport(msgspec.Struct):
    lines: list[str]
    more: int  # matching lines past `lines`, counted up to MAX_COUNTED
    stopped: bool  # the time limit ended the search early


class _Matches:
    """The first MAX_GREP_MATCHES lines, then only a count (so memory stays bounded)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.more = 0

    @property
    def full(self) -> bool:
        return self.more >= MAX_COUNTED

    def add(self, name: str, number: int, line: str) -> None:
        if len(self.lines) >= MAX_GREP_MATCHES:
            self.more += 1
            return
        if len(line) > MAX_MATCH_CHARS:
            line = f"{line[:MAX_MATCH_CHARS]} [... omitted end of long line]"
        self.lines.append(f"{name}:{number}:{line}")


def search(job: GrepJob) -> GrepReport:
    """What ripgrep would print (hidden, binary and SKIP_DIRS files skipped, but for folders the glob names;
    .gitignore is not read). rg's --glob: without a '/' it matches a file's name at any depth, with one its path
    from the search path or from the workspace root."""
    ws = Workspace(Path(job.root))
    regex = re.compile(job.pattern, re.IGNORECASE if job.ignore_case else 0)
    only = Glob(job.glob) if job.glob else None
    deadline = time.monotonic() + job.time_limit_s
    found = _Matches()
    real, fd = ws.open(job.target, os.O_RDONLY | os.O_NONBLOCK)
    stopped = False
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            stopped = not _grep_file(fd, ws.display(real), regex, found, deadline)
        elif stat.S_ISDIR(mode):
            stopped = _grep_tree(fd, "" if real == ws.root else ws.display(real) + "/", regex, only, found,
                                 deadline)
    finally:
        os.close(fd)
    return GrepReport(found.lines, found.more, stopped)


def _grep_tree(top: int, prefix: str, regex: re.Pattern[str], only: Glob | None, found: _Matches,
               deadline: float) -> bool:
    """Search every file below `top`; whether the deadline stopped it."""
    def descend(entry: TreeEntry) -> bool:
        skipped = entry.name in SKIP_DIRS or entry.name.startswith(".")
        return not skipped or (only is not None and only.names(entry.name))

    with contextlib.closing(walk_tree(top, descend)) as walk:
        for entry in walk:
            if found.full:
                return False
            if time.monotonic() > deadline:
                return True
            if entry.kind != "file" or (entry.name.startswith(".") and not (only is not None and only.dotted)):
                continue
            if only is not None and not (only.match(entry.path) or only.match(prefix + entry.path)
                                         if "/" in only.pattern else only.match(entry.name)):
                continue
            try:  # O_NOFOLLOW: a file swapped for a link since the listing is not followed
                fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             dir_fd=entry.parent)
            except OSError:
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode) and not _grep_file(
                        fd, printable(prefix + entry.path), regex, found, deadline):
                    return True
            except OSError:  # unreadable, or removed meanwhile
                continue
            finally:
                os.close(fd)
    return False


def _grep_file(fd: int, name: str, regex: re.Pattern[str], found: _Matches, deadline: float) -> bool:
    """Add the file's matching lines; False if the deadline passed first."""
    head = os.read(fd, BINARY_SNIFF_BYTES)
    encoding = text_encoding(head)
    if encoding != "utf-8":
        lines = _utf16_lines(fd, head, encoding)
    elif is_binary(head):
        return True
    else:
        lines = (line.decode("utf-8", errors="replace") for line in _lines(fd, head))
    for number, line in enumerate(lines, 1):
        if regex.search(line):  # with a CRLF line's CR, as ripgrep matches
            text = line.removesuffix("\r")
            found.add(name, number, text)
            if found.full:
                return True
        if number % 4096 == 0 and time.monotonic() > deadline:
            return False
    return True


def _utf16_lines(fd: int, head: bytes, encoding: str) -> list[str]:
    """A UTF-16 text's lines (what read_file reads: up to its size limit, whole; none where it is not UTF-16)."""
    data = head + os.read(fd, MAX_READ_BYTES + 1 - len(head))
    if len(data) > MAX_READ_BYTES:
        return []
    try:
        return split_lines(decode_text(data, encoding))
    except UnicodeDecodeError:
        return []


def _lines(fd: int, head: bytes) -> Iterator[bytes]:
    """The file's lines without their newlines, read a chunk at a time; a line is kept to its first
    MAX_LINE_BYTES (the rest is skipped), so memory stays under a chunk plus one such line."""
    buf, skipping = head, False
    while True:
        *complete, buf = buf.split(b"\n")
        for line in complete:
            yield line[:MAX_LINE_BYTES]
        if len(buf) > MAX_LINE_BYTES:
            buf, skipping = buf[:MAX_LINE_BYTES], True
        data = os.read(fd, READ_CHUNK)
        if not data:
            break
        if skipping:
            newline = data.find(b"\n")
            if newline < 0:
                continue
            data, skipping = data[newline:], False
        buf += data
    if buf:
        yield buf


def main() -> None:
    """The grep process: a GrepJob as JSON on stdin, a GrepReport as JSON on stdout."""
    job = msgspec.convert(json.loads(sys.stdin.buffer.read()), GrepJob)
    try:
        report = search(job)
    except ToolError as exc:  # the message alone, for the tool's reply
        sys.exit(str(exc))
    sys.stdout.buffer.write(msgspec.json.encode(report))
