"""The first program in the sandbox (sandbox.py runs `python -I -S -c <this file> ARGV...`): it restricts itself
with Landlock, then becomes ARGV, so the command and all it starts stay restricted.

What Landlock adds to bwrap: Unix sockets made outside the sandbox cannot be reached from it.
- Abstract ones (Landlock ABI 6, Linux 6.12): with the network on, the sandbox shares the host's network
  namespace, and with it the abstract sockets of an X11 display (keystrokes into the user's terminal), D-Bus
  buses and container runtimes.
- Those at a path (ABI 9): a socket anywhere on the read-only filesystem (an agent's under $HOME, say).
A socket the command makes itself still works (Python's forkserver, a test's own server): Landlock refuses only
those of other domains. On an older kernel the command runs with what the kernel has, as Codex applies Landlock:
bwrap's confinement does not depend on it.

Passed as source, not as a path: a checkout under /tmp is out of the sandbox's sight (its /tmp is its own). Only
the standard library, and no `site`."""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import sys

# The same numbers on every architecture (syscalls added after 5.x share one table)
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
ACCESS_FS_REFER = 1 << 13  # ABI 2
ACCESS_FS_RESOLVE_UNIX = 1 << 16  # ABI 9
_PR_SET_NO_NEW_PRIVS = 38

SCOPES_ABI = 6
RESOLVE_UNIX_ABI = 9


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock (not built in, not enabled, not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        abi = libc.syscall(ctypes.c_long(_CREATE_RULESET), ctypes.c_void_p(None), ctypes.c_size_t(0),
                           ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(abi, 0)


def restrict_unix_sockets() -> None:
    """Restrict this process (and what it starts) to the Unix sockets of its own Landlock domain, as far as the
    kernel can."""
    abi = landlock_abi()
    if abi >= SCOPES_ABI:
        restrict(ACCESS_FS_RESOLVE_UNIX if abi >= RESOLVE_UNIX_ABI else 0, SCOPE_ABSTRACT_UNIX_SOCKET)


def restrict(handled_fs: int, scoped: int) -> bool:
    """Landlock's ruleset of `handled_fs` rights, none of them granted, and `scoped` scopes, on this process;
    whether the kernel took it. A ruleset that handles any filesystem right also refuses moving or linking a file
    to another directory unless a rule grants that (LANDLOCK_ACCESS_FS_REFER), so one rule grants it everywhere:
    pip, cargo and git rename across directories."""
    libc = ctypes.CDLL(None, use_errno=True)
    if handled_fs:
        handled_fs |= ACCESS_FS_REFER
    attr = struct.pack("=QQQ", handled_fs, 0, scoped)  # handled fs, handled net, scoped
    fd = libc.syscall(ctypes.c_long(_CREATE_RULESET), attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if fd < 0:
        return False
    try:
        if handled_fs:
            root = os.open("/", os.O_PATH | os.O_CLOEXEC)
            try:
                rule = struct.pack("=Qi", ACCESS_FS_REFER, root)  # landlock_path_beneath_attr, packed
                if libc.syscall(ctypes.c_long(_ADD_RULE), ctypes.c_int(fd), ctypes.c_int(_RULE_PATH_BENEATH), rule,
                                ctypes.c_uint32(0)) != 0:
                    return False
            finally:
                os.close(root)
        # Landlock needs no_new_privs unless the caller has CAP_SYS_ADMIN; bwrap sets it already
        libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
        return libc.syscall(ctypes.c_long(_RESTRICT_SELF), ctypes.c_int(fd), ctypes.c_uint32(0)) == 0
    finally:
        os.close(fd)


def main(argv: list[str]) -> None:
    restrict_unix_sockets()
    for number in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them, and exec would keep that
        signal.signal(number, signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"{argv[0]}: {exc.strerror}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
