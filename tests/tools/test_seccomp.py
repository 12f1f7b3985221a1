"""The sandbox's seccomp filter (tools/seccomp.py): its numbers are the kernel headers', and in bwrap the calls it
refuses fail with EPERM or ENOSYS while what a coding command does (processes, threads, files, git) still works."""

import asyncio
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_agent.tools.registry import workspace_tools
from dflash_agent.tools.sandbox import Sandbox
from dflash_agent.tools.seccomp import ARCHITECTURES, NOT_IMPLEMENTED, REFUSED, host_architecture
from dflash_agent.tools.workspace import Workspace

_UNAVAILABLE = Sandbox(mode="auto").problem()
needs_filter = pytest.mark.skipif(_UNAVAILABLE is not None or host_architecture() is None,
                                  reason=f"the sandbox cannot start here or has no filter for this architecture: "
                                         f"{_UNAVAILABLE or 'no table'}")

# Linux's uapi headers (Debian's linux-libc-dev): x86-64's own table and the generic one arm64 uses
_HEADERS = {"x86_64": [Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"), Path("/usr/include/asm/unistd_64.h")],
            "aarch64": [Path("/usr/include/asm-generic/unistd.h")]}


@pytest.mark.parametrize("machine", sorted(ARCHITECTURES))
def test_the_numbers_are_the_kernel_headers(machine):
    header = next((path for path in _HEADERS[machine] if path.exists()), None)
    if header is None:
        pytest.skip(f"no {machine} syscall header here ({', '.join(map(str, _HEADERS[machine]))})")
    defined = {name: int(number) for name, number in
               re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", header.read_text())}
    numbers = ARCHITECTURES[machine].numbers
    checked = [name for name in (*REFUSED, *NOT_IMPLEMENTED, "clone") if name in defined]
    assert len(checked) >= 40, checked  # newer calls may postdate the installed header
    assert {name: numbers.get(name) for name in checked} == {name: defined[name] for name in checked}
    # a call the header lacks is one the table must not invent for this architecture (ioperm on arm64)
    assert all(name in defined for name in numbers if int(numbers[name]) < 400), sorted(set(numbers) - set(defined))


PROBE = r"""
import ctypes, errno, os, sys, threading, subprocess
libc = ctypes.CDLL(None, use_errno=True)
calls = {%(calls)s}
for name, (number, args) in calls.items():
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args])
    print(name, 'allowed' if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
# what a command does: processes (glibc's posix_spawn tries clone3, then clone), threads, files
t = threading.Thread(target=lambda: None); t.start(); t.join()
out = subprocess.run(['sh', '-c', 'echo spawned; mkdir d && echo x > d/f && cat d/f'], capture_output=True, text=True)
print('work', out.returncode, out.stdout.split())
"""


@needs_filter
def test_in_the_sandbox_the_refused_calls_fail_and_the_work_goes_on(tmp_path):
    arch = host_architecture()
    n = arch.numbers
    # each with arguments that would do something if allowed (or fail with another errno than the filter's)
    calls = {"mount": (n["mount"], [0, 0, 0, 0, 0]), "unshare_user": (n["unshare"], [0x10000000]),
             "unshare_none": (n["unshare"], [0]), "setns": (n["setns"], [-1, 0]), "keyctl": (n["keyctl"], [0, 0]),
             "bpf": (n["bpf"], [0, 0, 0]), "perf_event_open": (n["perf_event_open"], [0, 0, -1, -1, 0]),
             "sethostname": (n["sethostname"], [0, 0]), "clone3": (n["clone3"], [0, 0]),
             "io_uring_setup": (n["io_uring_setup"], [1, 0]),
             "open_by_handle_at": (n["open_by_handle_at"], [-1, 0, 0]),
             "clone_newuser": (n["clone"], [0x10000000 | 17, 0, 0, 0, 0]), "getpid": ({"x86_64": 39, "aarch64": 172}[platform.machine()], [])}
    root = tmp_path / "repo"
    root.mkdir()
    (root / "probe.py").write_text(PROBE % {"calls": ", ".join(f"{k!r}: {v!r}" for k, v in calls.items())})
    tools = workspace_tools(Workspace(root))
    result = asyncio.run(tools.dispatch("bash", {"command": f"{sys.executable} probe.py"}))
    said = dict(line.split(" ", 1) for line in result.text.splitlines() if line.split(" ", 1)[0] in calls)
    assert said == {**{name: "EPERM" for name in calls}, "clone3": "ENOSYS", "io_uring_setup": "ENOSYS",
                    "getpid": "allowed"}, result.text
    assert "work 0 ['spawned', 'x']" in result.text, result.text


@needs_filter
def test_git_runs_under_the_filter(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "a").write_text("a\n")
    tools = workspace_tools(Workspace(root))
    result = asyncio.run(tools.dispatch("bash", {"command": "git status --short && git diff --stat && git log -1 "
                                                            "2>&1 | head -1; echo done $?"}))
    assert "?? a" in result.text and "done 0" in result.text, result.text
