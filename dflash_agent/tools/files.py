"""File tools: read_file, write_file, edit_file, list_dir. Every path goes through the workspace."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Annotated

import msgspec

from .tool import ToolError, ToolSpec
from .workspace import Workspace, printable

MAX_READ_BYTES = 10 * 2**20  # larger files are for grep and bash (head, sed -n)
DEFAULT_READ_LINES = 2000
MAX_READ_CHARS = 60_000  # one read's output, whatever the limit asked
MAX_LINE_CHARS = 2000
MAX_DIR_ENTRIES = 1000
SNIPPET_CONTEXT = 3  # lines shown around an edit
_EDIT_ATTEMPTS = 5  # reads and replaces of a file something else keeps changing before an edit gives up
_LATE_APPEND_CHECKS, _LATE_APPEND_WAIT_S = 3, 0.002  # how long an edit watches the replaced file (_carry_late_appends)
BINARY_SNIFF_BYTES = 8192
LOCK_WAIT_S = 30.0  # how long an edit waits for a file that another process is changing
_LOCK_POLL_S = 0.02

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
    """git's test: a NUL byte in the first few KB (a UTF-16 text has them, and is told by its BOM first)."""
    return b"\0" in head[:BINARY_SNIFF_BYTES]


def text_encoding(head: bytes) -> str:
    """How a text file is encoded: UTF-16 where it starts with that BOM (what PowerShell's `>` and Windows tools
    write), else UTF-8 (a UTF-8 BOM is kept as a character)."""
    if head.startswith(codecs.BOM_UTF32_LE):  # FF FE 00 00: not UTF-16 (a binary file to the tools)
        return "utf-8"
    if head.startswith(codecs.BOM_UTF16_LE):
        return "utf-16-le"
    if head.startswith(codecs.BOM_UTF16_BE):
        return "utf-16-be"
    return "utf-8"


def decode_text(data: bytes, encoding: str, errors: str = "strict") -> str:
    """A file's bytes of `encoding` (text_encoding) as text: a UTF-16 file's BOM left out."""
    return (data if encoding == "utf-8" else data[2:]).decode(encoding, errors)


def encode_text(text: str, encoding: str, errors: str = "strict") -> bytes:
    """`text` as a file of `encoding` holds it (decode_text's inverse): a UTF-16 file starts with its BOM again."""
    bom = {"utf-16-le": codecs.BOM_UTF16_LE, "utf-16-be": codecs.BOM_UTF16_BE}.get(encoding, b"")
    return bom + text.encode(encoding, errors)


def split_lines(text: str) -> list[str]:
    """Lines as editors count them: a final newline ends the last line rather than starting one."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def uses_crlf(text: str) -> bool:
    """Whether most of the file's line ends are CRLF (a Windows checkout)."""
    crlf = text.count("\r\n")
    return crlf > 0 and 2 * crlf > text.count("\n")


def with_crlf(text: str) -> str:
    """`text`'s line ends made CRLF, as a model writes a CRLF file's lines with LF (read_file shows no CR)."""
    return text.replace("\r\n", "\n").replace("\n", "\r\n")


def number_lines(lines: list[str], first: int) -> list[str]:
    """`cat -n` style: right-aligned number, tab, text (over-long lines cut, a CRLF's CR left out)."""
    out = []
    for n, line in enumerate(lines, first):
        line = line.removesuffix("\r")  # a CRLF file reads as any other; edit_file matches its lines either way
        if len(line) > MAX_LINE_CHARS:
            line = f"{line[:MAX_LINE_CHARS]}... [line cut: {len(line):,} characters]"
        out.append(f"{n:6}\t{line}")
    return out


class FileTools:
    def __init__(self, workspace: Workspace) -> None:
        self.ws = workspace

    def _open(self, path: str, flags: int) -> tuple[int, os.stat_result]:
        """Open inside the workspace (never through a symlink swapped in after the check, see
        Workspace.open); ToolError unless it is a regular file. O_NONBLOCK: a FIFO must not hang us."""
        try:
            _, fd = self.ws.open(path, flags | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            raise ToolError(f"{path} does not exist") from None
        except IsADirectoryError:
            raise ToolError(f"{path} is a directory") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            kind = "a directory; use list_dir or glob" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ToolError(f"{path} is {kind}")
        return fd, info

    def _open_parent(self, path: str, make_dirs: bool) -> tuple[Path, int]:
        """The real path and its directory, opened by descriptor (see Workspace.open_parent), for a write: never
        into a .git at any depth (the workspace's, a nested repository's or submodule's, one not made yet), whose
        config and hooks git runs outside the sandbox at the user's next `git status` there."""
        if ".git" in self.ws.resolve(path).relative_to(self.ws.root).parts:
            raise ToolError(f"{path} is in a repository's .git: its config and hooks would run outside the "
                            "sandbox, so the tools do not write there")
        try:
            return self.ws.open_parent(path, make_dirs=make_dirs)
        except FileNotFoundError:
            raise ToolError(f"{path} does not exist") from None
        except (FileExistsError, NotADirectoryError):
            raise ToolError(f"{path}: a component of the path is not a directory") from None

    @staticmethod
    def _existing(path: str, parent: int, name: str, flags: int) -> tuple[int, os.stat_result] | None:
        """The file `name` in `parent`, opened with `flags` (which checks that it may be written), or
        None when there is none; ToolError unless it is a regular file. It is looked at before it is
        opened (opening a device or a FIFO can act on it), and opened with O_NOFOLLOW: a symlink here
        was swapped in after the path was resolved."""
        try:
            mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
            if stat.S_ISREG(mode):
                fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as exc:  # swapped for something else between the two looks
            swapped = {errno.ELOOP: stat.S_IFLNK, errno.ENXIO: stat.S_IFIFO, errno.EISDIR: stat.S_IFDIR}
            if exc.errno not in swapped:
                raise
            mode = swapped[exc.errno]
        if stat.S_ISDIR(mode):
            raise ToolError(f"{path} is a directory")
        if stat.S_ISLNK(mode):
            raise ToolError(f"{path} changed while it was opened (it is now a symlink); not following it")
        if not stat.S_ISREG(mode):
            raise ToolError(f"{path} is not a regular file")
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise ToolError(f"{path} changed while it was opened (it is no longer a regular file)")
        return fd, info

    def _read_text(self, path: str) -> str:
        """A text file's content; ToolError for anything that is not one."""
        fd, info = self._open(path, os.O_RDONLY)
        with open(fd, "rb") as f:
            return self._decode(path, f, info)[0]

    def _decode(self, path: str, f, info: os.stat_result, errors: str = "replace") -> tuple[str, str]:
        """The text of the file `f` and its encoding (text_encoding)."""
        size = info.st_size
        if size > MAX_READ_BYTES:
            raise ToolError(f"{path} is {size / 2**20:.1f} MB, over the {MAX_READ_BYTES // 2**20} MB read limit; "
                            "use grep, or bash with head / sed -n, to look at parts of it")
        data = f.read(MAX_READ_BYTES + 1)
        encoding = text_encoding(data)
        if encoding == "utf-8":
            if is_binary(data):
                raise ToolError(f"{path} is a binary file ({size:,} bytes); it cannot be shown as text")
            return decode_text(data, encoding, errors), encoding
        try:
            return decode_text(data, encoding), encoding
        except UnicodeDecodeError:
            raise ToolError(f"{path} starts as UTF-16 text but is not ({size:,} bytes); it cannot be shown as "
                            "text") from None

    # Each tool's work runs in a thread: a 10 MB edit costs seconds of CPU and fsync waits on the disk,
    # and either would stall every other call (an MCP server's, an HTTP server's) on the event loop.
    async def read_file(self, args: ReadFileArgs) -> str:
        return await asyncio.to_thread(self._read_file, args)

    async def write_file(self, args: WriteFileArgs) -> str:
        return await _cancellable(self._write_file, args)

    async def edit_file(self, args: EditFileArgs) -> str:
        return await _cancellable(self._edit_file, args)

    async def list_dir(self, args: ListDirArgs) -> str:
        return await asyncio.to_thread(self._list_dir, args.path)

    def _read_file(self, args: ReadFileArgs) -> str:
        text = self._read_text(args.path)
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

    def _write_file(self, args: WriteFileArgs, cancel: threading.Event) -> str:
        if args.path.endswith("/"):
            raise ToolError(f"{args.path} names a directory; give the path of the file to write")
        content = args.content
        _utf8(content, "content")
        made = self._missing_dirs(args.path)
        try:
            real, parent, existing = self._locked(args.path, True)
        except BaseException:
            self._remove_empty(made)
            raise
        kept = ""
        try:
            encoding = "utf-8"
            if existing is not None:  # a rewrite keeps the file's line ends and encoding
                old = _read_some(existing[0], MAX_READ_BYTES + 1)
                encoding = text_encoding(old)
                if encoding != "utf-8":
                    content, kept = content.removeprefix("\ufeff"), f", {encoding.upper()[:6]} kept"
                crlf = len(old) <= MAX_READ_BYTES and uses_crlf(decode_text(old, encoding, "replace"))
                if crlf and "\r" not in content:
                    content, kept = with_crlf(content), ", CRLF line ends kept" + kept
            data = encode_text(content, encoding)
            _stop_if(cancel)
            replace_file(parent, real.name, data, existing)
        except BaseException:
            self._remove_empty(made)  # a write that failed (a full disk) leaves no directories it made
            raise
        finally:
            _close(parent, existing)
        verb = "overwrote" if existing is not None else "created"
        return f"{verb} {self.ws.display(real)} ({len(split_lines(content))} lines, {len(data):,} bytes{kept})"

    def _missing_dirs(self, path: str) -> list[str]:
        """The directories a write of `path` would make, deepest first, as paths within the workspace."""
        try:
            parts = self.ws.resolve(path).relative_to(self.ws.root).parts[:-1]
        except (OSError, ToolError, ValueError):
            return []
        missing = []
        for depth in range(len(parts), 0, -1):
            if os.path.lexists(self.ws.root.joinpath(*parts[:depth])):
                break
            missing.append(os.path.join(*parts[:depth]))
        return missing

    def _remove_empty(self, dirs: list[str]) -> None:
        """rmdir each of `dirs` (deepest first) still empty, through descriptors, as the write opened them."""
        for folder in dirs:
            try:
                _, parent = self.ws.open_parent(folder)
            except (OSError, ToolError):
                continue
            try:
                with contextlib.suppress(OSError):  # not empty (someone else's file in it), or gone already
                    os.rmdir(Path(folder).name, dir_fd=parent)
            finally:
                os.close(parent)

    def _locked(self, path: str, make_dirs: bool) -> tuple[Path, int, tuple[int, os.stat_result] | None]:
        """For a write: the real path, its directory (`_open_parent`) and the file there if any (`_existing`,
        open for writing), holding the file's lock (flock) until its descriptor is closed. Edits and writes of
        one file from several calls (MCP clients, agents on one repository) take turns, across processes too, so
        none works on a text that another is replacing. The lock is the replaced file's: whoever waited for it
        opens the new one, and so it does where the path led elsewhere meanwhile (a directory renamed).
        _LockBusy while another holds it (see _cancellable)."""
        while True:
            real, parent = self._open_parent(path, make_dirs)
            try:
                try:
                    existing = self._existing(path, parent, real.name, os.O_RDWR)
                except PermissionError:  # a file we may write but not read
                    existing = self._existing(path, parent, real.name, os.O_WRONLY)
            except BaseException:
                os.close(parent)
                raise
            if existing is None:
                return real, parent, None
            try:
                try:
                    fcntl.flock(existing[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise _LockBusy() from None
                if self._still_at(path, real, parent, existing[1]):
                    return real, parent, (existing[0], os.fstat(existing[0]))
            except BaseException:
                _close(parent, existing)
                raise
            _close(parent, existing)  # replaced or moved while we waited: the path's file now

    def _still_at(self, path: str, real: Path, parent: int, info: os.stat_result) -> bool:
        """Whether `path` still names the file `info` in the directory `parent`."""
        try:
            now_real, now_parent = self.ws.open_parent(path)
        except (OSError, ToolError):
            return False
        try:
            now = os.stat(real.name, dir_fd=now_parent, follow_symlinks=False)
            same = os.path.samestat
            return now_real == real and same(os.fstat(now_parent), os.fstat(parent)) and same(now, info)
        except FileNotFoundError:
            return False
        finally:
            os.close(now_parent)

    def _edit_file(self, args: EditFileArgs, cancel: threading.Event) -> str:
        if not args.old_string:
            raise ToolError("old_string is empty; use write_file to create a file or replace all of it")
        if args.old_string == args.new_string:
            raise ToolError("old_string and new_string are the same; there is nothing to change")
        _utf8(args.new_string, "new_string")
        real, parent, existing = self._locked(args.path, False)
        try:
            if existing is None:
                raise ToolError(f"{args.path} does not exist")
            fd = existing[0]
            for attempt in range(_EDIT_ATTEMPTS):
                # a writer that takes no lock (a command appending to the file) may change it under the edit:
                # each attempt reads what is there now and replaces it only if it is still that
                info = os.fstat(fd)
                with open(fd, "rb", closefd=False) as f:
                    f.seek(0)
                    # Bytes that are not UTF-8 (a Latin-1 comment) are carried through as they are.
                    text, encoding = self._decode(args.path, f, info, errors="surrogateescape")
                updated, starts, count = _replaced(text, args)
                _stop_if(cancel)
                if replace_file(parent, real.name, encode_text(updated, encoding, "surrogateescape"), (fd, info),
                                unless_changed=True):
                    break
            else:
                raise ToolError(f"{args.path} kept changing while it was being edited ({_EDIT_ATTEMPTS} tries: "
                                "something is writing to it); nothing was replaced")
        finally:
            _close(parent, existing)
        # The first replacement's neighbourhood, as it reads now.
        lines_at = _line_numbers(text, starts)
        new_lines = split_lines(updated)
        lo = max(1, lines_at[0] - SNIPPET_CONTEXT)
        hi = min(len(new_lines), lines_at[0] + args.new_string.count("\n") + SNIPPET_CONTEXT)
        where = f"line {lines_at[0]}" if count == 1 else f"lines {_join_numbers(lines_at)}"
        noun = "occurrence" if count == 1 else "occurrences"
        snippet = printable("\n".join(number_lines(new_lines[lo - 1:hi], lo)))
        return f"replaced {count} {noun} in {self.ws.display(real)} ({where}); it now reads:\n{snippet}"

    def _list_dir(self, path: str) -> str:
        try:
            real, fd = self.ws.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            raise ToolError(f"{path} does not exist") from None
        entries = []
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                raise ToolError(f"{path} is not a directory")
            # Listed through the descriptor, so a directory swapped for a link meanwhile is not followed.
            with os.scandir(fd) as it:
                for entry in it:
                    name = printable(entry.name)
                    try:
                        if entry.is_symlink():
                            name += " -> " + printable(os.readlink(entry.name, dir_fd=fd))
                        elif entry.is_dir(follow_symlinks=False):
                            name += "/"
                    except OSError:  # removed meanwhile
                        continue
                    entries.append(name)
        finally:
            os.close(fd)
        if not entries:
            return f"({self.ws.display(real)} is empty)"
        entries.sort()
        more = len(entries) - MAX_DIR_ENTRIES
        if more > 0:
            entries = entries[:MAX_DIR_ENTRIES] + [f"[{more:,} more entries; use glob to narrow down]"]
        return "\n".join(entries)


class _LockBusy(Exception):
    """Another process holds the file's lock: the call waits on the event loop and tries again (a thread waiting
    in flock would hold one of the few the tools share)."""


async def _cancellable(work, args):
    """`work(args, cancel)` in a thread, again while the file it writes is locked by another (up to LOCK_WAIT_S).
    `cancel` is set when the call is cancelled, which a thread cannot be: the write does not happen if it has not
    yet."""
    cancel = threading.Event()
    deadline = time.monotonic() + LOCK_WAIT_S
    try:
        while True:
            try:
                return await asyncio.to_thread(work, args, cancel)
            except _LockBusy:
                if time.monotonic() > deadline:
                    raise ToolError(f"{args.path} is being changed by another process, which has held its lock for "
                                    f"{LOCK_WAIT_S:g} s; try again later") from None
                await asyncio.sleep(_LOCK_POLL_S)
    except asyncio.CancelledError:
        cancel.set()
        raise


def _stop_if(cancel: threading.Event) -> None:
    if cancel.is_set():
        raise ToolError("cancelled")


def _close(parent: int, existing: tuple[int, os.stat_result] | None) -> None:
    os.close(parent)
    if existing is not None:
        os.close(existing[0])


def _read_some(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes from the start of an open file; none where it may only be written."""
    try:
        return os.pread(fd, limit, 0)
    except OSError as exc:
        if exc.errno != errno.EBADF:
            raise
        return b""


def _replaced(text: str, args: EditFileArgs) -> tuple[str, list[int], int]:
    """`text` with the edit made, where old_string occurred, and how many times it was replaced; ToolError when
    old_string is not there, or is there more than once without replace_all. read_file shows no CRs, so where the
    file has CRLF line ends an LF in old_string matches either (a file may mix them), and new_string's line ends
    become those of the text it replaces (the file's most common where that has none). Strings that hold CRs of
    their own match as they are."""
    old, new = args.old_string, args.new_string
    if "\r" in old or "\r\n" not in text:
        starts = _occurrences(text, old)
        found = [(start, start + len(old)) for start in starts]
    else:
        pattern = re.compile("\r?\n".join(re.escape(part) for part in old.split("\n")))
        found = [m.span() for m in pattern.finditer(text)]
        starts = [start for start, _ in found]
    if not found:
        raw = (" The file holds bytes that are not UTF-8 (read_file shows them as \ufffd); change those lines "
               "with bash." if "\ufffd" in old and "\ufffd" not in text else "")
        raise ToolError(f"old_string was not found in {args.path} (0 matches). It must match the file "
                        f"exactly, whitespace and indentation included.{_near_misses(text, old)} "
                        f"Read the file to see its current text.{raw}")
    if len(found) > 1 and not args.replace_all:
        raise ToolError(f"old_string occurs {len(found)} times in {args.path} (at lines "
                        f"{_join_numbers(_line_numbers(text, starts))}); include more surrounding text to make it "
                        "unique, or set replace_all to replace every occurrence")
    found = found if args.replace_all else found[:1]
    crlf_file = uses_crlf(text)
    pieces, at = [], 0
    for start, end in found:
        replaced = text[start:end]
        crlf = "\r\n" in replaced if "\n" in replaced else crlf_file
        pieces += [text[at:start], with_crlf(new) if crlf else new]
        at = end
    pieces.append(text[at:])
    return "".join(pieces), starts[:len(found)], len(found)


def replace_file(parent: int, name: str, data: bytes, existing: tuple[int, os.stat_result] | None,
                 unless_changed: bool = False) -> bool:
    """Give `name` in the directory `parent` the content `data`. All or nothing where it can: a temporary file next
    to it is written, synced and renamed over it, so a full disk or a file-size limit leaves the old file whole (and
    no new one); it keeps the mode and owner of `existing` (the file replaced: a descriptor open for writing, and
    its stat), whose other hard links, if any, keep the old content. Where the new file could not keep the owner
    (another user's file that we may write) or the directory takes no new file, the old one is written in place,
    as an editor writes it. `unless_changed`: nothing is replaced, and False returned, where `existing` changed
    since its stat was taken (its size, or its times: what a writer's write changes), checked just before the
    file is replaced; else True."""
    like = None if existing is None else existing[1]
    # A part of the name, cut in bytes: the whole name may already be the 255 bytes a name can have.
    tmp = f".{os.fsencode(name)[:64].decode('utf-8', 'ignore')}.{secrets.token_hex(6)}.dflash-tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=parent)
    except PermissionError:
        if existing is None:
            raise
        if unless_changed and _changed(existing):
            return False
        _write_in_place(existing[0], data)
        return True
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
        if like is not None:
            if (like.st_uid, like.st_gid) != (os.geteuid(), os.getegid()):
                try:
                    os.fchown(fd, like.st_uid, like.st_gid)
                except PermissionError:
                    assert existing is not None
                    os.close(fd)
                    fd = -1
                    os.unlink(tmp, dir_fd=parent)
                    if unless_changed and _changed(existing):
                        return False
                    _write_in_place(existing[0], data)
                    return True
            os.fchmod(fd, stat.S_IMODE(like.st_mode))  # after fchown, which clears set-user-ID
        os.fsync(fd)
        os.close(fd)
        fd = -1
        if unless_changed and existing is not None and _changed(existing):
            os.unlink(tmp, dir_fd=parent)
            return False
        os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        if unless_changed and existing is not None:
            _carry_late_appends(parent, name, existing)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=parent)
        raise
    return True


def _carry_late_appends(parent: int, name: str, existing: tuple[int, os.stat_result]) -> None:
    """What a writer that opened the old file before the rename appended to it after the last check, added to the
    new one: else it would go with the old file. Such a write lands within moments of the rename, so the old file
    is watched a few milliseconds more. (A writer that keeps the old file open writes on into it.)"""
    fd, carried = existing[0], existing[1].st_size
    for _ in range(_LATE_APPEND_CHECKS):
        size = os.fstat(fd).st_size
        if size > carried:
            tail = os.pread(fd, size - carried, carried)
            new = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            try:
                os.write(new, tail)
            finally:
                os.close(new)
            carried = size
        time.sleep(_LATE_APPEND_WAIT_S)


def _changed(existing: tuple[int, os.stat_result]) -> bool:
    now, then = os.fstat(existing[0]), existing[1]
    return (now.st_size, now.st_mtime_ns, now.st_ctime_ns) != (then.st_size, then.st_mtime_ns, then.st_ctime_ns)


def _write_in_place(fd: int, data: bytes) -> None:
    """`data` over the open file's content, then cut to its length: the inode, owner and links stay. Where that
    fails part way (a full disk), the old content is put back, as it can be: into the blocks it had."""
    size = os.fstat(fd).st_size
    old = _read_some(fd, size)
    try:
        _pwrite_all(fd, data)
    except OSError as exc:
        try:
            if len(old) != size:  # a file we may only write: nothing to put back
                raise OSError(exc.errno, exc.strerror)
            _pwrite_all(fd, old)
        except OSError:
            raise ToolError(f"the file could only be written in place, and that failed part way ({exc.strerror}): "
                            "it is left partly written") from None
        raise


def _pwrite_all(fd: int, data: bytes) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:done + 2**24], done)
    os.ftruncate(fd, len(data))
    os.fsync(fd)


def _utf8(text: str, what: str) -> bytes:
    """`text` as UTF-8; ToolError if it holds a lone surrogate (JSON's "\\ud800" can carry one)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ToolError(f"{what} holds a lone surrogate ({text[exc.start:exc.end]!r} at character {exc.start}), "
                        "which no UTF-8 file can hold; send the character itself") from None


def _line_numbers(text: str, offsets: list[int]) -> list[int]:
    """The line of each of the ascending `offsets`, counted on from the previous one (counting from
    the start each time is quadratic: minutes for 100,000 occurrences)."""
    out, line, at = [], 1, 0
    for offset in offsets:
        line += text.count("\n", at, offset)
        at = offset
        out.append(line)
    return out


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
    hits = _runs([line.strip() for line in split_lines(text)], want)
    if not hits:
        return ""
    return f" It does match at line{'s' if len(hits) > 1 else ''} {_join_numbers(hits)} if whitespace is ignored."


def _runs(have: list[str], want: list[str]) -> list[int]:
    """The 1-based lines where `want` occurs in `have` as consecutive lines, overlaps included. KMP:
    linear, where comparing a slice at every line costs len(have) x len(want) (minutes on a file of
    repeated lines)."""
    fallback, k = [0] * len(want), 0  # fallback[i]: the longest proper border of want[:i + 1]
    for i in range(1, len(want)):
        while k and want[i] != want[k]:
            k = fallback[k - 1]
        if want[i] == want[k]:
            k += 1
        fallback[i] = k
    hits, k = [], 0
    for i, line in enumerate(have):
        while k and line != want[k]:
            k = fallback[k - 1]
        if line == want[k]:
            k += 1
        if k == len(want):
            hits.append(i - k + 2)
            k = fallback[k - 1]
    return hits


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
