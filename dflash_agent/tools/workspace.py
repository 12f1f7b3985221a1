"""The workspace: the one directory tree the agent's tools may touch."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .tool import ToolError

_OPEN_ATTEMPTS = 5


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
            real = (self.root / Path(path).expanduser()).resolve()
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
        for _ in range(_OPEN_ATTEMPTS):
            real = self.resolve(path)
            try:
                return real, self._open_real(real, flags, mode, make_dirs)
            except OSError as exc:
                # O_NOFOLLOW met a symlink (ELOOP; ENOTDIR where O_DIRECTORY is checked first).
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or not self._has_symlink(real):
                    raise
        raise ToolError(f"{path!r} keeps changing while it is opened (a symlink appears on the way); "
                        "not following it")

    def _open_real(self, real: Path, flags: int, mode: int, make_dirs: bool) -> int:
        parts = real.relative_to(self.root).parts
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if not parts:
            return fd
        try:
            for name in parts[:-1]:
                child = _open_dir(fd, name, make_dirs)
                os.close(fd)
                fd = child
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
        finally:
            os.close(fd)

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
        return rel if rel != "." else "."


def _open_dir(parent: int, name: str, make: bool) -> int:
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
