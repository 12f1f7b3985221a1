"""The run's transcript: one JSON object per line, each message, tool result and the end, with a
timestamp, written as it happens (a crashed or interrupted run keeps what it did)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..chat.types import Message
from ..errors import UserError
from ..tools.workspace import open_dir

STATE_DIR = ".dflash-agent"
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
log = logging.getLogger(__name__)


def default_transcript_path(repo: Path, read_only: bool) -> Path:
    """REPO/.dflash-agent/transcripts/run-<time>-<pid>.jsonl, or in this user's temp dir for a read-only
    workspace (which the agent must not write into)."""
    base = private_temp_dir() if read_only else repo / STATE_DIR
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")  # microseconds: an MCP server starts runs often
    return base / "transcripts" / f"run-{stamp}-{os.getpid()}.jsonl"


def private_temp_dir() -> Path:
    """$TMPDIR/dflash-agent-<uid>, this user's alone (mode 0700): the temp dir is shared, and a transcript holds
    tasks and file contents. Where another user took the name, or it is a link or a file, a new directory."""
    path = Path(tempfile.gettempdir()) / f"dflash-agent-{os.geteuid()}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077:
        return path
    log.warning("%s is not a private directory of this user: not using it", path)
    return Path(tempfile.mkdtemp(prefix="dflash-agent-"))


class Transcript:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        state = next((p for p in self.path.parents if p.name == STATE_DIR), None)
        try:
            if state is None:
                fd = self._create()
            else:
                fd = self._create_in_repo(state)
        except OSError as exc:
            raise UserError(f"cannot write the transcript {self.path}: {exc.strerror or exc}") from None
        self._file = open(fd, "a", encoding="utf-8")

    def _create(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, _APPEND, 0o600)

    def _create_in_repo(self, state: Path) -> int:
        try:
            return _open_in_state_dir(state, self.path.relative_to(state))
        except OSError as exc:
            # The repo (which the agent, or whoever wrote it, controls) made a part of the state dir a symlink or
            # a file: writing through it would put the transcript anywhere. Or the repo is read-only to us.
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            why = ("holds a symlink or a file where a directory belongs; not writing through it"
                   if exc.errno in (errno.ELOOP, errno.ENOTDIR) else f"cannot be written ({exc.strerror})")
            self.path = default_transcript_path(state.parent, read_only=True)
            log.warning("%s %s: the transcript goes to %s", state, why, self.path)
            return self._create()

    def event(self, kind: str, **fields: Any) -> None:
        record = {"ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "type": kind, **fields}
        self._file.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        self._file.flush()

    def message(self, message: Message, **extra: Any) -> None:
        fields: dict[str, Any] = {"role": message.role, "content": message.text}
        if message.reasoning is not None:
            fields["reasoning"] = message.reasoning
        if message.tool_calls:
            fields["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in message.tool_calls]
        if message.tool_call_id is not None:
            fields["tool_call_id"] = message.tool_call_id
            fields["name"] = message.name
        self.event("message", **fields, **{k: v for k, v in extra.items() if v is not None})

    def close(self) -> None:
        self._file.close()


def _open_in_state_dir(state: Path, rel: Path) -> int:
    """`state / rel` opened for appending, its directories created, one component at a time from the
    repo with O_NOFOLLOW (ELOOP or ENOTDIR where one is a symlink); the state dir gets a .gitignore."""
    fd = os.open(state.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, name in enumerate((state.name, *rel.parts[:-1])):
            child = open_dir(fd, name, make=True)
            os.close(fd)
            fd = child
            if depth == 0:
                _ignore_all(fd)
        return os.open(rel.name, _APPEND | os.O_NOFOLLOW, 0o600, dir_fd=fd)
    finally:
        os.close(fd)


def _ignore_all(state: int) -> None:
    # Keeps `git status` (which the agent reads) clean, as .pytest_cache does.
    try:
        fd = os.open(".gitignore", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=state)
    except FileExistsError:
        return
    with open(fd, "w") as f:
        f.write("*\n")
