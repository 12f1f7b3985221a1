"""The CPU kernels (dflash_agent/kernels/cpu_dot.c, cpu_layer.c) built when the package installs, one library per ISA
variant, so the code users run is the code CI tested and no compiler is needed at run time. They are plain shared
libraries loaded with ctypes (kernels/cpu_dot.py picks the best variant the CPU supports), built through
setuptools' extension machinery for its compiler discovery, wheel tagging and editable installs. A variant that
fails to build is skipped with a warning (optional): the loader then falls back to a run-time build, or torch."""

import hashlib
import platform
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = "dflash_agent/kernels"
SOURCES = [f"{KERNELS}/cpu_dot.c", f"{KERNELS}/cpu_layer.c"]
HEADERS = [f"{KERNELS}/cpu_dot.h"]
# What kernels/cpu_dot.py source_digest() computes from the installed files: a library whose digest differs (an
# editable install whose C files changed since) is not loaded.
DIGEST = hashlib.sha256(b"\0".join(Path(name).read_bytes() for name in SOURCES + HEADERS)).hexdigest()[:16]
# The same flags as the run-time build (kernels/cpu_dot.py FLAGS) but the target: no fused multiply-adds the source
# did not write, so every variant rounds as the reference does.
COMMON = ["-O3", "-ffp-contract=off", "-fopenmp", "-std=c11"]
# name -> target flags and macros; kernels/cpu_dot.py VARIANTS says what each needs of the CPU. The generic build is
# the scalar C (DFA_SCALAR) on every machine: the reference each vector build is tested against.
VARIANTS = {"generic": ([], [("DFA_SCALAR", "1")])}
MACHINE = platform.machine().lower()
if MACHINE in ("x86_64", "amd64"):
    # AVX2, FMA, F16C, BMI2: every x86 since 2013-15
    VARIANTS["x86_64_v3"] = (["-march=x86-64-v3", "-mtune=generic"], [])
    # AVX-512 (F, BW, CD, DQ, VL) with VNNI: Intel since Ice Lake / Cascade Lake, AMD since Zen 4
    VARIANTS["x86_64_v4_vnni"] = (["-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"], [])
elif MACHINE in ("aarch64", "arm64"):
    VARIANTS["aarch64_neon"] = ([], [])  # NEON is part of the aarch64 baseline (armv8-a)


class BuildKernels(build_ext):
    """Each variant compiles the same sources with other flags: each gets a temporary folder of its own, or the
    second would link the first one's object files (same names, and newer than the sources)."""

    def build_extension(self, ext: Extension) -> None:
        shared = self.build_temp
        self.build_temp = f"{shared}/{ext.name}"
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = shared


setup(
    ext_modules=[
        Extension(f"dflash_agent.kernels._cpu_dot_{name}", SOURCES, depends=HEADERS,
                  define_macros=[("DFA_SOURCE_DIGEST", f'"{DIGEST}"'), *macros],
                  extra_compile_args=[*COMMON, *flags], extra_link_args=["-fopenmp"], libraries=["m"], optional=True)
        for name, (flags, macros) in VARIANTS.items()
    ],
    cmdclass={"build_ext": BuildKernels},
)
