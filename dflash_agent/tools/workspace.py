"""The workspace: the one directory tree the agent's tools may touch."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import UserError
from .tool import ToolError

_OPEN_ATTEMPTS = 5
MAX_WALK_DEPTH = 128  # a descriptor per level is open during a walk
# Never worth searching: version control, caches, environments.
SKIP_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", "node_modules", ".venv", ".tox", ".mypy_cache",
                       ".pytest_cache", ".ruff_cache", ".hypothesis", ".dflash-agent"})


@dataclass(frozen=True)
class Workspace:
    root: Path
    read_only: bool = False

    def __post_init__(self) -> None:
        root = Path(self.root).expanduser()
        if not root.is_dir():
            raise UserError(f"workspace {str(root)!r} is not a directory")
        # Symlinks resolved once here, so every check below compares real paths.
        object.__setattr__(self, "root", root.resolve())

    def resolve(self, path: str) -> Path:
        """The real path `path` names: relative paths start at the root; `..`, absolute paths and
        symlinks are followed, and the result must stay inside the root (ToolError otherwise)."""
        if "\0" in path:
            raise ToolError(f"{path!r} is not a valid path (it holds a NUL byte)")
        try:
            given = Path(path).expanduser()
        except RuntimeError:  # `~user` of no such user
            raise ToolError(f"{path!r}: its home directory (~) is unknown; give the path from the workspace "
                            "root") from None
        try:
            real = (self.root / given).resolve()
        except RuntimeError:  # Python < 3.13 reports a symlink loop this way
            raise ToolError(f"{path!r}: too many levels of symbolic links") from None
        if not real.is_relative_to(self.root):
            raise ToolError(f"{path!r} is outside the workspace {self.root}; paths must stay inside it")
        return real

    def open(self, path: str, flags: int = os.O_RDONLY, mode: int = 0o666, make_dirs: bool = False) -> tuple[Path, int]:
        """`resolve(path)` and a file descriptor for it, opened one component at a time from the root
        with O_NOFOLLOW. The resolved path holds no symlink, so meeting one on the way means the tree
        changed since the check (a directory swapped for a link): the walk starts again, and gives up
        with a ToolError rather than follow it out of the workspace. `make_dirs` creates missing
        parent directories the same way. Opening the root itself ignores `flags`."""
        return self._retrying(path, lambda real: self._open_real(real, flags, mode, make_dirs))

    def open_parent(self, path: str, make_dirs: bool = False) -> tuple[Path, int]:
        """`resolve(path)` and a descriptor of the directory holding it, opened as `open` does: the
        caller creates, opens (with O_NOFOLLOW) or renames `real.name` relative to it, so a swap of any
        directory on the way cannot redirect it. The root has no parent here: ToolError."""
        def attempt(real: Path) -> int:
            if real == self.root:
                raise ToolError(f"{path!r} is the workspace root, a directory")
            return self._open_parent_real(real, make_dirs)
        return self._retrying(path, attempt)

    def _retrying(self, path: str, attempt: Callable[[Path], int]) -> tuple[Path, int]:
        for _ in range(_OPEN_ATTEMPTS):
            real = self.resolve(path)
            try:
                return real, attempt(real)
            except OSError as exc:
                # O_NOFOLLOW met a symlink (ELOOP; ENOTDIR where O_DIRECTORY is checked first).
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or not self._has_symlink(real):
                    raise
        raise ToolError(f"{path!r} keeps changing while it is opened (a symlink appears on the way); "
                        "not following it")

    def _open_real(self, real: Path, flags: int, mode: int, make_dirs: bool) -> int:
        if real == self.root:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        parent = self._open_parent_real(real, make_dirs)
        try:
            _refuse_device(parent, real.name, self.display(real))
            return os.open(real.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
        finally:
            os.close(parent)

    def _open_parent_real(self, real: Path, make_dirs: bool) -> int:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in real.relative_to(self.root).parts[:-1]:
                child = open_dir(fd, name, make_dirs)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _has_symlink(self, real: Path) -> bool:
        """Whether a component of `real` below the root is now a symlink (so the tree changed)."""
        for parent in (real, *real.parents):
            if parent == self.root:
                return False
            if parent.is_symlink():
                return True
        return False

    def contains(self, real: Path) -> bool:
        return real.is_relative_to(self.root)

    def display(self, real: Path) -> str:
        """How a path inside the workspace is shown to the model: relative to the root."""
        rel = real.relative_to(self.root).as_posix()
        return printable(rel) if rel != "." else "."


def _refuse_device(parent: int, name: str, shown: str) -> None:
    """ToolError if `name` in `parent` is a device: opening one can act on it (a watchdog starts its
    countdown, a tape rewinds), and a repo unpacked by root can hold one."""
    try:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        raise ToolError(f"{shown!r} is a device; the tools never open one")


def printable(name: str) -> str:
    """A file name, an argument or a line read as text: bytes that are not UTF-8 (kept by os and stdin as lone
    surrogates, which JSON encoders refuse) become U+FFFD."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate os did not make (from a JSON escape)
        return name.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def open_dir(parent: int, name: str, make: bool = False) -> int:
    """The directory `name` in the open directory `parent`, never through a symlink (ELOOP or
    ENOTDIR if it is one); `make` creates it when missing."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=parent)
    except FileNotFoundError:
        if not make:
            raise
    try:
        os.mkdir(name, dir_fd=parent)
    except FileExistsError:  # made meanwhile: opened below like any other
        pass
    return os.open(name, flags, dir_fd=parent)


EntryKind = Literal["dir", "file", "link", "other"]  # file: regular; link: never followed; other: FIFO, device


@dataclass(frozen=True)
class TreeEntry:
    path: str  # '/'-separated, relative to where the walk started
    name: str
    kind: EntryKind
    parent: int  # descriptor of the directory holding it; open only until the walk moves on


def walk_tree(top: int, descend: Callable[[TreeEntry], bool]) -> Iterator[TreeEntry]:
    """Everything below the open directory `top`, depth first with names sorted (so in path order),
    entering the directories `descend` accepts. Directories are opened by descriptor relative to their
    parent with O_NOFOLLOW, so a directory swapped for a symlink is not entered, symlinks are never
    followed (a loop of links is two "link" entries) and nothing leads out of the tree. Open
    descriptors grow with depth, so below MAX_WALK_DEPTH directories are listed but not entered.
    Closing the generator early (break) closes what it opened; `top` stays the caller's."""
    frames: list[tuple[int, str, Iterator[tuple[str, EntryKind]]]] = [(top, "", _listing(top))]
    try:
        while frames:
            fd, prefix, entries = frames[-1]
            nxt = next(entries, None)
            if nxt is None:
                frames.pop()
                if fd != top:
                    os.close(fd)
                continue
            name, kind = nxt
            entry = TreeEntry(prefix + name, name, kind, fd)
            yield entry
            if kind != "dir" or len(frames) > MAX_WALK_DEPTH or not descend(entry):
                continue
            try:
                child = open_dir(fd, name)
            except OSError:  # removed, swapped for a link or unreadable meanwhile: not entered
                continue
            try:
                frames.append((child, entry.path + "/", _listing(child)))
            except OSError:
                os.close(child)
    finally:
        for fd, _, _ in frames:
            if fd != top:
                os.close(fd)


def _listing(fd: int) -> Iterator[tuple[str, EntryKind]]:
    entries: list[tuple[str, EntryKind]] = []
    with os.scandir(fd) as it:
        for entry in it:
            try:
                entries.append((entry.name, _kind(entry)))
            except OSError:  # removed meanwhile
                continue
    entries.sort()
    return iter(entries)


def _kind(entry: os.DirEntry[str]) -> EntryKind:
    if entry.is_symlink():
        return "link"
    if entry.is_dir(follow_symlinks=False):
        return "dir"
    if entry.is_file(follow_symlinks=False):
        return "file"
    return "other"
