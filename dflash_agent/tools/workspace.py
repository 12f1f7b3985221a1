"""The workspace: the one directory tree the agent's tools may touch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .tool import ToolError


@dataclass(frozen=True)
class Workspace:
    root: Path
    read_only: bool = False

    def __post_init__(self) -> None:
        root = Path(self.root).expanduser()
        if not root.is_dir():
            raise ValueError(f"workspace {str(root)!r} is not a directory")
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

    def contains(self, real: Path) -> bool:
        return real.is_relative_to(self.root)

    def display(self, real: Path) -> str:
        """How a path inside the workspace is shown to the model: relative to the root."""
        rel = real.relative_to(self.root).as_posix()
        return rel if rel != "." else "."
