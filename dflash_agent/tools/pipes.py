"""Pipes whose descriptors a child process is handed by number (pass_fds)."""

from __future__ import annotations

import fcntl
import os


def pipe_above_std() -> tuple[int, int]:
    """os.pipe(), with neither end on 0, 1 or 2. A server started with stdin (or stdout) closed gets such a number
    from os.pipe(), and Popen's stdin / stdout / stderr arguments then replace it in the child: bwrap read its
    seccomp filter from /dev/null, and the sandbox failed to start."""
    ends = os.pipe()
    out = []
    for fd in ends:
        if fd > 2:
            out.append(fd)
            continue
        try:
            out.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3))
        finally:
            os.close(fd)
    return out[0], out[1]
