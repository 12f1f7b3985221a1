"""The seccomp filter bwrap installs before the command runs (`--seccomp FD`): system calls that administer the
kernel, the mounts and the namespaces, which a coding command never makes, fail with EPERM. As Docker's default
profile does, and for the same reason: where the server runs as root, the command runs as uid 0 (in a user
namespace of its own, without capabilities), and these calls are the kernel's widest surface for a way out.

Refused: mounts and the new mount API; swap, reboot, kexec, kernel modules, accounting, the clocks, the host and
domain names, quotas, the kernel log, vhangup; bpf, perf events, userfaultfd, the key rings; file handles
(open_by_handle_at walks the whole filesystem, past the bind mounts); new namespaces (unshare, setns, clone with a
CLONE_NEW* flag); on x86-64 the I/O ports and the x32 calls. clone3 and io_uring_setup answer ENOSYS instead,
so that glibc falls back to clone and libuv to its thread pool. A program of another architecture (32-bit x86
on x86-64) gets ENOSYS for every call: the filter's numbers are the native table's.

A classic BPF program over `struct seccomp_data` (linux/seccomp.h), in the kernel's byte order; no libseccomp."""

from __future__ import annotations

import errno
import platform
import struct
import sys

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR_OFFSET, _ARCH_OFFSET, _ARG0_OFFSET = 0, 4, 16
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
# CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWTIME
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
_X32_BIT = 0x40000000

# The calls refused, by name; numbers from each architecture's table (arch/x86/entry/syscalls/syscall_64.tbl and
# include/uapi/asm-generic/unistd.h, which arm64 uses). Calls added since 5.1 share one number everywhere.
REFUSED = (
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "open_tree_attr", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "swapon", "swapoff", "reboot", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "sethostname", "setdomainname", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "open_by_handle_at", "name_to_handle_at", "quotactl", "quotactl_fd", "syslog", "vhangup", "unshare", "setns",
    "lookup_dcookie", "ioperm", "iopl", "uselib", "_sysctl",
)
NOT_IMPLEMENTED = ("clone3", "io_uring_setup")


class Architecture:
    """One architecture's audit number and system call numbers."""

    def __init__(self, audit_arch: int, numbers: dict[str, int], x32: bool) -> None:
        self.audit_arch = audit_arch
        self.numbers = numbers
        self.x32 = x32  # x86-64: calls with the x32 bit set come through the same arch number


_SHARED = {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
           "clone3": 435, "mount_setattr": 442, "quotactl_fd": 443, "open_tree_attr": 467,
           "io_uring_setup": 425}
ARCHITECTURES = {
    "x86_64": Architecture(0xC000003E, {
        **_SHARED, "clone": 56, "syslog": 103, "uselib": 134, "vhangup": 153, "pivot_root": 155, "_sysctl": 156,
        "adjtimex": 159, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167,
        "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173,
        "init_module": 175, "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212, "clock_settime": 227,
        "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
        "name_to_handle_at": 303, "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308, "finit_module": 313,
        "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323}, x32=True),
    "aarch64": Architecture(0xC00000B7, {
        **_SHARED, "lookup_dcookie": 18, "vhangup": 58, "quotactl": 60, "umount2": 39, "mount": 40,
        "pivot_root": 41, "acct": 89, "unshare": 97, "kexec_load": 104, "init_module": 105, "delete_module": 106,
        "clock_settime": 112, "syslog": 116, "reboot": 142, "sethostname": 161, "setdomainname": 162,
        "settimeofday": 170, "adjtimex": 171, "add_key": 217, "request_key": 218, "keyctl": 219, "clone": 220,
        "swapon": 224, "swapoff": 225, "perf_event_open": 241, "name_to_handle_at": 264, "open_by_handle_at": 265,
        "clock_adjtime": 266, "setns": 268, "finit_module": 273, "bpf": 280, "userfaultfd": 282,
        "kexec_file_load": 294}, x32=False),
}


def host_architecture() -> Architecture | None:
    """This machine's entry in ARCHITECTURES; None on another (then bwrap runs without the filter)."""
    if not sys.platform.startswith("linux"):
        return None
    return ARCHITECTURES.get(platform.machine())


def filter_program(arch: Architecture) -> bytes:
    """The filter as `struct sock_filter` records (u16 code, u8 jt, u8 jf, u32 k), native byte order."""
    refused = sorted({arch.numbers[name] for name in REFUSED if name in arch.numbers})
    not_implemented = sorted({arch.numbers[name] for name in NOT_IMPLEMENTED})
    # Instructions up to the clone check, then four returns; jumps are counted from the next instruction
    head = 3 + (2 if arch.x32 else 0) + 1
    body = len(refused) + len(not_implemented)
    clone_at = head + body
    allow, deny, nosys = clone_at + 3, clone_at + 4, clone_at + 5
    program: list[tuple[int, int, int, int]] = [
        (_LD_W_ABS, 0, 0, _ARCH_OFFSET),
        (_JEQ_K, 1, 0, arch.audit_arch),
        (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS),
        (_LD_W_ABS, 0, 0, _NR_OFFSET),
    ]
    if arch.x32:
        program += [(_JGE_K, 0, 1, _X32_BIT), (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS)]
    for target, numbers in ((deny, refused), (nosys, not_implemented)):
        for number in numbers:
            program.append((_JEQ_K, target - len(program) - 1, 0, number))
    assert len(program) == clone_at
    program.append((_JEQ_K, 0, allow - len(program) - 1, arch.numbers["clone"]))
    program.append((_LD_W_ABS, 0, 0, _ARG0_OFFSET if sys.byteorder == "little" else _ARG0_OFFSET + 4))
    program.append((_JSET_K, deny - len(program) - 1, 0, CLONE_NEW_FLAGS))
    program.append((_RET_K, 0, 0, _RET_ALLOW))
    program.append((_RET_K, 0, 0, _RET_ERRNO | errno.EPERM))
    program.append((_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS))
    assert len(program) == nosys + 1 and all(0 <= jt <= 255 and 0 <= jf <= 255 for _, jt, jf, _ in program)
    return b"".join(struct.pack("=HBBI", *record) for record in program)
