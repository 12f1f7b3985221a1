"""The bash tool: process-group timeouts, output caps, a scrubbed non-interactive environment, the
working directory that persists but stays inside, and the deny-list; each in the sandbox (bwrap) and
without it (the launcher)."""

import asyncio
import os
import time

import pytest

from dflash_agent.tools.bash import MAX_OUTPUT_BYTES, BashArgs, Shell
from dflash_agent.tools.registry import workspace_tools
from dflash_agent.tools.sandbox import Sandbox
from dflash_agent.tools.workspace import Workspace

from .processes import running, unique_sleep

_NO_BWRAP = Sandbox().problem()


@pytest.fixture(params=["bwrap", "off"])
def sandbox(request):
    if request.param == "bwrap" and _NO_BWRAP is not None:
        pytest.skip(f"the sandbox cannot start here: {_NO_BWRAP}")
    return Sandbox(mode=request.param)


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "repo"
    (root / "sub" / "deeper").mkdir(parents=True)
    return root


@pytest.fixture
def tools(root, sandbox):
    return workspace_tools(Workspace(root), sandbox=sandbox)


def bash(tools, command, **more):
    return asyncio.run(tools.dispatch("bash", {"command": command, **more}))


def test_output_and_exit_code(tools):
    result = bash(tools, "echo out; echo err >&2; exit 7")
    assert not result.is_error
    assert result.text.splitlines() == ["out", "err", "[exit code 7]"]
    assert bash(tools, "true").text == "(no output)\n[exit code 0]"


def test_timeout_kills_the_command_and_its_sleeping_child(tools):
    sleeper = unique_sleep()
    started = time.monotonic()
    result = bash(tools, f"sleep {sleeper} & echo started; wait", timeout=1)
    elapsed = time.monotonic() - started
    assert elapsed < 10
    assert "started" in result.text and "timed out after 1 s" in result.text
    assert not running(sleeper)


def test_background_processes_do_not_outlive_the_command(tools):
    sleeper = unique_sleep()
    started = time.monotonic()
    result = bash(tools, f"(sleep {sleeper}; echo never) & echo done")
    assert time.monotonic() - started < 10  # the open pipe of the sleeper does not hold the call
    assert result.text.splitlines() == ["done", "[exit code 0]"]
    assert not running(sleeper)


def test_ten_megabytes_of_output_are_cut_in_the_middle(tools):
    result = bash(tools, "head -c 10000000 /dev/zero | tr '\\0' a; echo; echo THE-END")
    assert len(result.text) < MAX_OUTPUT_BYTES + 500
    head, note, tail = result.text.split("\n", 2)
    assert head == "a" * (MAX_OUTPUT_BYTES // 2)
    assert "9,970,009 bytes of output elided" in note
    assert tail.endswith("THE-END\n[exit code 0]")


def test_output_reads_as_a_terminal_shows_it(tools):
    result = bash(tools, r"printf '\033[1;31merror\033[0m: x\n'; printf 'get  10%%\rget 100%%\n';"
                         r"printf 'a\0b\n'; grep --color=always -o ok <<< 'is ok'")
    assert result.text.splitlines() == ["error: x", "get 100%", "ab", "ok", "[exit code 0]"]


def test_secrets_are_not_in_the_environment(tools, monkeypatch):
    for name in ("OPENAI_API_KEY", "GITHUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "my_api_key",
                 "MYSQL_PWD", "GH_PAT"):
        monkeypatch.setenv(name, "hunter2")
    monkeypatch.setenv("HARMLESS_SETTING", "visible")
    # a password in a URL, whatever the name; but a proxy's, which the command's network needs
    monkeypatch.setenv("DATABASE_URL", "postgres://app:hunter2@db.internal:5432/app")
    monkeypatch.setenv("GIT_REMOTE", "https://ci:hunter2@git.example.com/repo.git")
    monkeypatch.setenv("HTTPS_PROXY", "http://me:proxy-pw@proxy:3128")
    monkeypatch.setenv("DOCS_URL", "https://example.com/a:b@c")  # ':' and '@' only after the host
    text = bash(tools, "env").text
    assert "hunter2" not in text
    assert "HARMLESS_SETTING=visible" in text and "HTTPS_PROXY=http://me:proxy-pw@proxy:3128" in text
    assert "DOCS_URL=https://example.com/a:b@c" in text
    for pair in ("PAGER=cat", "GIT_PAGER=cat", "TERM=dumb", "CI=1"):
        assert pair in text.splitlines()


def test_errors_name_the_command_s_own_line_numbers(tools, root):
    """The working directory's trap is set before the command, not in its text: errors quote the command alone with
    its own line numbers, and bash scripts the command runs do not set the trap again."""
    result = bash(tools, "echo one\nif then")
    assert "line 2: syntax error" in result.text, result.text
    first = bash(tools, "echo (")
    assert "line 1: syntax error" in first.text and "__dflash" not in first.text, first.text
    assert "[working directory is now sub]" in bash(tools, "cd sub && bash -c 'cd /'").text


def test_stdin_is_closed(tools):
    started = time.monotonic()
    result = bash(tools, "cat; read x; echo read=$?", timeout=20)
    assert time.monotonic() - started < 10
    assert "read=1" in result.text


def test_working_directory_persists_and_stays_inside(tools, root):
    assert "[working directory is now sub/deeper]" in bash(tools, "cd sub/deeper").text
    assert bash(tools, "pwd").text.splitlines()[0] == str(root.resolve() / "sub" / "deeper")
    refused = bash(tools, "cd /tmp && pwd")
    assert "/tmp" in refused.text and "stays sub/deeper" in refused.text
    assert bash(tools, "pwd").text.splitlines()[0] == str(root.resolve() / "sub" / "deeper")
    # `exit` does not lose the move; `..` back to the root is fine, past it is not.
    bash(tools, "cd ../..; exit 3")
    assert bash(tools, "pwd").text.splitlines()[0] == str(root.resolve())
    bash(tools, "cd ..")
    assert bash(tools, "pwd").text.splitlines()[0] == str(root.resolve())


def test_a_removed_working_directory_falls_back_to_the_root(tools, root):
    bash(tools, "cd sub/deeper")
    bash(tools, "rmdir ../deeper")
    result = bash(tools, "pwd")
    assert "no longer exists" in result.text and str(root.resolve()) in result.text


@pytest.mark.parametrize("command", [
    "sudo rm x", "git push origin main", "rm -rf /", "rm -rf ~", "rm -fr / --no-preserve-root", "mkfs.ext4 /dev/sda",
    "dd if=/dev/zero of=/dev/sda", "shutdown now", ":(){ :|:& };:",
])
def test_deny_list_refuses_destructive_commands(tools, command):
    result = bash(tools, command)
    assert result.is_error and "deny-list" in result.text


@pytest.mark.parametrize("command", ["rm -rf build/", "git status", "echo sudoku", "rm -f /tmp/x.txt"])
def test_deny_list_lets_ordinary_commands_run(tools, command):
    assert "deny-list" not in bash(tools, command).text


def test_deny_list_is_configurable(root, sandbox):
    tools = workspace_tools(Workspace(root), deny=[r"\bcurl\b"], sandbox=sandbox)
    assert "deny-list" in bash(tools, "curl http://example.com").text
    assert "deny-list" not in bash(tools, "echo sudo").text  # the defaults were replaced
    with pytest.raises(ValueError, match="not a valid regular expression"):
        workspace_tools(Workspace(root), deny=["("])


def test_read_only_workspace_has_no_bash_and_no_writes(root):
    tools = workspace_tools(Workspace(root, read_only=True))
    assert tools.names == ["read_file", "list_dir", "glob", "grep"]
    for name, arguments in [("bash", {"command": "touch x"}), ("write_file", {"path": "x", "content": ""}),
                            ("edit_file", {"path": "x", "old_string": "a", "new_string": "b"})]:
        result = asyncio.run(tools.dispatch(name, arguments))
        assert result.is_error and "read-only" in result.text
    assert not (root / "x").exists()


def test_cancelling_the_call_kills_the_command(root, sandbox):
    shell = Shell(Workspace(root), sandbox=sandbox)
    sleeper = unique_sleep()

    async def scenario():
        task = asyncio.create_task(shell.bash(BashArgs(f"sleep {sleeper} & touch started; wait")))
        while not (root / "started").exists():
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    started = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - started < 10
    assert not running(sleeper, grace=1.0)  # gone by the time the cancel is


def test_processes_that_leave_the_session_do_not_outlive_the_command(tools):
    # setsid: a new session and group; the subshell's `&` inside it: a daemon orphaned at once.
    sleepers = unique_sleep(), unique_sleep()
    result = bash(tools, f"setsid sleep {sleepers[0]} & "
                         f"(setsid sh -c 'sleep {sleepers[1]} &' &); sleep 0.3; echo done")
    assert result.text.splitlines()[-2:] == ["done", "[exit code 0]"], result.text
    for sleeper in sleepers:
        assert not running(sleeper), sleeper


def test_processes_that_leave_the_session_do_not_outlive_the_timeout(tools):
    sleepers = unique_sleep(), unique_sleep()
    started = time.monotonic()
    result = bash(tools, f"setsid sleep {sleepers[0]} & "
                         f"(setsid sh -c 'sleep {sleepers[1]} &' &); sleep 300", timeout=1)
    assert time.monotonic() - started < 10 and "timed out after 1 s" in result.text
    for sleeper in sleepers:
        assert not running(sleeper), sleeper


# Walks bash's ancestors through /proc, PID 1 included, and prints every environment it can read on the way.
ANCESTORS = r"""p=$$; while [ "$p" -gt 0 ]; do echo "== $p"; tr '\0' '\n' < /proc/$p/environ; p=$(sed 's/.*) . //' /proc/$p/stat | cut -d' ' -f1); done"""


def test_no_ancestor_of_the_command_holds_the_secrets(root):
    import subprocess
    import sys

    # The secret must be in the server's real (exec-time) environment, which /proc shows, so the
    # tool runs in a child process started with it.
    server = ("import asyncio, sys; from dflash_agent.tools.registry import workspace_tools; "
              "from dflash_agent.tools.workspace import Workspace; "
              "r = asyncio.run(workspace_tools(Workspace(sys.argv[1])).dispatch('bash', {'command': sys.argv[2]})); "
              "print(r.text)")
    env = {**os.environ, "DFLASH_TEST_API_KEY": "hunter2-secret"}
    out = subprocess.run([sys.executable, "-c", server, str(root), ANCESTORS], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("== ") >= 2 and "PATH=" in out.stdout, out.stdout  # bash and its parent at least
    assert "hunter2-secret" not in out.stdout


def test_the_command_gets_default_signal_handling(tools):
    # Python ignores SIGPIPE; a shell forked from it must not inherit that (`yes | head` would complain).
    result = bash(tools, "yes | head -1; grep SigIgn /proc/self/status")
    assert result.text.splitlines()[0] == "y" and "Broken pipe" not in result.text, result.text
