"""Git metadata in a workspace, at any depth: git runs what a repository's config names (core.fsmonitor, core.pager,
core.sshCommand, filters, aliases) and its hooks on the host, unsandboxed, when the user next runs `git status` there
(a git-aware shell prompt does on `cd`). The sandbox binds what exists read-only (sandbox.py); what a command made
during a call is renamed out of git's sight afterwards (Shell.bash), and the file tools never write into one."""

from __future__ import annotations

import os
from pathlib import Path

DISABLED_SUFFIX = "-disabled-by-dflash-agent"


def git_metadata(root: Path) -> set[Path]:
    """Every `.git` under `root` (directories, and the `gitdir:` files of worktrees and submodules) and the
    directories such files point to inside `root`; symlinks are not followed, nor .git directories entered."""
    found: set[Path] = set()
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        if ".git" in dirs:
            dirs.remove(".git")
            found.add(here / ".git")
        if ".git" in files:
            found.add(here / ".git")
            target = _gitdir_of(here / ".git")
            if target is not None and target.is_relative_to(root) and target.is_dir():
                found.add(target)
    return found


def _gitdir_of(path: Path) -> Path | None:
    try:
        with open(path, "rb") as f:
            first = f.read(4096).decode(errors="replace").partition("\n")[0]
    except OSError:
        return None
    target = first.removeprefix("gitdir:").strip() if first.startswith("gitdir:") else ""
    return Path(os.path.normpath(path.parent / target)) if target else None


def disable_new(root: Path, before: set[Path]) -> list[str]:
    """Rename each `.git` a command made under `root` (not in `before`) so git no longer finds it; what to tell."""
    notes = []
    for path in sorted(git_metadata(root) - before):
        if path.name != ".git":  # a directory a new .git file points to: disabling the file is enough
            continue
        moved = path.with_name(path.name + DISABLED_SUFFIX)
        n = 1
        while moved.exists() or moved.is_symlink():
            n += 1
            moved = path.with_name(f"{path.name}{DISABLED_SUFFIX}-{n}")
        try:
            path.rename(moved)
        except OSError as exc:
            notes.append(f"[the command made a git repository at {path.relative_to(root)}, which could not be "
                         f"disabled ({exc.strerror}): do not run git there before removing it]")
            continue
        notes.append(f"[the command made {path.relative_to(root)}: git would run its config and hooks outside the "
                     f"sandbox, so it was renamed to {moved.relative_to(root)}]")
    return notes
