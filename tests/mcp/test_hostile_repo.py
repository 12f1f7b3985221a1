"""The acceptance test for untrusted repositories (issue 32): a workspace built to attack the tools, served by
`dflash-agent mcp --expose-tools` as an editor spawns it (the console script, started in the repo), every tool called
on it through the official `mcp` client over stdio.

Nothing outside the workspace may be read or written, no code of the repo may run, the server's secrets stay its
own, no call may hang, and a pathological search must not stall the other calls. The scenario runs once (one
server) and records every call; each test below reads one property off the record."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from dflash_agent.tools.sandbox import Sandbox
from tests.agent.fake_openai import Reply, fake_server

CALL_TIMEOUT_S = 15  # a call that takes longer has hung (a FIFO opened, a loop followed)
SLOW_CALL_TIMEOUT_S = 20  # the pathological glob and grep
RESPONSIVE_S = 1.0  # what list_dir may take while they run
LONG = "n" * 255  # the longest name Linux allows
NEWLINE = "line\nbreak.txt"
MANY_A = "a" * 255  # `*a*a*a*a*a*b` backtracks for minutes over it
DEEP = ["d" * 200] * 30  # a path of 6,000 bytes: longer than PATH_MAX


@dataclass
class Hostile:
    base: Path  # everything here but the workspace is "outside"
    ws: Path
    outside: Path  # a directory the workspace's links point into
    secret: Path  # a file outside, holding SECRET-<token>
    markers: Path  # where the repo's code writes a file if it ever runs
    state: Path  # the target of the workspace's `.dflash-agent` link
    token: str  # in every secret: outside content, API keys, the server's command line
    tmp_probe: Path  # a file in the real /tmp a write through `root -> /` would create (its name is no secret)
    far: Path  # outside, and not under /tmp (which the bash sandbox replaces): it sees this one, read-only

    @property
    def secret_text(self) -> str:
        return f"SECRET-{self.token}"


@dataclass
class Call:
    tool: str
    arguments: dict[str, Any]
    text: str = ""
    is_error: bool = False
    seconds: float = 0.0
    hung: bool = False

    def __str__(self) -> str:
        return f"{self.tool}({self.arguments!r:.150}) -> {'HUNG' if self.hung else repr(self.text[:300])}"


@dataclass
class Record:
    hostile: Hostile
    calls: list[Call] = field(default_factory=list)
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    kernel_before: dict[str, str] = field(default_factory=dict)
    kernel_after: dict[str, str] = field(default_factory=dict)
    tmp_probe_exists: bool = False
    bash_tmp_probe_exists: bool = False
    list_dir_seconds: list[float] = field(default_factory=list)
    slow: list[Call] = field(default_factory=list)
    alive_after: Call | None = None
    bash: dict[str, Call] = field(default_factory=dict)
    run_task: Call | None = None
    stderr: str = ""

    def __repr__(self) -> str:  # what pytest shows of the fixture beside a failure
        return f"Record({len(self.calls)} calls in {self.hostile.ws})"

    def file_calls(self) -> list[Call]:
        return [call for call in self.calls if call.tool != "bash"]


def build(base: Path, far: Path) -> Hostile:
    token = secrets.token_hex(8)
    outside, markers, ws = base / "outside", base / "markers", base / "ws"
    for path in (outside, markers, ws, outside / "state"):
        path.mkdir()
    secret = outside / "secret.txt"
    secret.write_text(f"SECRET-{token}\n")
    (outside / "bash-target.txt").write_text("bash may not change this\n")
    (outside / f"outside-only-{token}.txt").write_text("a file only outside\n")
    hostile = Hostile(base, ws, outside, secret, markers, outside / "state", token,
                      Path("/tmp") / f"dflash-hostile-{secrets.token_hex(8)}", far)
    (far / "target.txt").write_text(f"SECRET-{token}\n")

    def marker_code(name: str) -> str:
        return f"open({str(markers / name)!r}, 'w').close()\n"

    (ws / "README.md").write_text("# a repository that attacks its tools\n")
    (ws / "src").mkdir()
    (ws / "src" / "app.py").write_text("x = 1\n")
    # A package named as ours: a helper run in the workspace with it on sys.path imports it.
    (ws / "dflash_agent" / "tools").mkdir(parents=True)
    (ws / "dflash_agent" / "__init__.py").write_text(marker_code("dflash_agent-init"))
    (ws / "dflash_agent" / "__main__.py").write_text(marker_code("dflash_agent-main"))
    (ws / "dflash_agent" / "tools" / "__init__.py").write_text("")
    (ws / "dflash_agent" / "tools" / "search.py").write_text(marker_code("dflash_agent-search"))
    # What Python runs by itself from a directory on its path or a site directory.
    for name in ("sitecustomize", "usercustomize"):
        (ws / f"{name}.py").write_text(marker_code(name))
    pth = f"import os; os.system('touch {markers / 'pth'}')\n"
    (ws / "x.pth").write_text(pth)
    site = ws / ".venv" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site.mkdir(parents=True)
    (site / "x.pth").write_text(pth)
    # Programs a tool might run by name, were the workspace on PATH.
    for name in ("rg", "python3", "git", "grep"):
        program = ws / name
        program.write_text(f"#!/bin/sh\ntouch {markers / ('program-' + name)}\n")
        program.chmod(0o755)
    # Ways out: to /, to a secret file and a directory outside (absolute and relative), and the agent's state dir.
    (ws / "root").symlink_to("/")
    (ws / "secret").symlink_to(secret)
    (ws / "rel-secret").symlink_to(Path("..") / "outside" / "secret.txt")
    (ws / "outside-dir").symlink_to(outside)
    (ws / "far").symlink_to(far)
    (ws / ".dflash-agent").symlink_to(hostile.state)
    # What hangs or loops a naive walker.
    os.mkfifo(ws / "fifo")
    (ws / "l1").symlink_to("l2")
    (ws / "l2").symlink_to("l1")
    (ws / "self").symlink_to(".")
    # Pathological names and contents.
    (ws / LONG).write_text("a long name\n")
    (ws / NEWLINE).write_text("a name with a newline\n")
    (ws / MANY_A).write_text("many a\n")
    (ws / "aaaa.txt").write_text("a" * 100_000 + "\n")
    # A nested repository (the workspace itself has none): its .git is what a planted config would run from
    subprocess.run(["git", "init", "-q", str(ws / "sub")], check=True)
    fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in DEEP:
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        with os.fdopen(os.open("bottom.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as bottom:
            bottom.write("deep down\n")
    finally:
        os.close(fd)
    return hostile


KERNEL_SETTINGS = ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/hostname")


def kernel_settings() -> dict[str, str]:
    return {path: Path(path).read_text() for path in KERNEL_SETTINGS}


def snapshot(base: Path, skip: Path) -> dict[str, Any]:
    """Every entry under `base` but `skip`: its kind, and a regular file's size and digest, a link's target."""
    out: dict[str, Any] = {}
    for root, dirs, files in os.walk(base):
        if Path(root) == skip.parent:
            dirs[:] = [d for d in dirs if Path(root, d) != skip]
        for name in [*dirs, *files]:
            path = Path(root, name)
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                out[str(path)] = ("link", os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                out[str(path)] = ("file", info.st_size, hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                out[str(path)] = ("dir" if stat.S_ISDIR(info.st_mode) else "other", stat.S_IMODE(info.st_mode))
    return out


def unblock(fifo: Path) -> None:
    """Release a call blocked opening the FIFO: O_RDWR opens at once and counts as both ends."""
    try:
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
    except OSError:  # no longer there (a write replaced it): nothing blocks on it
        pass


def file_tool_calls(h: Hostile) -> list[tuple[str, dict[str, Any]]]:
    """Every file and search tool on every way out, hang and odd name; none may read or write outside."""
    via_root = "root" + str(h.secret)
    ways_to_secret = ["secret", "rel-secret", "outside-dir/secret.txt", via_root, str(h.secret),
                      "../outside/secret.txt", "self/secret", "far/target.txt"]
    new_outside = ["outside-dir/new.txt", "root" + str(h.outside / "new-via-root.txt"), str(h.outside / "abs.txt"),
                   "root" + str(h.tmp_probe), ".dflash-agent/new.txt", "self/outside-dir/new2.txt"]
    calls: list[tuple[str, dict[str, Any]]] = []
    server_secrets = ["root/proc/self/environ", "root/proc/self/cmdline"]
    for path in [*ways_to_secret, *server_secrets, "fifo", "l1", "self/self/README.md", LONG, NEWLINE,
                 "/".join([*DEEP, "bottom.txt"])]:
        calls.append(("read_file", {"path": path}))
    for path in ["root", "outside-dir", "far", ".dflash-agent", "root" + str(h.outside), "self", "l1", "fifo", "secret",
                 ".", "/".join(DEEP)]:
        calls.append(("list_dir", {"path": path}))
    for pattern, path in [("**/*", "."), ("*", "."), ("root/*", "."), ("outside-dir/*", "."), ("**/secret*", "."),
                          ("**/*", "outside-dir"), ("**/*", "root" + str(h.outside)), ("self/**/*.txt", "."),
                          ("**/bottom.txt", "."), ("**/" * 12 + "bottom.txt", "."), ("*a*a*a*a*a*a*a*a*a*b", ".")]:
        calls.append(("glob", {"pattern": pattern, "path": path}))
    for args in [{"pattern": "x"}, {"pattern": "SECRET-"}, {"pattern": "SECRET-", "path": "secret"},
                 {"pattern": "SECRET-", "path": "outside-dir"}, {"pattern": "SECRET-", "path": "root" + str(h.outside)},
                 {"pattern": "secret", "ignore_case": True, "glob": "*"}, {"pattern": "deep down"},
                 {"pattern": "a", "path": "fifo"}, {"pattern": "a", "path": "l1"},
                 {"pattern": "a", "glob": "*a*a*a*a*a*a*a*b"}]:
        calls.append(("grep", args))
    for path in [*ways_to_secret, *new_outside, "fifo", "l1"]:
        calls.append(("edit_file", {"path": path, "old_string": "SECRET", "new_string": "PWNED"}))
    for path in [*ways_to_secret, *new_outside, "fifo", "l1"]:
        calls.append(("write_file", {"path": path, "content": "pwned\n"}))
    # Git metadata that git would run on the host at the user's next `git status` (the file tools refuse any .git)
    fsmonitor = f"[core]\n\tfsmonitor = touch {h.markers / 'git-file-tools'}\n"
    calls += [("write_file", {"path": "sub/.git/config", "content": fsmonitor}),
              ("edit_file", {"path": "sub/.git/config", "old_string": "[core]", "new_string": fsmonitor}),
              ("write_file", {"path": ".git/config", "content": fsmonitor}),
              ("write_file", {"path": "sub/.git/hooks/pre-commit", "content": f"#!/bin/sh\n{fsmonitor}"})]
    # Legitimate writes inside, with odd names: they may succeed, and must not run the code they touch.
    calls += [("write_file", {"path": LONG, "content": "rewritten\n"}),
              ("write_file", {"path": NEWLINE, "content": "rewritten\n"}),
              ("write_file", {"path": "dflash_agent/tools/search.py", "content": "import os\nos.system('id')\n"}),
              ("edit_file", {"path": "src/app.py", "old_string": "x = 1", "new_string": "x = 2"}),
              ("grep", {"pattern": "os.system"})]
    return calls


def bash_calls(h: Hostile) -> dict[str, str]:
    # The tokens are never written whole in a command: a command's own command line would match.
    half = len(h.token) // 2
    pattern = f"printf '%s%s\\n' {h.token[:half]} {h.token[half:]} > .pattern"
    return {
        "write_outside": f"touch {h.markers / 'bash-touch'}; echo pwned > {h.outside / 'bash-target.txt'}; "
                         f"mkdir {h.outside / 'bash-dir'}; echo pwned > {h.tmp_probe}-bash; "
                         f"echo pwned > {h.far / 'target.txt'}; touch {h.far / 'bash-new'}; echo done",
        # the third hostile pass: kernel settings (as root: a core_pattern runs as root at the next crash), mounts,
        # namespaces, and git config planted in a repository made here and in the nested one
        "kernel": f"{sys.executable} -c \"import os; os.write(os.open('/proc/sys/kernel/core_pattern', os.O_WRONLY), "
                  f"b'|{h.markers / 'core'}')\"; echo core=$?; echo pwned > /proc/sys/kernel/hostname; "
                  "echo hostname=$?; echo h > /proc/sysrq-trigger; echo sysrq=$?; unshare -U true; echo userns=$?; "
                  "mkdir -p m && mount -t tmpfs none m; echo mount=$?; echo done",
        "git": f"git init -q . && git config core.fsmonitor 'touch {h.markers / 'git-init'}'; "
               f"git -C sub config core.fsmonitor 'touch {h.markers / 'git-nested'}'; echo nested=$?; "
               f"mkdir -p new/repo && git init -q new/repo && git -C new/repo config core.fsmonitor "
               f"'touch {h.markers / 'git-new'}'; echo done",
        "server_secrets": f"{pattern}; echo scanned $(ls -d /proc/[0-9]* | wc -l) processes; "
                          "grep -l -a -F -f .pattern /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null; "
                          "env | grep -a -F -f .pattern; rm -f .pattern; echo done",
    }


async def call(client: Client, record: list[Call], tool: str, arguments: dict[str, Any], fifo: Path,
               timeout: float = CALL_TIMEOUT_S) -> Call:
    done = Call(tool, arguments)
    record.append(done)
    started = time.monotonic()
    with anyio.move_on_after(timeout) as scope:
        result = await client.call_tool(tool, arguments)
        done.text = "\n".join(getattr(part, "text", "") for part in result.content)
        done.is_error = bool(result.is_error)
    done.seconds = time.monotonic() - started
    if scope.cancelled_caught:
        done.hung = True
        unblock(fifo)  # should it be a FIFO open that hangs, the next calls still get a server
    return done


def server_command(h: Hostile, url: str) -> StdioServerParameters:
    script = Path(sys.executable).with_name("dflash-agent")
    # An editor starts the installed command in the repository; `python -m` there would import the repo's package
    # itself, so without the script: -I, which keeps the working directory off sys.path.
    launcher = [str(script)] if script.exists() else [sys.executable, "-I", "-m", "dflash_agent"]
    env = {**os.environ, "DFLASH_AGENT_API_KEY": f"dflash-{h.token}", "OPENAI_API_KEY": f"openai-{h.token}",
           "ANTHROPIC_API_KEY": f"anthropic-{h.token}"}
    env.pop("DFLASH_AGENT_SERVER", None)
    args = [*launcher[1:], "mcp", "--repo", str(h.ws), "--expose-tools", "--server", url,
            "--deny", f"never-matches-{h.token}"]  # a secret on the server's command line
    return StdioServerParameters(command=launcher[0], args=args, env=env, cwd=h.ws)


NO_SANDBOX = Sandbox().problem()  # why the bash sandbox cannot start here (None: it can)


async def scenario(h: Hostile, record: Record, url: str, errlog) -> None:
    fifo = h.ws / "fifo"
    with anyio.fail_after(300):
        async with Client(stdio_client(server_command(h, url), errlog=errlog), read_timeout_seconds=120) as client:
            for tool, arguments in file_tool_calls(h):
                await call(client, record.calls, tool, arguments, fifo)
            record.run_task = await call(client, record.calls, "run_task", {"task": "Say done.", "max_steps": 1},
                                         fifo)
            # unconfined (no bwrap here) bash may write outside by design, as the server's warning says
            for name, command in bash_calls(h).items() if NO_SANDBOX is None else ():
                record.bash[name] = await call(client, record.calls, "bash", {"command": command, "timeout": 10},
                                               fifo)
            await pathological_searches(client, record, fifo)
            record.alive_after = await call(client, [], "list_dir", {"path": "src"}, fifo)


async def pathological_searches(client: Client, record: Record, fifo: Path) -> None:
    """Last, as a server they stall may not come back: a glob that backtracks for minutes, and a grep whose regex
    does, with list_dir timed meanwhile. The grep is cancelled after that (its own limit is a minute)."""
    glob_done = anyio.Event()

    async def glob() -> None:
        await call(client, record.slow, "glob", {"pattern": "*a*a*a*a*a*b"}, fifo, SLOW_CALL_TIMEOUT_S)
        glob_done.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(glob)
        tasks.start_soon(call, client, [], "grep", {"pattern": "(a|aa)*c", "path": "aaaa.txt"}, fifo,
                         SLOW_CALL_TIMEOUT_S)
        await anyio.sleep(0.5)
        for _ in range(3):
            listed = await call(client, [], "list_dir", {"path": "."}, fifo, RESPONSIVE_S * 5)
            record.list_dir_seconds.append(listed.seconds)
            await anyio.sleep(0.2)
        await glob_done.wait()
        tasks.cancel_scope.cancel()


@pytest.fixture(scope="module")
def far() -> Iterator[Path]:
    far = Path(tempfile.mkdtemp(prefix="dflash-hostile-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    yield far
    shutil.rmtree(far)


@pytest.fixture(scope="module")
def record(tmp_path_factory, far) -> Record:
    base = tmp_path_factory.mktemp("hostile")
    h = build(base, far)
    rec = Record(h, before={**snapshot(base, h.ws), **snapshot(far, far)}, kernel_before=kernel_settings())
    errlog = (base / "stderr.txt").open("w+")
    with fake_server([Reply("done.")]) as fake:
        anyio.run(scenario, h, rec, fake.url, errlog)
    time.sleep(0.5)  # what the server left running has had its chance to write
    rec.kernel_after = kernel_settings()
    # what the user does next in the workspace: git there and in the repositories under it, as a prompt would
    for repo in (h.ws, h.ws / "sub", h.ws / "new" / "repo"):
        subprocess.run(["git", "-C", str(repo), "status", "--short"], capture_output=True, timeout=60)
    rec.after = {**snapshot(base, h.ws), **snapshot(far, far)}
    rec.tmp_probe_exists = h.tmp_probe.exists()
    rec.bash_tmp_probe_exists = Path(f"{h.tmp_probe}-bash").exists()
    errlog.seek(0)
    rec.stderr = errlog.read()
    # What a test finds written outside is removed, so a rerun on this machine starts clean.
    for probe in (h.tmp_probe, Path(f"{h.tmp_probe}-bash")):
        probe.unlink(missing_ok=True)
    return rec


def test_no_code_from_the_repository_runs(record):
    ran = sorted(p.name for p in record.hostile.markers.iterdir() if not p.name.startswith("bash-"))
    assert ran == [], f"the repository's code ran: {ran}"


def test_nothing_outside_is_read(record):
    h = record.hostile
    leaks = [str(c) for c in record.file_calls() if h.token in c.text]
    assert leaks == [], "outside content or names came back:\n" + "\n".join(leaks)


def test_nothing_outside_is_written(record):
    h = record.hostile
    changed = {path: (record.before.get(path), record.after.get(path))
               for path in record.before.keys() | record.after.keys()
               if record.before.get(path) != record.after.get(path) and not Path(path).name.startswith("bash-")
               and path != str(h.base / "stderr.txt")}
    assert changed == {}, f"changed outside the workspace: {changed}"
    assert h.secret.read_text() == h.secret_text + "\n"
    assert not record.tmp_probe_exists, f"{h.tmp_probe} was created through the workspace's link to /"


def test_run_task_keeps_its_state_inside(record):
    assert record.run_task is not None and not record.run_task.hung, record.run_task
    assert list(record.hostile.state.iterdir()) == [], "run_task wrote through the .dflash-agent link"


def test_no_call_hangs_and_every_answer_is_a_tool_result(record):
    hung = [str(c) for c in record.calls if c.hung]
    assert hung == [], "hung:\n" + "\n".join(hung)
    internal = [str(c) for c in record.calls if "internal error" in c.text]
    assert internal == [], "bugs:\n" + "\n".join(internal)
    assert "Traceback" not in record.stderr, record.stderr[-3000:]


def test_every_way_out_is_refused(record):
    h = record.hostile
    reading_outside = [c for c in record.file_calls() if c.tool in ("read_file", "edit_file", "write_file", "list_dir")
                       and any(part in c.arguments["path"] for part in ("secret", "outside", "root", ".dflash-agent"))]
    accepted = [str(c) for c in reading_outside if not c.is_error]
    assert reading_outside and accepted == [], "accepted:\n" + "\n".join(accepted)
    assert h.token not in "".join(c.text for c in reading_outside)


def test_the_server_stays_responsive_during_a_pathological_search(record):
    assert len(record.list_dir_seconds) == 3
    assert max(record.list_dir_seconds) < RESPONSIVE_S, record.list_dir_seconds
    glob = record.slow[0]
    assert glob.tool == "glob" and not glob.hung, glob  # a linear-time matcher: the pattern is no harder than any
    assert record.alive_after is not None and not record.alive_after.hung and "app.py" in record.alive_after.text


@pytest.mark.skipif(NO_SANDBOX is not None, reason=f"the bash sandbox cannot start here: {NO_SANDBOX}")
def test_bash_cannot_write_outside(record):
    h = record.hostile
    bash = record.bash["write_outside"]
    assert not bash.hung and "done" in bash.text, bash
    assert not any(p.name.startswith("bash-") for p in h.markers.iterdir())
    assert not (h.outside / "bash-dir").exists() and not (h.far / "bash-new").exists()
    assert h.far.joinpath("target.txt").read_text() == h.secret_text + "\n"
    assert "Read-only file system" in bash.text  # what it could see, it could not change
    assert (h.outside / "bash-target.txt").read_text() == "bash may not change this\n"
    assert not record.bash_tmp_probe_exists  # the sandbox's /tmp is its own


@pytest.mark.skipif(NO_SANDBOX is not None, reason=f"the bash sandbox cannot start here: {NO_SANDBOX}")
def test_bash_cannot_read_the_server_secrets(record):
    bash = record.bash["server_secrets"]
    assert not bash.hung and "done" in bash.text and "scanned" in bash.text, bash
    assert "/proc/" not in bash.text and record.hostile.token not in bash.text, bash.text


@pytest.mark.skipif(NO_SANDBOX is not None, reason=f"the bash sandbox cannot start here: {NO_SANDBOX}")
def test_bash_changes_no_kernel_setting_and_mounts_nothing(record):
    bash = record.bash["kernel"]
    assert not bash.hung and "done" in bash.text, bash
    assert record.kernel_after == record.kernel_before
    said = dict(line.split("=", 1) for line in bash.text.splitlines() if "=" in line and " " not in line)
    assert all(said[name] != "0" for name in ("core", "hostname", "sysrq", "userns", "mount")), bash.text


@pytest.mark.skipif(NO_SANDBOX is not None, reason=f"the bash sandbox cannot start here: {NO_SANDBOX}")
def test_no_git_config_planted_runs_on_the_host(record):
    """The markers of the planted fsmonitor commands are checked with the repository's others
    (test_no_code_from_the_repository_runs); here, that each attempt was refused or disabled and said so."""
    bash = record.bash["git"]
    assert not bash.hung and "done" in bash.text, bash
    assert "nested=0" not in bash.text  # the nested repository's .git is read-only
    assert ".git-disabled-by-dflash-agent" in bash.text, bash.text
    ws = record.hostile.ws
    assert not (ws / ".git").exists() and not (ws / "new" / "repo" / ".git").exists()
    assert "fsmonitor" not in (ws / "sub" / ".git" / "config").read_text()


def test_the_git_file_tool_writes_are_refused(record):
    git_writes = [c for c in record.file_calls() if ".git/" in c.arguments.get("path", "")]
    assert len(git_writes) == 4 and all(c.is_error for c in git_writes), [str(c) for c in git_writes]
    assert "fsmonitor" not in (record.hostile.ws / "sub" / ".git" / "config").read_text()
