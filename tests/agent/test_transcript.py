"""The transcript file: where it goes, and that a repo cannot redirect it outside itself."""

import errno
import json
import os
import stat
import tempfile

import pytest

from dflash_agent.agent import transcript as transcript_module
from dflash_agent.agent.transcript import STATE_DIR, Transcript, default_transcript_path
from dflash_agent.errors import UserError


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_default_transcript_is_in_the_repo_and_git_ignored(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    transcript = Transcript(default_transcript_path(repo, read_only=False))
    transcript.event("start", command="test")
    transcript.close()
    assert transcript.path.parent == repo / STATE_DIR / "transcripts"
    assert [r["type"] for r in records(transcript.path)] == ["start"]
    assert (repo / STATE_DIR / ".gitignore").read_text() == "*\n"


@pytest.mark.parametrize("linked", [STATE_DIR, f"{STATE_DIR}/transcripts"])
def test_a_symlinked_state_dir_is_not_followed(tmp_path, linked, caplog, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    repo.mkdir()
    outside.mkdir()
    (repo / linked).parent.mkdir(parents=True, exist_ok=True)
    (repo / linked).symlink_to(outside)
    transcript = Transcript(default_transcript_path(repo, read_only=False))
    transcript.event("start", command="test")
    transcript.close()
    assert list(outside.iterdir()) == []  # nothing written through the link
    assert not transcript.path.is_relative_to(repo) and transcript.path.exists()
    assert [r["type"] for r in records(transcript.path)] == ["start"]
    assert "symlink" in caplog.text


def test_a_state_dir_that_is_a_file_is_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / STATE_DIR).write_text("not a directory\n")
    transcript = Transcript(default_transcript_path(repo, read_only=False))
    transcript.close()
    assert (repo / STATE_DIR).read_text() == "not a directory\n" and transcript.path.exists()


def test_a_path_given_by_the_user_is_used_as_given(tmp_path):
    transcript = Transcript(tmp_path / "logs" / "t.jsonl")
    transcript.close()
    assert transcript.path == tmp_path / "logs" / "t.jsonl" and transcript.path.exists()


def test_a_read_only_run_writes_in_a_directory_of_this_user_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    transcript = Transcript(default_transcript_path(tmp_path / "repo", read_only=True))
    transcript.close()
    private = tmp_path / f"dflash-agent-{os.geteuid()}"
    assert transcript.path.parent == private / "transcripts"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and stat.S_IMODE(transcript.path.stat().st_mode) == 0o600


@pytest.mark.parametrize("made", ["a link", "a file", "open to others"])
def test_a_temp_name_someone_else_made_is_not_used(tmp_path, monkeypatch, made, caplog):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    name, outside = tmp_path / f"dflash-agent-{os.geteuid()}", tmp_path / "outside"
    outside.mkdir()
    if made == "a link":
        name.symlink_to(outside)
    elif made == "a file":
        name.write_text("")
    else:
        name.mkdir(mode=0o777)
        name.chmod(0o777)
    transcript = Transcript(default_transcript_path(tmp_path / "repo", read_only=True))
    transcript.close()
    assert not transcript.path.is_relative_to(name) and transcript.path.exists()
    assert list(outside.iterdir()) == [] and "not a private directory" in caplog.text


def test_a_repo_that_cannot_be_written_sends_the_transcript_to_the_temp_dir(tmp_path, monkeypatch, caplog):
    def read_only(*args):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(transcript_module, "_open_in_state_dir", read_only)
    transcript = Transcript(default_transcript_path(tmp_path / "repo", read_only=False))
    transcript.close()
    assert transcript.path.is_relative_to(tmp_path / "tmp") and transcript.path.exists()
    assert "cannot be written (Read-only file system)" in caplog.text


def test_a_transcript_that_cannot_be_written_is_one_error_naming_it(tmp_path):
    with pytest.raises(UserError, match=f"cannot write the transcript {tmp_path}: Is a directory"):
        Transcript(tmp_path)
