"""The sandbox for the processes the tools start (the bash tool's commands, the search helpers):
bubblewrap (`bwrap`) on Linux, as Claude Code and Codex use there.

Inside, a command runs in its own PID namespace with a fresh /proc: it cannot see or signal the
server's processes, nor read their environment or command line (API keys). It is the namespace's
second process, below bwrap's own init; when the command exits, or when the server kills that init
(a timeout, a cancel), the kernel kills everything left in the namespace, whatever the command did
to its parent (`kill -STOP $PPID` and `kill -9 $PPID` reach an init that ignores them). The whole
filesystem is read-only but the workspace (its git metadata at any depth excepted) and a private /tmp; the
usual session, system-bus and Docker sockets are hidden; capabilities are dropped (root included), and
/proc's kernel settings (/proc/sys and the like) are read-only, which dropped capabilities alone do not make them
for root; a seccomp filter refuses the calls that administer the kernel, mounts and namespaces (seccomp.py); where
the server runs as root, the command is root only in a user namespace of its own, which can make no other (its uid
on the workspace's files stays 0: they are root's); the network is kept or cut by option. Inside, Landlock refuses
the Unix sockets made outside the sandbox (abstract ones from Linux 6.12, those at a path from Landlock ABI 9:
confine.py).

Where bwrap is missing or cannot start (not Linux, no user namespaces in a nested container), the
`auto` mode says so in one warning and the tools run commands as before (launcher.py): timeouts still
kill what a command starts, but nothing else above is confined."""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError
from .confine import RESOLVE_UNIX_ABI, SCOPES_ABI, landlock_abi
from .pipes import pipe_above_std
from .seccomp import filter_program, host_architecture

log = logging.getLogger(__name__)

SANDBOX_MODES = ("auto", "bwrap", "off")
_PROBE_TIMEOUT_S = 10.0
_STOP_S = 10.0  # how long bwrap may take to start, or to reap its init once that is killed
_POLL_S = 0.05
# Where the sockets of the user's session (D-Bus, ssh and gpg agents, Wayland), the system bus and Docker live
_HOST_SOCKETS = ("/run/user", "/run/dbus", "/run/docker.sock", "/var/run/docker.sock")
# What a fresh /proc holds that changes the host: sysctls, the SysRq trigger, IRQ affinities, PCI / USB devices
_PROC_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")
# The first program in the sandbox: Landlock keeps the command off Unix sockets made outside (confine.py)
_CONFINE_SOURCE = Path(__file__).with_name("confine.py").read_text()


class SandboxError(UserError):
    """`--sandbox bwrap` asked for the sandbox and it cannot start."""


class Sandbox:
    """One process's sandbox settings and whether bwrap works here, probed once on first use.

    `mode`: auto (bwrap where it starts, else one warning and no sandbox), bwrap (required: SandboxError
    where it cannot start) or off. `network`: whether sandboxed commands may use the network (the
    search helpers never get it)."""

    def __init__(self, mode: str = "auto", network: bool = True, bwrap: str | None = None) -> None:
        if mode not in SANDBOX_MODES:
            raise UserError(f"sandbox mode {mode!r}: expected one of {', '.join(SANDBOX_MODES)}")
        self.mode = mode
        self.network = network
        self.bwrap = bwrap if bwrap is not None else shutil.which("bwrap")
        self._lock = threading.Lock()
        self._probed = False
        self._reason: str | None = None  # why bwrap cannot start, once probed; None: it can
        self._warned = False
        # the kernel's Landlock, for confine.py: without its scopes (Linux < 6.12) the command starts without it
        self.landlock_abi = landlock_abi()
        arch = host_architecture()
        self.seccomp_program = filter_program(arch) if arch is not None else None
        # Started by root, bwrap makes no user namespace unless asked; in one, root's capabilities (dropped
        # anyway) would reach nothing outside it. Where the kernel refuses one, the probe goes on without it
        self.own_user_namespace = os.geteuid() == 0 if hasattr(os, "geteuid") else False

    def problem(self) -> str | None:
        """Why bwrap cannot start here, or None where it can; probed on the first call (a few ms)."""
        with self._lock:
            if not self._probed:
                self._reason = self._probe()
                self._probed = True
            return self._reason

    def enabled(self) -> bool:
        """Whether commands run in bwrap. In auto mode where bwrap cannot start, the first call logs the one
        warning; in bwrap mode that raises SandboxError instead."""
        if self.mode == "off":
            return False
        reason = self.problem()
        if reason is not None and self.mode == "bwrap":
            raise SandboxError(f"--sandbox bwrap: the sandbox cannot start: {reason}")
        with self._lock:
            if reason is not None and not self._warned:
                self._warned = True
                log.warning("sandbox off: %s; tool commands run unconfined (they can see the server's processes "
                            "and write outside the workspace). Install bubblewrap, or pass --sandbox off to choose "
                            "this and silence the warning.", reason)
        return reason is None

    def describe(self) -> str:
        """One phrase for a startup line: what confines the tools' commands."""
        if not self.enabled():
            return "off" if self.mode == "off" else "off (bwrap cannot start)"
        abi = self.landlock_abi
        sockets = ("; Unix sockets from outside refused" if abi >= RESOLVE_UNIX_ABI else
                   "; abstract Unix sockets from outside refused" if abi >= SCOPES_ABI else "")
        return f"bwrap, network {'on' if self.network else 'off'}{sockets}"

    def command(self, argv: Sequence[str], cwd: Path, writable: Sequence[Path] = (), tmp: Path | None = None,
                private_tmp: bool = True, network: bool | None = None, info_fd: int | None = None,
                search_path: str | None = None, read_only: Sequence[Path] = (),
                seccomp_fd: int | None = None) -> list[str]:
        """argv run in the sandbox, in `cwd`: the filesystem read-only but `writable` (bound at the same
        paths, with `read_only` paths inside them bound read-only again) and, with `private_tmp`, a /tmp of
        its own (`tmp` bound there, else an empty tmpfs) that hides the machine's but for the tools a command
        needs (`tmp_tools`, with `search_path` its PATH);
        `network` defaults to the sandbox's. `info_fd`: where bwrap writes the namespace init's pid (JSON
        `child-pid`), then closes it. `seccomp_fd`: where bwrap reads the filter (`seccomp_fd()`)."""
        assert self.bwrap is not None
        args = [self.bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        # The kernel's settings under the fresh /proc stay read-only: started by root, bwrap makes no user namespace
        # and a sysctl write is checked against the euid, not the dropped capabilities, so a command could set
        # kernel.core_pattern to a workspace program that the next crash runs as root on the host.
        for path in _PROC_READ_ONLY:
            args += ["--ro-bind-try", path, path]
        if private_tmp:
            args += ["--bind", str(tmp), "/tmp"] if tmp is not None else ["--tmpfs", "/tmp"]
            for path in tmp_tools(search_path):
                args += ["--ro-bind", str(path), str(path)]
        for path in writable:  # after /tmp: a workspace under /tmp is bound over the private one
            args += ["--bind", str(path), str(path)]
        # Bound as mount points, these cannot be renamed away and replaced either (git metadata: git_metadata.py)
        for path in sorted(read_only, key=lambda p: len(Path(p).parts)):
            args += ["--ro-bind", str(path), str(path)]
        # Sockets that lead out of the sandbox to something that runs commands (the user's session bus:
        # systemd-run --user; Docker's; agents holding keys) are hidden where they usually live
        for path in _HOST_SOCKETS:
            if Path(path).is_dir() and not Path(path).is_symlink():
                args += ["--tmpfs", path]
            elif Path(path).exists():
                args += ["--ro-bind", "/dev/null", path]
        args += ["--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        if self.own_user_namespace:
            args.append("--unshare-user")
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        if not (self.network if network is None else network):
            args.append("--unshare-net")
        if info_fd is not None:
            args += ["--info-fd", str(info_fd)]
        confine = [sys.executable, "-I", "-S", "-c", _CONFINE_SOURCE] if self.landlock_abi >= SCOPES_ABI else []
        return [*args, "--chdir", str(cwd), "--", *confine, *argv]

    def start(self, argv: Sequence[str], cwd: Path, *, writable: Sequence[Path] = (), tmp: Path | None = None,
              private_tmp: bool = True, network: bool | None = None, env: Mapping[str, str],
              read_only: Sequence[Path] = (), **popen: Any) -> Started:
        """`command(...)` started with subprocess.Popen(**popen); once bwrap has set the namespace up.
        Call `stop()` on what it returns however the run ends."""
        info_r, info_w = pipe_above_std()
        seccomp_r = self.seccomp_fd()
        try:
            proc = subprocess.Popen(self.command(argv, cwd, writable, tmp, private_tmp, network, info_fd=info_w,
                                                 search_path=env.get("PATH"), read_only=read_only,
                                                 seccomp_fd=seccomp_r),
                                    env=dict(env), pass_fds=(info_w,) if seccomp_r is None else (info_w, seccomp_r),
                                    **popen)
        except BaseException:
            os.close(info_r)
            raise
        finally:
            os.close(info_w)
            if seccomp_r is not None:
                os.close(seccomp_r)
        return Started(proc, _namespace_init(info_r, proc))

    def seccomp_fd(self) -> int | None:
        """A pipe's read end holding the seccomp filter (seccomp.py) for one bwrap to read; None on an architecture
        it has no table for. The caller passes it to bwrap and closes it."""
        if self.seccomp_program is None:
            return None
        read, write = pipe_above_std()
        try:
            os.write(write, self.seccomp_program)  # a few hundred bytes: within any pipe's buffer
        finally:
            os.close(write)
        return read

    def run_helper(self, argv: Sequence[str], stdin: bytes | None, timeout: float,
                   cancel: threading.Event) -> HelperRun:
        """A helper process we ship (the grep worker): in `/` with an empty environment, in the sandbox
        where it starts (read-only, no network), killed past `timeout` or once `cancel` is set; blocking
        (call it in a thread: a thread cleans up whether or not the caller is still there to wait)."""
        popen: dict[str, Any] = {"stdin": subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                    "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        if self.enabled():
            started = self.start(argv, Path("/"), private_tmp=False, network=False, env={}, **popen)
        else:
            started = Started(subprocess.Popen(argv, cwd="/", env={}, **popen), None)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    out, err = started.proc.communicate(stdin, timeout=_POLL_S)
                    return HelperRun(started.proc.returncode, out, err, timed_out=False)
                except subprocess.TimeoutExpired:
                    stdin = None  # sent already: communicate() goes on where it was
                if cancel.is_set() or time.monotonic() >= deadline:
                    started.stop()
                    try:
                        out, err = started.proc.communicate(timeout=_STOP_S)
                    except subprocess.TimeoutExpired:  # its output held open by what it started
                        out, err = b"", b""
                    return HelperRun(None, out, err, timed_out=not cancel.is_set())
        finally:
            started.stop()

    def _probe(self) -> str | None:
        if not sys.platform.startswith("linux"):
            return f"bubblewrap needs Linux (this is {sys.platform})"
        if self.bwrap is None:
            return "bwrap is not installed (Debian/Ubuntu: apt install bubblewrap)"
        reason = self._try_true()
        if reason is not None and self.own_user_namespace:
            self.own_user_namespace = False
            if self._try_true() is None:
                log.info("sandbox: no user namespace of its own for root's commands (%s)", reason)
                return None
            self.own_user_namespace = True
        return reason

    def _try_true(self) -> str | None:
        true = shutil.which("true") or "/bin/true"
        seccomp_r = self.seccomp_fd()
        try:
            done = subprocess.run(self.command([true], Path("/"), network=self.network, seccomp_fd=seccomp_r),
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=_PROBE_TIMEOUT_S,
                                  pass_fds=() if seccomp_r is None else (seccomp_r,))
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{self.bwrap} cannot run: {exc}"
        finally:
            if seccomp_r is not None:
                os.close(seccomp_r)
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip().splitlines()
            return f"{self.bwrap} failed ({said[-1] if said else f'exit code {done.returncode}'})"
        return None


def tmp_tools(search_path: str | None) -> list[Path]:
    """The folders under /tmp that the private /tmp would hide from a command but it needs: the Python running this
    process (its virtual environment and base install: the `python` a command runs, its packages) and the folders
    on the command's PATH. Bound read-only at their own paths: a venv made under /tmp (a CI checkout, say) keeps
    working in the sandbox, and the rest of the machine's /tmp stays out of sight."""
    wanted = {sys.prefix, sys.base_prefix, sys.exec_prefix, *(search_path or "").split(os.pathsep)}
    found: set[Path] = set()
    for name in wanted:
        if not name:
            continue
        for path in {Path(name).absolute(), Path(name).resolve()}:
            if path.is_relative_to("/tmp") and path != Path("/tmp") and path.is_dir():
                found.add(path)
    # outermost first: a folder bound after one inside it would hide it
    return sorted(found, key=lambda p: len(p.parts))


@dataclass
class HelperRun:
    returncode: int | None  # None: killed (timeout or cancel)
    stdout: bytes
    stderr: bytes
    timed_out: bool


@dataclass
class Started:
    """A process started in the sandbox (bwrap), and a pidfd of the namespace's init (None where bwrap
    said nothing: it failed, or the command ended at once; or a process started without the sandbox)."""

    proc: subprocess.Popen
    init: int | None

    def stop(self) -> None:
        """Kill everything still running (nothing if it ended), reap bwrap, release the pidfd. It kills the
        init, which takes every process of the namespace with it, and bwrap, its parent, reaps it. Killing
        bwrap would do too (--die-with-parent) but would leave the init's zombie to whoever reaps orphans
        here, which in a container may be nobody. A pidfd, not a pid: the pid could be reused once bwrap
        has reaped it."""
        if self.proc.poll() is None and self.init is not None:
            try:
                signal.pidfd_send_signal(self.init, signal.SIGKILL)
                self.proc.wait(_STOP_S)
            except (OSError, subprocess.TimeoutExpired):
                pass  # gone already; or bwrap did not go: killed below
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.init is not None:
            os.close(self.init)
            self.init = None


def _namespace_init(info_r: int, proc: subprocess.Popen) -> int | None:
    """A pidfd of the namespace's init, from the JSON bwrap writes to its info fd and then closes."""
    data = bytearray()
    until = time.monotonic() + _STOP_S
    try:
        while time.monotonic() < until:
            readable, _, _ = select.select([info_r], [], [], _POLL_S)
            if readable:
                chunk = os.read(info_r, 4096)
                if not chunk:
                    break
                data.extend(chunk)
            elif proc.poll() is not None:
                break
    finally:
        os.close(info_r)
    try:
        pid = int(json.loads(data)["child-pid"])
        pidfd = os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, OSError):
        return None
    if _parent_of(pid) != proc.pid:  # not bwrap's child: the init is gone and its pid was reused
        os.close(pidfd)
        return None
    return pidfd


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[1])
