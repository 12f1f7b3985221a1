"""The one builder of the CPU kernels: setup.py compiles the library with it at install, one per ISA variant, and the
tests that must compile themselves (a check program over the same sources, cross-built for aarch64, under
sanitizers) call it too, so what they test is built as what users run.

Standard library only: setup.py loads this file by its path, in a build environment that has none of the package's
dependencies.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_dot.c", HERE / "cpu_layer.c")
HEADERS = (HERE / "cpu_dot.h",)
# At install, "native" adds a build for the installing machine (-march=native); at run time cpu_dot.load reads it.
MODE_ENV = "DFLASH_AGENT_CPU_DOT"
# No fused multiply-adds the source did not write, so every variant rounds as the scalar reference does.
COMMON = ("-O3", "-ffp-contract=off", "-fopenmp", "-std=c11")
# variant -> its target flags; cpu_dot.VARIANTS says what each needs of the CPU.
TARGETS: dict[str, tuple[str, ...]] = {
    # the scalar C on every machine: the reference each vector build is tested against
    "generic": ("-DDFA_SCALAR",),
    # AVX2, FMA, F16C, BMI2: every x86 since 2013-15
    "x86_64_v3": ("-march=x86-64-v3", "-mtune=generic"),
    # AVX-512 (F, BW, CD, DQ, VL) with VNNI: Intel since Ice Lake / Cascade Lake, AMD since Zen 4
    "x86_64_v4_vnni": ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"),
    # NEON is part of the aarch64 baseline (armv8-a)
    "aarch64_neon": (),
    # only where asked for at install: the code may not run on another machine
    "native": ("-march=native",),
}
# The machines (platform.machine(), lower case) each vector variant is built for.
MACHINES: dict[str, tuple[str, ...]] = {"x86_64_v4_vnni": ("x86_64", "amd64"), "x86_64_v3": ("x86_64", "amd64"),
                                        "aarch64_neon": ("aarch64", "arm64")}


class BuildError(Exception):
    """The compiler could not be run, or failed; the message carries its output."""


def variants(machine: str | None = None, mode: str | None = None) -> list[str]:
    """The variants an install builds on `machine` (platform.machine()): generic, the vector ones of its
    architecture, and native where `mode` (DFLASH_AGENT_CPU_DOT) says so."""
    machine = (machine or platform.machine()).lower()
    mode = os.environ.get(MODE_ENV, "") if mode is None else mode
    built = ["generic", *(variant for variant, machines in MACHINES.items() if machine in machines)]
    return [*built, "native"] if mode == "native" else built


@functools.cache
def source_digest() -> str:
    """The sources' digest, compiled into the library (dfa_source_digest): the loader refuses a library whose
    sources beside it changed since."""
    return hashlib.sha256(b"\0".join(path.read_bytes() for path in SOURCES + HEADERS)).hexdigest()[:16]


def compiler() -> list[str]:
    """The C compiler command: $CC as a shell would split it (`ccache gcc`), else cc or gcc on the PATH."""
    given = shlex.split(os.environ.get("CC", ""))
    if given:
        return given
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise BuildError("no C compiler: set CC, or install gcc")
    return [found]


def compile_kernels(out: Path, target: Sequence[str], *, cc: Sequence[str] | None = None,
                    program: Sequence[Path] = ()) -> Path:
    """The kernels compiled with COMMON and `target` flags into `out`: a shared library, or with `program` (C files
    with a main) an executable of it linked with the kernels. Raises BuildError."""
    shared = () if program else ("-shared", "-fPIC")
    command = [*(cc or compiler()), *COMMON, *target, *shared, f"-I{HERE}",
               f'-DDFA_SOURCE_DIGEST="{source_digest()}"', *map(str, program), *map(str, SOURCES), "-o", str(out),
               "-lm"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{shlex.join(command)}: {exc}") from exc
    if done.returncode != 0 or not out.is_file():
        raise BuildError(f"{shlex.join(command)} failed:\n{done.stderr[-4000:]}")
    return out
