"""File tools: read_file, write_file, edit_file, list_dir. Every path goes through the workspace."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Annotated

import msgspec

from .tool import ToolError, ToolSpec
from .workspace import Workspace

MAX_READ_BYTES = 10 * 2**20  # larger files are for grep and bash (head, sed -n)
DEFAULT_READ_LINES = 2000
MAX_READ_CHARS = 60_000  # one read's output, whatever the limit asked
MAX_LINE_CHARS = 2000
MAX_DIR_ENTRIES = 1000
SNIPPET_CONTEXT = 3  # lines shown around an edit
BINARY_SNIFF_BYTES = 8192

FilePath = Annotated[str, msgspec.Meta(description="File path, relative to the workspace root.")]


class ReadFileArgs(msgspec.Struct, forbid_unknown_fields=True):
    path: FilePath
    offset: Annotated[int, msgspec.Meta(ge=1, description="First line to read (1-based).")] = 1
    limit: Annotated[int, msgspec.Meta(ge=1, description="How many lines to read.")] = DEFAULT_READ_LINES


class WriteFileArgs(msgspec.Struct, forbid_unknown_fields=True):
    path: FilePath
    content: Annotated[str, msgspec.Meta(description="The file's whole new content.")]


class EditFileArgs(msgspec.Struct, forbid_unknown_fields=True):
    path: FilePath
    old_string: Annotated[str, msgspec.Meta(description="Exact text to replace, whitespace included.")]
    new_string: Annotated[str, msgspec.Meta(description="The text to put in its place.")]
    replace_all: Annotated[bool, msgspec.Meta(description="Replace every occurrence, not just one.")] = False


class ListDirArgs(msgspec.Struct, forbid_unknown_fields=True):
    path: Annotated[str, msgspec.Meta(description="Directory, relative to the workspace root.")] = "."


def is_binary(head: bytes) -> bool:
    """git's test: a NUL byte in the first few KB."""
    return b"\0" in head[:BINARY_SNIFF_BYTES]


def split_lines(text: str) -> list[str]:
    """Lines as editors count them: a final newline ends the last line rather than starting one."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def number_lines(lines: list[str], first: int) -> list[str]:
    """`cat -n` style: right-aligned number, tab, text (over-long lines cut)."""
    out = []
    for n, line in enumerate(lines, first):
        if len(line) > MAX_LINE_CHARS:
            line = f"{line[:MAX_LINE_CHARS]}... [line cut: {len(line):,} characters]"
        out.append(f"{n:6}\t{line}")
    return out


class FileTools:
    def __init__(self, workspace: Workspace) -> None:
        self.ws = workspace

    def _open(self, path: str, flags: int, make_dirs: bool = False) -> tuple[Path, int, os.stat_result]:
        """Open inside the workspace (never through a symlink swapped in after the check, see
        Workspace.open); ToolError unless it is a regular file. O_NONBLOCK: a FIFO must not hang us."""
        try:
            real, fd = self.ws.open(path, flags | os.O_NONBLOCK, make_dirs=make_dirs)
        except (FileNotFoundError, NotADirectoryError):
            raise ToolError(f"{path} does not exist") from None
        except IsADirectoryError:
            raise ToolError(f"{path} is a directory") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            kind = "a directory; use list_dir or glob" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ToolError(f"{path} is {kind}")
        return real, fd, info

    @staticmethod
    def _refuse_hard_links(path: str, info: os.stat_result, fd: int) -> None:
        # Writing through a file that has other names changes them too, and they may lie outside the
        # workspace (`ln /outside/file x` in bash); a path check cannot see them, so such files are
        # not written. Reading is allowed: it shows nothing bash in the workspace cannot read.
        if info.st_nlink > 1:
            os.close(fd)
            raise ToolError(f"{path} has {info.st_nlink} hard links; writing it would change the other names "
                            "too, which may be outside the workspace. Copy it (cp) and write the copy instead")

    def read_text(self, path: str) -> tuple[Path, str]:
        """A text file's real path and content; ToolError for anything that is not one."""
        real, fd, info = self._open(path, os.O_RDONLY)
        with open(fd, "rb") as f:
            return real, self._decode(path, f, info)

    def _decode(self, path: str, f, info: os.stat_result) -> str:
        size = info.st_size
        if size > MAX_READ_BYTES:
            raise ToolError(f"{path} is {size / 2**20:.1f} MB, over the {MAX_READ_BYTES // 2**20} MB read limit; "
                            "use grep, or bash with head / sed -n, to look at parts of it")
        data = f.read(MAX_READ_BYTES + 1)
        if is_binary(data):
            raise ToolError(f"{path} is a binary file ({size:,} bytes); it cannot be shown as text")
        return data.decode("utf-8", errors="replace")

    async def read_file(self, args: ReadFileArgs) -> str:
        _, text = self.read_text(args.path)
        lines = split_lines(text)
        if not lines:
            return f"({args.path} is empty)"
        if args.offset > len(lines):
            raise ToolError(f"offset {args.offset} is past the end of {args.path} ({len(lines)} lines)")
        start = args.offset - 1
        shown = number_lines(lines[start:start + args.limit], args.offset)
        # Keep whole lines up to the character cap.
        total = 0
        for count, line in enumerate(shown):
            total += len(line) + 1
            if total > MAX_READ_CHARS and count > 0:
                shown = shown[:count]
                break
        last = args.offset + len(shown) - 1
        if last < len(lines):
            shown.append(f"[lines {args.offset}-{last} of {len(lines)}; read on with offset={last + 1}]")
        return "\n".join(shown)

    async def write_file(self, args: WriteFileArgs) -> str:
        flags = os.O_WRONLY | os.O_CREAT
        try:
            real, fd, info = self._open(args.path, flags | os.O_EXCL, make_dirs=True)
            existed = False
        except FileExistsError:
            real, fd, info = self._open(args.path, flags)
            existed = True
            self._refuse_hard_links(args.path, info, fd)
        data = args.content.encode("utf-8")
        with open(fd, "wb") as f:
            # Truncated only now, after the checks: opening with O_TRUNC would empty a hard-linked file.
            f.truncate(0)
            f.write(data)
        verb = "overwrote" if existed else "created"
        return f"{verb} {self.ws.display(real)} ({len(split_lines(args.content))} lines, {len(data):,} bytes)"

    async def edit_file(self, args: EditFileArgs) -> str:
        if not args.old_string:
            raise ToolError("old_string is empty; use write_file to create a file or replace all of it")
        if args.old_string == args.new_string:
            raise ToolError("old_string and new_string are the same; there is nothing to change")
        real, fd, info = self._open(args.path, os.O_RDWR)
        self._refuse_hard_links(args.path, info, fd)
        with open(fd, "r+b") as f:
            text = self._decode(args.path, f, info)
            starts = _occurrences(text, args.old_string)
            if not starts:
                raise ToolError(f"old_string was not found in {args.path} (0 matches). It must match the file "
                                f"exactly, whitespace and indentation included.{_near_misses(text, args.old_string)} "
                                "Read the file to see its current text.")
            lines_at = [text.count("\n", 0, i) + 1 for i in starts]
            if len(starts) > 1 and not args.replace_all:
                raise ToolError(f"old_string occurs {len(starts)} times in {args.path} (at lines "
                                f"{_join_numbers(lines_at)}); include more surrounding text to make it unique, "
                                "or set replace_all to replace every occurrence")
            count = len(starts) if args.replace_all else 1
            updated = text.replace(args.old_string, args.new_string, count)
            f.seek(0)
            f.truncate(0)
            f.write(updated.encode("utf-8"))
        # The first replacement's neighbourhood, as it reads now.
        first = lines_at[0]
        new_lines = split_lines(updated)
        lo = max(1, first - SNIPPET_CONTEXT)
        hi = min(len(new_lines), first + args.new_string.count("\n") + SNIPPET_CONTEXT)
        where = f"line {first}" if count == 1 else f"lines {_join_numbers(lines_at)}"
        noun = "occurrence" if count == 1 else "occurrences"
        snippet = "\n".join(number_lines(new_lines[lo - 1:hi], lo))
        return f"replaced {count} {noun} in {self.ws.display(real)} ({where}); it now reads:\n{snippet}"

    async def list_dir(self, args: ListDirArgs) -> str:
        try:
            real, fd = self.ws.open(args.path, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            raise ToolError(f"{args.path} does not exist") from None
        entries = []
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                raise ToolError(f"{args.path} is not a directory")
            # Listed through the descriptor, so a directory swapped for a link meanwhile is not followed.
            with os.scandir(fd) as it:
                for entry in it:
                    if entry.is_symlink():
                        entries.append(f"{entry.name} -> {os.readlink(entry.name, dir_fd=fd)}")
                    elif entry.is_dir():
                        entries.append(entry.name + "/")
                    else:
                        entries.append(entry.name)
        finally:
            os.close(fd)
        if not entries:
            return f"({self.ws.display(real)} is empty)"
        entries.sort()
        more = len(entries) - MAX_DIR_ENTRIES
        if more > 0:
            entries = entries[:MAX_DIR_ENTRIES] + [f"[{more:,} more entries; use glob to narrow down]"]
        return "\n".join(entries)


def _occurrences(text: str, needle: str) -> list[int]:
    """Start offsets of non-overlapping occurrences, as str.replace counts them."""
    out, i = [], text.find(needle)
    while i >= 0:
        out.append(i)
        i = text.find(needle, i + len(needle))
    return out


def _near_misses(text: str, needle: str) -> str:
    """Where the needle's lines occur when whitespace at their ends is ignored: the usual reason an
    exact match fails is indentation."""
    want = [line.strip() for line in split_lines(needle)]
    if not any(want):
        return ""
    have = [line.strip() for line in split_lines(text)]
    hits = [i + 1 for i in range(len(have) - len(want) + 1) if have[i:i + len(want)] == want]
    if not hits:
        return ""
    return f" It does match at line{'s' if len(hits) > 1 else ''} {_join_numbers(hits)} if whitespace is ignored."


def _join_numbers(numbers: list[int], limit: int = 20) -> str:
    shown = ", ".join(str(n) for n in numbers[:limit])
    return shown + (f" and {len(numbers) - limit} more" if len(numbers) > limit else "")


def file_tools(workspace: Workspace) -> list[ToolSpec]:
    files = FileTools(workspace)
    return [
        ToolSpec("read_file", "Read a text file, with line numbers; `offset` and `limit` select lines.",
                 ReadFileArgs, files.read_file, read_only=True, idempotent=True),
        ToolSpec("write_file", "Create a file, or overwrite one, with `content`; missing directories are created.",
                 WriteFileArgs, files.write_file, destructive=True, idempotent=True),
        ToolSpec("edit_file", "Replace `old_string` with `new_string` in a file. old_string must match exactly and "
                 "occur once, unless replace_all is set. Read the file first.",
                 EditFileArgs, files.edit_file, destructive=True),
        ToolSpec("list_dir", "List a directory; subdirectories end with '/'.",
                 ListDirArgs, files.list_dir, read_only=True, idempotent=True),
    ]
