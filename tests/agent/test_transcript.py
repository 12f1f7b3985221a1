"""The transcript file: where it goes, and that a repo cannot redirect it outside itself."""

import json

import pytest

from dflash_agent.agent.transcript import STATE_DIR, Transcript, default_transcript_path


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
    import tempfile

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
    import tempfile

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
