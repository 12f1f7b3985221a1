"""The bash tool's launcher: a small process between the server and the shell. Run as a script
(`python -I -S launcher.py STATUS_FD CONTROL_FD -- argv...`), with the scrubbed environment.

- It detaches at once (fork, the first process exits), so the shell's ancestors are the launcher and
  init: no process above the command holds the server's environment, which `/proc/$PPID/environ`
  would show whatever the server removed from its own copy.
- It is a child subreaper (Linux `PR_SET_CHILD_SUBREAPER`): a process that leaves the shell's session
  (`setsid`, double fork) is re-parented to the launcher instead of init, so it stays findable.
- When the shell exits, or the server closes CONTROL_FD (timeout, cancel, or the server died), it
  kills every process below it, reaps them, writes the shell's return code (as subprocess reports it,
  `-N` for a signal; `killed` when stopped through CONTROL_FD) to STATUS_FD and exits.

Only the standard library, and no `site`: it starts with every bash call."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36
_KILL_FOR_S = 5.0  # a fork bomb is outrun for this long; then the launcher gives up and exits


def _become_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the shell's process group is still killed
        pass


def _descendants(root: int) -> list[int]:
    """Every process below `root`, from the parent ids in /proc."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # The name in parentheses may hold spaces and ')': the fields after the last ')' are safe.
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_everything_below(shell: int) -> None:
    try:
        os.killpg(shell, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + _KILL_FOR_S
    while time.monotonic() < deadline:
        below = _descendants(os.getpid())
        if not below:
            return
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _reap()  # killed children, and zombies handed to us when their parents died
        time.sleep(0.005)


def _return_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main(argv: list[str]) -> None:
    status_fd, control_fd, command = int(argv[1]), int(argv[2]), argv[4:]
    if os.fork():
        os._exit(0)  # the server reaps this one at once; the launcher's parent is now init
    os.setsid()
    _become_subreaper()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    shell = os.fork()
    if shell == 0:
        os.setpgid(0, 0)
        for fd in (status_fd, control_fd, wake_r, wake_w):
            os.close(fd)
        signal.set_wakeup_fd(-1)
        # Python ignores SIGPIPE and SIGXFSZ (which exec keeps); restored as subprocess does.
        for number in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(number, signal.SIG_DFL)
        try:
            os.execv(command[0], command)
        finally:
            os._exit(127)
    # The output pipe belongs to the shell and what it starts: its end is the end of the output.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    result = "killed"
    while True:
        done, status = os.waitpid(shell, os.WNOHANG)
        if done:
            result = str(_return_code(status))
            break
        readable, _, _ = select.select([control_fd, wake_r], [], [])
        if control_fd in readable and not os.read(control_fd, 1):
            break  # the server hung up: stop everything
        if wake_r in readable:
            os.read(wake_r, 512)
            _reap_others(shell)
    _kill_everything_below(shell)
    os.write(status_fd, result.encode() + b"\n")
    os._exit(0)


def _reap_others(shell: int) -> None:
    """Reap adopted orphans that exited, leaving the shell's own status for waitpid(shell)."""
    for pid in _descendants(os.getpid()):
        if pid == shell:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # a grandchild: its parent reaps it


if __name__ == "__main__":
    main(sys.argv)
