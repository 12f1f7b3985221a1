"""The sandbox of the tools' processes (bubblewrap): the server's secrets and processes out of sight,
nothing a command starts outlives it whatever it does to its parent, writes only in the workspace and a
private /tmp, the network by option; and where bwrap cannot start, one warning and the plain launcher."""

import asyncio
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from dflash_agent.tools.bash import BashArgs, Shell
from dflash_agent.tools.confine import RESOLVE_UNIX_ABI, SCOPES_ABI, landlock_abi
from dflash_agent.tools.registry import workspace_tools
from dflash_agent.tools.sandbox import Sandbox
from dflash_agent.tools.search import SearchTools
from dflash_agent.tools.workspace import Workspace

from .processes import running, unique_sleep

_UNAVAILABLE = Sandbox(mode="auto").problem()
needs_bwrap = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"the sandbox cannot start here: {_UNAVAILABLE}")


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    return root


def bash(tools, command, **more):
    return asyncio.run(tools.dispatch("bash", {"command": command, **more}))


# Run as the "server": a process whose environment and command line hold the key, as `serve --api-key K`
# with DFLASH_AGENT_API_KEY set; it runs one bash call and prints the result.
SERVER = ("import asyncio, sys; from dflash_agent.tools.registry import workspace_tools; "
          "from dflash_agent.tools.workspace import Workspace; "
          "r = asyncio.run(workspace_tools(Workspace(sys.argv[1])).dispatch('bash', {'command': sys.argv[2]})); "
          "print(r.text)")


@needs_bwrap
def test_the_server_s_environment_and_command_line_are_out_of_sight(root):
    key = f"sk-{uuid.uuid4().hex}"
    half = len(key) // 2
    # The key split in two, so the command's own command line does not hold it.
    find = (f'k="{key[:half]}""{key[half:]}"; grep -l -a "$k" /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null; '
            # Each process's program, read by builtins, so the listing starts no process of its own.
            "echo ===; for f in /proc/[0-9]*/cmdline; do read -r -d '' program < $f; echo \"$program\"; done")
    env = {**os.environ, "DFLASH_AGENT_API_KEY": key}
    out = subprocess.run([sys.executable, "-c", SERVER, str(root), find, "--api-key", key], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    found, processes = out.stdout.split("===", 1)
    assert key not in out.stdout and not found.strip(), out.stdout
    # It saw its own processes (bwrap's init, bash), and no other: not the server, not pytest.
    programs = [line.rsplit("/", 1)[-1] for line in processes.strip().splitlines()[:-1]]  # less "[exit code 0]"
    assert programs == ["bwrap", "bash"], processes


# A server that probes the sandbox first, as the CLI does at startup (before asyncio takes descriptors of its own),
# then runs one bash call; it writes what the probe said and the call's result to the file named third.
PROBE_FIRST = ("import asyncio, sys; from dflash_agent.tools.registry import workspace_tools; "
               "from dflash_agent.tools.sandbox import Sandbox; from dflash_agent.tools.workspace import Workspace; "
               "sandbox = Sandbox(); problem = sandbox.problem(); "
               "r = asyncio.run(workspace_tools(Workspace(sys.argv[1]), sandbox=sandbox).dispatch("
               "'bash', {'command': sys.argv[2]})); open(sys.argv[3], 'w').write(f'{problem}\\n{r.text}')")


@needs_bwrap
@pytest.mark.parametrize("closed", ["<&-", ">&- 2>/dev/null"], ids=["stdin", "stdout"])
def test_a_server_started_with_a_standard_stream_closed_still_confines(root, closed):
    """os.pipe() hands such a server descriptor 0 (or 1); given to the child by number, Popen's stdin replaced it
    there, and bwrap read its seccomp filter from /dev/null: the sandbox did not start (`chat <&-`)."""
    out_file = root.parent / "out.txt"
    command = "echo x > /etc/dflash-probe; echo done"
    proc = subprocess.run(f"{shlex.quote(sys.executable)} -c {shlex.quote(PROBE_FIRST)} {shlex.quote(str(root))} "
                          f"{shlex.quote(command)} {shlex.quote(str(out_file))} {closed}", shell=True,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    problem, said = out_file.read_text().split("\n", 1)
    assert problem == "None", problem
    assert "Read-only file system" in said and "done" in said, said


@needs_bwrap
def test_killing_the_parent_leaves_no_process_behind(root):
    tools = workspace_tools(Workspace(root))
    sleeper = unique_sleep()
    started = time.monotonic()
    result = bash(tools, f"sleep {sleeper} & kill -9 $PPID; echo still here")
    assert time.monotonic() - started < 10
    assert result.text.splitlines() == ["still here", "[exit code 0]"], result.text
    assert not running(sleeper)


@needs_bwrap
def test_stopping_the_parent_leaves_no_process_behind(root):
    tools = workspace_tools(Workspace(root))
    sleeper = unique_sleep()
    started = time.monotonic()
    result = bash(tools, f"sleep {sleeper} & kill -STOP $PPID; echo stopped it", timeout=3)
    assert time.monotonic() - started < 3
    assert result.text.splitlines() == ["stopped it", "[exit code 0]"], result.text
    assert not running(sleeper)


@needs_bwrap
def test_the_timeout_kills_everything_even_with_the_parent_stopped(root):
    tools = workspace_tools(Workspace(root))
    sleepers = unique_sleep(), unique_sleep()
    started = time.monotonic()
    result = bash(tools, f"setsid sleep {sleepers[0]} & kill -STOP $PPID; sleep {sleepers[1]}", timeout=1)
    assert time.monotonic() - started < 5
    assert "timed out after 1 s" in result.text, result.text
    assert not running(sleepers[0]) and not running(sleepers[1])


@needs_bwrap
def test_cancelling_the_call_kills_the_namespace(root):
    shell = Shell(Workspace(root))
    sleeper = unique_sleep()

    async def scenario():
        task = asyncio.create_task(shell.bash(BashArgs(f"sleep {sleeper} & kill -STOP $PPID; touch started; wait")))
        while not (root / "started").exists():
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    started = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - started < 10
    assert not running(sleeper, grace=1.0)


@needs_bwrap
def test_writes_only_inside_the_workspace_and_a_private_tmp(root):
    tools = workspace_tools(Workspace(root))
    outside = tempfile.mkdtemp(prefix="dflash-sandbox-test-", dir="/var/tmp")
    try:
        result = bash(tools, f"echo in > inside.txt && echo wrote inside; echo out > {outside}/outside.txt")
        assert "wrote inside" in result.text and "Read-only file system" in result.text, result.text
        assert (root / "inside.txt").read_text() == "in\n"
        assert not os.path.exists(f"{outside}/outside.txt")
    finally:
        shutil.rmtree(outside)
    # /tmp is writable, kept from call to call, and not the machine's.
    name = f"/tmp/dflash-sandbox-{uuid.uuid4().hex}"
    assert bash(tools, f"echo kept > {name}").text.endswith("[exit code 0]")
    assert bash(tools, f"cat {name}").text.splitlines()[0] == "kept"
    assert not os.path.exists(name)


@needs_bwrap
def test_the_kernels_settings_are_read_only_even_to_root(root):
    """Run as root (containers, CI), bwrap makes no user namespace and root's dropped capabilities do not stop a
    sysctl write: kernel.core_pattern set to a workspace program would run it as root at the next crash."""
    tools = workspace_tools(Workspace(root))
    probe = ("import os\nfor p in ('/proc/sys/kernel/core_pattern', '/proc/sys/vm/drop_caches', "
             "'/proc/sys/kernel/hostname'):\n    try:\n        os.close(os.open(p, os.O_WRONLY))\n"
             "        print(p, 'writable')\n    except OSError as e:\n        print(p, e.errno)\n")
    (root / "probe.py").write_text(probe)
    result = bash(tools, f"{sys.executable} probe.py")
    lines = [line for line in result.text.splitlines() if line.startswith("/proc/")]
    assert len(lines) == 3 and not any(line.endswith("writable") for line in lines), result.text
    if os.geteuid() == 0:  # refused by the read-only mount, not by permissions root would pass
        assert all(line.endswith(" 30") for line in lines), result.text


@needs_bwrap
def test_the_repository_s_git_metadata_stays_read_only(root):
    """What git runs on the host (a `core.fsmonitor` command, hooks) cannot be planted from the sandbox or by the
    file tools, nor .git swapped for another; the working tree stays writable."""
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    tools = workspace_tools(Workspace(root))
    config = (root / ".git" / "config").read_text()
    result = bash(tools, "git config core.fsmonitor 'touch /tmp/escaped'; echo x > .git/hooks/pre-commit; "
                         "mv .git .git-old; echo edit > tracked.txt; cat tracked.txt")
    assert result.text.count("Read-only file system") + result.text.count("Device or resource busy") >= 2, result.text
    assert "edit" in result.text and (root / "tracked.txt").read_text() == "edit\n"
    assert (root / ".git" / "config").read_text() == config and not (root / ".git" / "hooks" / "pre-commit").exists()
    written = asyncio.run(tools.dispatch("write_file", {"path": ".git/hooks/post-checkout", "content": "x"}))
    assert written.is_error and "repository's .git" in written.text
    assert not (root / ".git" / "hooks" / "post-checkout").exists()


def _git_status_runs_nothing(where) -> None:
    """The user's next `git status` there (a git-aware prompt runs it on `cd`) runs no command the agent planted."""
    subprocess.run(["git", "status"], cwd=where, capture_output=True, timeout=60)


@needs_bwrap
def test_git_metadata_at_any_depth_or_made_during_a_call_runs_nothing_on_the_host(root):
    """A nested repository's .git is read-only too, and a .git a command makes (`git init` where there was none, a
    gitdir file) is renamed out of git's sight after the call, with a note; the file tools refuse any .git."""
    nested = root / "vendor" / "lib"
    nested.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(nested)], check=True)
    tools = workspace_tools(Workspace(root))
    marker = root / "MARK"
    plant = f"git config core.fsmonitor 'touch {marker}'"
    result = bash(tools, f"cd vendor/lib && {plant}; echo x > .git/hooks/post-checkout")
    assert "Read-only file system" in result.text and "fsmonitor" not in (nested / ".git" / "config").read_text()
    result = bash(tools, f"cd {root} && git init -q . && {plant} && mkdir -p a b && git -C a init -q && cd a && {plant} && cd .. "
                         f"&& cp -r a/.git b/planted && printf 'gitdir: planted\\n' > b/.git && echo planted")
    assert "planted" in result.text and "[exit code 0]" in result.text, result.text
    for made in (".git", "a/.git", "b/.git"):
        assert not (root / made).exists() and (root / f"{made}-disabled-by-dflash-agent").exists()
        assert f"the command made {made}: git would run its config and hooks outside the sandbox" in result.text
    for where in (root, root / "a", root / "b", nested):
        _git_status_runs_nothing(where)
    assert not marker.exists()
    written = asyncio.run(tools.dispatch("write_file", {"path": "vendor/lib/.git/config", "content": "x"}))
    assert written.is_error and "a repository's .git" in written.text
    made = asyncio.run(tools.dispatch("write_file", {"path": "c/.git/config", "content": "x"}))
    assert made.is_error and not (root / "c" / ".git").exists()


@needs_bwrap
@pytest.mark.parametrize("swap", ["symlink to a host file", "fifo", "symlink to /dev/zero"])
def test_the_working_directory_file_cannot_make_the_server_read_for_the_command(root, swap, tmp_path):
    """The command can replace the file its EXIT trap writes the working directory to (it lies in the sandbox's
    /tmp): the server reads only a regular file, never through a link, and never blocks on it."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    make = {"symlink to a host file": f"ln -s {secret} \"$__dflash_cwd\"", "fifo": 'mkfifo "$__dflash_cwd"',
            "symlink to /dev/zero": 'ln -s /dev/zero "$__dflash_cwd"'}[swap]
    tools = workspace_tools(Workspace(root))

    async def call():
        return await asyncio.wait_for(tools.dispatch("bash", {"command": f'trap - EXIT; rm -f "$__dflash_cwd"; {make}'}),
                                      30)

    result = asyncio.run(call())
    assert "TOPSECRET" not in result.text and result.text.endswith("[exit code 0]"), result.text
    assert bash(tools, "pwd").text.splitlines()[0] == str(root)  # the shell stays where it was


@needs_bwrap
def test_session_sockets_are_hidden_and_not_passed(root, monkeypatch):
    """Where the session's, the system bus's and Docker's sockets live is emptied (a folder) or blanked (a socket's
    path), and the variables naming the session's are not passed; GIT_AUTHOR_NAME (AUTH inside a word) is."""
    from dflash_agent.tools import sandbox

    host = tempfile.mkdtemp(prefix="dflash-sandbox-test-", dir="/var/tmp")  # not under the private /tmp
    try:
        os.makedirs(f"{host}/user/0")
        for path in (f"{host}/user/0/bus", f"{host}/docker.sock"):
            with open(path, "w") as f:
                f.write("a socket")
        monkeypatch.setattr(sandbox, "_HOST_SOCKETS", (f"{host}/user", f"{host}/docker.sock"))
        monkeypatch.setenv("SSH_AUTH_SOCK", f"{host}/user/0/ssh-agent.sock")
        monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", f"unix:path={host}/user/0/bus")
        monkeypatch.setenv("GIT_AUTHOR_NAME", "Ada")
        tools = workspace_tools(Workspace(root))
        out = bash(tools, f"env | sort; find {host}/user -mindepth 1 | wc -l; "
                          f"cat {host}/docker.sock 2>/dev/null | wc -c").text
    finally:
        shutil.rmtree(host)
    assert "SSH_AUTH_SOCK" not in out and "DBUS_SESSION_BUS_ADDRESS" not in out and "GIT_AUTHOR_NAME=Ada" in out
    assert out.splitlines()[-3:-1] == ["0", "0"], out  # the folder empty; the socket's path /dev/null (nodev)


_CONNECT = """import socket, sys
own = sys.argv[1] == "own"
if own:
    server = socket.socket(socket.AF_UNIX)
    server.bind("\\0" + sys.argv[2])
    server.listen()
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(("\\0" + sys.argv[2]) if sys.argv[1] != "path" else sys.argv[2])
    print("connected")
except OSError as e:
    print("refused", e.errno)
"""


def _connect(root, how: str, name: str):
    (root / "connect.py").write_text(_CONNECT)
    return bash(workspace_tools(Workspace(root), sandbox=Sandbox(network=True)),
                f"{sys.executable} connect.py {how} {name}", timeout=30).text


@needs_bwrap
@pytest.mark.skipif(landlock_abi() < SCOPES_ABI, reason="Landlock's scopes need Linux 6.12 (ABI 6)")
def test_abstract_unix_sockets_from_outside_are_refused_with_the_network_on(root):
    """With the network on the sandbox shares the host's abstract sockets (an X11 display's): Landlock refuses
    those made outside, and a socket the command makes itself still works."""
    name = f"dflash-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind("\0" + name)
        server.listen()
        outside = _connect(root, "abstract", name)
    assert outside.startswith("refused"), outside
    assert _connect(root, "own", name).startswith("connected")


@needs_bwrap
@pytest.mark.skipif(landlock_abi() < RESOLVE_UNIX_ABI, reason="Landlock's LANDLOCK_ACCESS_FS_RESOLVE_UNIX (ABI 9)")
def test_unix_sockets_at_a_path_from_outside_are_refused(root):
    host = tempfile.mkdtemp(prefix="dflash-sandbox-test-", dir="/var/tmp")  # not under the private /tmp
    try:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(f"{host}/agent.sock")
            server.listen()
            result = _connect(root, "path", f"{host}/agent.sock")
    finally:
        shutil.rmtree(host)
    assert result.startswith("refused"), result


@pytest.mark.skipif(landlock_abi() < 5, reason="the stand-in right, LANDLOCK_ACCESS_FS_IOCTL_DEV, is ABI 5")
def test_a_ruleset_that_handles_a_filesystem_right_still_moves_files_across_directories(tmp_path):
    """Handling RESOLVE_UNIX (ABI 9, not on this kernel) makes Landlock refuse cross-directory renames and links
    unless a rule grants them back (pip, cargo and git make them): checked with another filesystem right handled
    in its place."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "f").write_text("x")
    (tmp_path / "a" / "g").write_text("y")
    script = ("import os, sys; from dflash_agent.tools.confine import restrict, SCOPE_ABSTRACT_UNIX_SOCKET; "
              "assert restrict(1 << 15, SCOPE_ABSTRACT_UNIX_SOCKET); os.chdir(sys.argv[1]); "
              "os.rename('a/f', 'b/f'); os.link('a/g', 'b/g'); print('moved and linked')")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.stdout == "moved and linked\n", out.stderr


@needs_bwrap
def test_the_tools_a_command_needs_under_tmp_stay_visible_and_the_rest_of_tmp_hidden(root, monkeypatch):
    """A venv (or any PATH folder) made under /tmp, as a CI checkout there makes one, is bound read-only into the
    sandbox's private /tmp; the machine's other /tmp files stay out of sight."""
    tools_dir = tempfile.mkdtemp(prefix="dflash-sandbox-tools-", dir="/tmp")
    secret = tempfile.mkdtemp(prefix="dflash-sandbox-other-", dir="/tmp")
    try:
        tool = os.path.join(tools_dir, "say-hello")
        with open(tool, "w") as f:
            f.write("#!/bin/sh\necho hello from under tmp\n")
        os.chmod(tool, 0o755)
        with open(os.path.join(secret, "note"), "w") as f:
            f.write("not for the command\n")
        monkeypatch.setenv("PATH", f"{tools_dir}{os.pathsep}{os.environ['PATH']}")
        tools = workspace_tools(Workspace(root))
        result = bash(tools, f"say-hello; touch {tools_dir}/x; cat {secret}/note")
        assert "hello from under tmp" in result.text, result.text
        assert "Read-only file system" in result.text and not os.path.exists(os.path.join(tools_dir, "x"))
        assert "not for the command" not in result.text and "No such file" in result.text
    finally:
        shutil.rmtree(tools_dir)
        shutil.rmtree(secret)


@needs_bwrap
@pytest.mark.parametrize("network", [True, False])
def test_network_per_option(root, network):
    tools = workspace_tools(Workspace(root), sandbox=Sandbox(network=network))
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        result = bash(tools, f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected", timeout=10)
    assert ("connected" in result.text) is network, result.text


@needs_bwrap
def test_exit_codes_and_output_in_the_sandbox(root):
    tools = workspace_tools(Workspace(root))
    result = bash(tools, "echo out; echo err >&2; exit 7")
    assert result.text.splitlines() == ["out", "err", "[exit code 7]"]
    assert "[exit code 137]" in bash(tools, "kill -9 $$").text  # bwrap reports a signal as 128 + N


@needs_bwrap
def test_the_search_helper_runs_in_the_sandbox_without_writes_or_network(root):
    search = SearchTools(Workspace(root), Sandbox())
    probe = ("echo /proc/[0-9]*; touch /tmp/dflash-search-probe || echo no writes; "
             "(exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && echo connected || echo no network")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code, out, err = asyncio.run(search._run([shutil.which("bash"), "-c", probe.replace("$PORT", str(port))]))
    assert out.decode().splitlines() == ["/proc/1 /proc/2", "no writes", "no network"], (out, err)
    assert not os.path.exists("/tmp/dflash-search-probe")


@needs_bwrap
def test_mcp_no_sandbox_network_reaches_its_bash(root):
    import anyio
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client

    # --server names a port nothing listens on: the tools need no model.
    params = StdioServerParameters(command=sys.executable, args=[
        "-m", "dflash_agent", "mcp", "--repo", str(root), "--expose-tools", "--server", "http://127.0.0.1:9",
        "--no-sandbox-network"])

    async def scenario(command):
        with anyio.fail_after(60):
            async with Client(stdio_client(params, errlog=(root / "stderr.txt").open("w"))) as client:
                return await client.call_tool("bash", {"command": command, "timeout": 10})

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        result = anyio.run(scenario, f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo connected || echo cut")
    assert result.content[0].text.splitlines() == ["cut", "[exit code 0]"], result.content


# --- where the sandbox cannot start ---------------------------------------------------------------


def test_without_bwrap_one_warning_and_the_launcher(root, caplog):
    sandbox = Sandbox(bwrap=str(root / "no-such-bwrap"))
    tools = workspace_tools(Workspace(root), sandbox=sandbox)
    with caplog.at_level(logging.WARNING):
        first = bash(tools, "echo one; exit 3")
        second = bash(tools, "echo two")
    assert first.text.splitlines() == ["one", "[exit code 3]"]
    assert second.text.splitlines() == ["two", "[exit code 0]"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "sandbox off" in warnings[0].getMessage() and "cannot run" in warnings[0].getMessage()
    assert not sandbox.enabled()


def test_a_bwrap_that_cannot_start_is_named_in_the_warning(root, caplog):
    fake = root / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    with caplog.at_level(logging.WARNING):
        assert not Sandbox(bwrap=str(fake)).enabled()
    assert "No permissions to create new namespace" in caplog.text


def test_required_sandbox_that_cannot_start_refuses_the_command(root):
    tools = workspace_tools(Workspace(root), sandbox=Sandbox(mode="bwrap", bwrap=str(root / "no-such-bwrap")))
    result = bash(tools, "touch ran")
    assert result.is_error and "--sandbox bwrap: the sandbox cannot start" in result.text, result.text
    assert not (root / "ran").exists()


def test_sandbox_off_neither_probes_nor_warns(root, caplog):
    with caplog.at_level(logging.WARNING):
        tools = workspace_tools(Workspace(root), sandbox=Sandbox(mode="off", bwrap=str(root / "no-such-bwrap")))
        assert bash(tools, "echo plain").text.splitlines() == ["plain", "[exit code 0]"]
    assert not caplog.records


def test_an_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="expected one of auto, bwrap, off"):
        Sandbox(mode="docker")


# --- the commands' switch ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", [
    ["run", "hello", "--server", "http://127.0.0.1:9"],
    ["mcp", "--server", "http://127.0.0.1:9"],
    ["serve", "--port", "0"],
])
def test_a_required_sandbox_that_cannot_start_stops_the_command_at_once(command, root, monkeypatch):
    from click.testing import CliRunner

    import dflash_agent.cli as cli

    monkeypatch.setenv("PATH", str(root))  # no bwrap on it
    where = ["--mcp-repo" if command[0] == "serve" else "--repo", str(root)]
    result = CliRunner().invoke(cli.main, [*command, *where, "--sandbox", "bwrap"])
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == ["error: --sandbox bwrap: the sandbox cannot start: bwrap is not installed "
                                          "(Debian/Ubuntu: apt install bubblewrap)"], result.stderr
