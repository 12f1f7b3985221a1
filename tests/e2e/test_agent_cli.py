"""`dflash-agent run` and `dflash-agent chat` as a user runs them: a subprocess, its output, exit code
and transcript. The model is a scripted OpenAI-compatible server (`--server`), or the embedded model."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.agent.fake_openai import Failure, Reply, fake_server
from tests.agent.repos import PYTEST, failing_repo, git, repo_tests_pass
from tests.helpers.cli import assert_one_line_error, cli


@pytest.fixture
def repo(tmp_path):
    return failing_repo(tmp_path)


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def args(call):
    return json.dumps(call)


def test_run_fixes_a_failing_test_through_a_server(repo):
    script = [
        Reply("Reading the code.", [("read_file", args({"path": "calc.py"}))]),
        Reply(calls=[("edit_file", args({"path": "calc.py", "old_string": "a - b", "new_string": "a + b"}))]),
        Reply(calls=[("bash", args({"command": PYTEST}))]),
        Reply("Fixed add()."),
    ]
    with fake_server(script) as fake:
        proc = cli("run", "Make the tests pass.", "--repo", str(repo), "--server", fake.url)
    assert proc.returncode == 0, proc.stderr
    assert repo_tests_pass(repo)
    assert "▶ read_file calc.py" in proc.stdout and "▶ edit_file calc.py" in proc.stdout
    assert "1 passed" in proc.stdout and "Fixed add()." in proc.stdout and "answered after 4 steps" in proc.stdout
    # The model saw its tool results: the last request holds the test run's output.
    assert "1 passed" in fake.requests[-1]["messages"][-1]["content"]
    # Default transcript under the repo, invisible to git.
    (path,) = (repo / ".dflash-agent" / "transcripts").glob("run-*.jsonl")
    log = records(path)
    assert log[0]["type"] == "start" and log[0]["server"] == fake.url and log[0]["tools"][0] == "bash"
    assert log[-1]["type"] == "end" and log[-1]["outcome"] == "answered" and log[-1]["steps"] == 4
    assert git(repo, "status", "--porcelain").strip() == "M calc.py"


def test_run_exit_code_when_the_steps_run_out(repo, tmp_path):
    transcript = tmp_path / "t.jsonl"
    with fake_server([Reply(calls=[("list_dir", "{}")])]) as fake:
        proc = cli("run", "Look.", "--repo", str(repo), "--server", fake.url, "--max-steps", "1",
                   "--transcript", str(transcript), env={"DFLASH_AGENT_API_KEY": "sekrit"})
    assert proc.returncode == 3, proc.stderr
    assert fake.authorization == ["Bearer sekrit"]
    assert records(transcript)[-1]["outcome"] == "max_steps"


def test_chat_session_continues_one_conversation(repo):
    script = [Reply("There is calc.py.", usage=(100, 5, 0)), Reply("It adds two numbers.", usage=(130, 6, 100))]
    with fake_server(script) as fake:
        proc = subprocess.run(
            [sys.executable, "-m", "dflash_agent", "chat", "--repo", str(repo), "--server", fake.url],
            input="What files are here?\n\nWhat does it do?\n/exit\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "There is calc.py." in proc.stdout and "It adds two numbers." in proc.stdout
    first, second = (r["messages"] for r in fake.requests)
    assert second[:len(first)] == first[:len(first)]  # the second task extends the first conversation
    assert [m["role"] for m in second[len(first):]] == ["assistant", "user"]


def test_ctrl_c_interrupts_a_running_command(repo):
    with fake_server([Reply(calls=[("bash", args({"command": "sleep 120"}))])]) as fake:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_agent", "run", "Wait.", "--repo", str(repo), "--server", fake.url,
             "--transcript", str(repo.parent / "t.jsonl")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for line in proc.stdout:
                if "$ sleep 120" in line:
                    break
            time.sleep(0.5)
            started = time.monotonic()
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 130, err
    assert time.monotonic() - started < 30
    assert "interrupted after 1 step" in out and "Traceback" not in err
    log = records(repo.parent / "t.jsonl")
    assert log[-1]["outcome"] == "interrupted"
    assert log[-2]["role"] == "tool" and "interrupted" in log[-2]["content"]


def test_sigterm_ends_a_run_as_ctrl_c_does(repo, tmp_path):
    """`kill`, `timeout` or an editor's stop button: the command and the sandbox's /tmp go, the transcript ends."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    with fake_server([Reply(calls=[("bash", args({"command": "sleep 120"}))])]) as fake:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_agent", "run", "Wait.", "--repo", str(repo), "--server", fake.url,
             "--transcript", str(tmp_path / "t.jsonl")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(temp)})
        try:
            for line in proc.stdout:
                if "$ sleep 120" in line:
                    break
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 143, err
    assert "interrupted after 1 step" in out and "Traceback" not in err
    assert records(tmp_path / "t.jsonl")[-1]["outcome"] == "interrupted"
    assert list(temp.iterdir()) == []  # the sandbox's private /tmp and the cwd files are gone


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_at_the_chat_prompt_ends_the_session(repo, sig):
    with fake_server([Reply("Hi.")]) as fake:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_agent", "chat", "--repo", str(repo), "--server", fake.url],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            proc.stdin.write("Hello\n")
            proc.stdin.flush()
            for line in proc.stdout:
                if "answered after 1 step" in line:
                    break
            time.sleep(0.5)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 128 + sig and "Traceback" not in err, err


def test_a_task_that_is_not_utf8_reaches_the_model_as_replacement_characters(repo, tmp_path):
    with fake_server([Reply("Done.")]) as fake:
        proc = subprocess.run([sys.executable, "-m", "dflash_agent", "run", b"fix the \xff\xfe bug", "--repo",
                               str(repo), "--server", fake.url, "--transcript", str(tmp_path / "t.jsonl")],
                              capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert fake.requests[0]["messages"][-1]["content"] == "fix the \ufffd\ufffd bug"


@pytest.mark.parametrize("extra, fragment", [
    (["--temperature", "nan"], "'nan' is not a finite number"),
    (["--temperature", "inf"], "'inf' is not a finite number"),
    (["--max-steps", "0"], "0 is not in the range x>=1"),
])
def test_bad_numbers_are_usage_errors(repo, extra, fragment):
    proc = cli("run", "x", "--repo", str(repo), "--server", "http://127.0.0.1:9/v1", *extra)
    assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr


def test_an_empty_task_is_refused(repo):
    proc = cli("run", "  ", "--repo", str(repo), "--server", "http://127.0.0.1:9/v1")
    assert proc.returncode == 2 and "TASK is empty" in proc.stderr


def chat(repo, fake_url, typed):
    return subprocess.run([sys.executable, "-m", "dflash_agent", "chat", "--repo", str(repo), "--server", fake_url],
                          input=typed, capture_output=True, text=True, timeout=120)


def test_chat_drops_a_task_that_does_not_fit_and_goes_on(repo):
    too_long = Failure(400, {"message": "This model's maximum context length is 1024 tokens",
                             "type": "invalid_request_error", "code": "context_length_exceeded"})
    with fake_server([too_long, Reply("Hello.")]) as fake:
        proc = chat(repo, fake.url, "A very long paste\nSay hello.\n")
    assert proc.returncode == 0, proc.stderr
    assert "this message does not fit in the model's context: it was dropped" in proc.stdout
    assert "/clear" not in proc.stdout.split("it was dropped")[1].split("\n")[0] and "Hello." in proc.stdout
    second = fake.requests[1]["messages"]
    assert [m["role"] for m in second] == ["system", "user"] and second[-1]["content"] == "Say hello."


def test_chat_commands(repo):
    with fake_server([Reply("First."), Reply("Second.")]) as fake:
        proc = chat(repo, fake.url, "/help\nOne.\n/clear\n/nonsense\nTwo.\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert "/clear starts a new conversation" in proc.stdout and "no command /nonsense" in proc.stdout
    assert [m["content"] for m in fake.requests[1]["messages"][1:]] == ["Two."]  # One. is forgotten


def test_chat_with_stdin_closed_ends_at_once(repo):
    with fake_server([]) as fake:
        proc = subprocess.run(f"{sys.executable} -m dflash_agent chat --repo {repo} --server {fake.url} <&-",
                              shell=True, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert fake.requests == []


@pytest.mark.parametrize("extra, fragment", [
    (["--repo", "/nonexistent/repo"], "is not a directory"),
    (["--server", "http://127.0.0.1:9/v1"], "cannot reach the server at http://127.0.0.1:9/v1"),
])
def test_bad_input_is_one_line(repo, extra, fragment):
    # --sandbox off: without bubblewrap the default mode warns on a line of its own, which is not this test's concern
    proc = cli("run", "x", "--repo", str(repo), "--sandbox", "off", *extra)
    assert_one_line_error(proc, fragment)


def test_engine_options_with_a_server_are_refused(repo):
    proc = cli("run", "x", "--repo", str(repo), "--server", "http://127.0.0.1:9/v1", "--draft", "d")
    assert proc.returncode == 2 and "--draft: only for a model loaded here" in proc.stderr
    assert not (repo / ".dflash-agent").exists()  # refused before anything was written


def test_run_with_the_embedded_model(repo, tmp_path):
    """The in-process engine behind the command: one forced call, read-only, transcript in TMPDIR."""
    proc = cli("run", "List the files.", "--repo", str(repo), "--read-only", "--tool-choice", "required",
               "--max-steps", "1", "--max-turn-tokens", "128", "--device", "cpu", env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 3, proc.stderr
    (path,) = (tmp_path / f"dflash-agent-{os.geteuid()}" / "transcripts").glob("run-*.jsonl")
    log = records(path)
    assert log[0]["model"] == "gemma-3-270m-q4_k_m.gguf"
    assert log[0]["tools"] == ["read_file", "list_dir", "glob", "grep"]
    calls = [r for r in log if r["type"] == "message" and r["role"] == "assistant"][0]["tool_calls"]
    assert len(calls) >= 1 and calls[0]["name"] in log[0]["tools"]
    assert log[-1]["outcome"] == "max_steps"
    assert not (repo / ".dflash-agent").exists()
    assert f"▶ {calls[0]['name']}" in proc.stdout


def test_run_with_a_server_never_imports_torch(repo, tmp_path):
    """A remote-only client (a laptop driving a GPU box) needs neither torch nor a model in its process."""
    script = tmp_path / "remote_run.py"
    script.write_text(
        "import sys\n"
        "from dflash_agent.cli import main\n"
        "from tests.agent.fake_openai import Failure, Reply, fake_server\n"
        "with fake_server([Reply('All done.')]) as fake:\n"
        "    try:\n"
        f"        main(['run', 'Say done.', '--repo', {str(repo)!r}, '--server', fake.url])\n"
        "    except SystemExit as stop:\n"
        "        code = stop.code\n"
        "print('exit', code, 'torch' in sys.modules, 'dflash_agent.engine.engine' in sys.modules)\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.stdout.strip().splitlines()[-1] == "exit 0 False False", proc.stdout + proc.stderr
