"""The CPU kernels' C code on every ISA it has vector code for, against its scalar reference, as ggml tests each arch
against its generic code: cpu_kernels_check.c calls every entry point on fixed inputs, built for AVX2, for aarch64's
NEON (cross-compiled, run under qemu-user: Debian's gcc-aarch64-linux-gnu and qemu-user, which .ci/run installs)
and with -DDFA_SCALAR; and the AVX2 and scalar builds under AddressSanitizer + UndefinedBehaviorSanitizer. Each run
checks within its build what must hold exactly (a row alone equals the row in a block; NaN and inf propagate; bad
slots are refused untouched); here each vector build's results are held to its own machine's scalar ones."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dflash_agent.kernels.cpu import build as builder
from dflash_agent.kernels.cpu import cpu_dot

CHECK = Path(__file__).with_name("cpu_kernels_check.c")
WARNINGS = ("-Wall", "-Werror")
# -O1 (after the builder's -O3): the sanitized -O3 build of every inlined kernel variant is several times slower to
# compile
SANITIZE = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
CC = shutil.which("gcc") or shutil.which("cc")
CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
X86 = cpu_dot.supports("x86_64_v3")
AVX512 = cpu_dot.supports("x86_64_v4_vnni")
# the install's target flags (setup.py): the code checked here is the code users run
AVX2, V4, SCALAR = (builder.TARGETS[name] for name in ("x86_64_v3", "x86_64_v4_vnni", "generic"))
# integer results and single roundings, or (the int8 GEMM) the same operations in the same order: the same bits
EXACT = ("quantize.", "dequantize.", "argmax", "gemm_i8.")


def read_records(path: Path) -> dict[str, np.ndarray]:
    data, records, at = path.read_bytes(), {}, 0
    while at < len(data):
        name = data[at:at + 32].rstrip(b"\0").decode()
        (count,) = np.frombuffer(data[at + 32:at + 40], np.int64)
        records[name] = np.frombuffer(data[at + 40:at + 40 + 4 * int(count)], np.float32)
        at += 40 + 4 * int(count)
    return records


def build(tmp: Path, name: str, cc: str, *flags: str) -> Path:
    return builder.compile_kernels(tmp / name, [*WARNINGS, *flags], cc=[cc], program=[CHECK])


def run(exe: Path, *launcher: str, env: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    results = exe.with_suffix(".bin")
    done = subprocess.run([*launcher, str(exe), str(results)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0 and "FAIL" not in done.stdout, done.stdout + done.stderr
    assert "runtime error" not in done.stderr, done.stderr  # UBSan's report
    return read_records(results)


def assert_matches_scalar(vector: dict[str, np.ndarray], scalar: dict[str, np.ndarray]) -> None:
    assert vector.keys() == scalar.keys()
    for name, expected in scalar.items():
        if name == "simd":
            continue
        got = vector[name]
        if name.startswith(EXACT):
            np.testing.assert_array_equal(got, expected, err_msg=name)
        else:  # another summation order: float rounding of the row's size
            scale = float(np.abs(expected).max())
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale, err_msg=name)


@pytest.mark.skipif(CC is None or not X86, reason="needs gcc and an x86-64-v3 CPU")
def test_avx2_matches_the_scalar_code(tmp_path):
    vector = run(build(tmp_path, "avx2", CC, *AVX2))
    scalar = run(build(tmp_path, "scalar", CC, *SCALAR))
    assert vector["simd"][0] == 2 and scalar["simd"][0] == 0
    assert_matches_scalar(vector, scalar)


@pytest.mark.skipif(CC is None or not AVX512, reason="needs gcc and a CPU with AVX-512 and VNNI")
def test_avx512_gives_the_avx2_bits(tmp_path):
    """The AVX-512 build fuses the AVX2 code's integer dots, takes more rows per tile and (Q4_K) two groups at a
    time: the same integers and the same float operations per row, so the same bits. So do both with Q4_K's
    activations shuffled as they are read (-DDFA_Q4_ORDER=0), the path taken where no memory is left to reorder
    them first."""
    avx2 = run(build(tmp_path, "avx2", CC, *AVX2))
    for name, flags in (("avx512", V4), ("avx512-unordered", [*V4, "-DDFA_Q4_ORDER=0"]),
                        ("avx2-unordered", [*AVX2, "-DDFA_Q4_ORDER=0"])):
        other = run(build(tmp_path, name, CC, *flags))
        assert other["simd"][0] == (3 if "avx512" in name else 2)
        assert other.keys() == avx2.keys()
        for record, expected in avx2.items():
            if record != "simd":
                np.testing.assert_array_equal(other[record], expected, err_msg=f"{name} {record}")


@pytest.mark.skipif(CROSS is None or QEMU is None,
                    reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu "
                           "qemu-user)")
def test_neon_matches_the_scalar_code_under_qemu(tmp_path):
    # static, so qemu-user needs no aarch64 root file system
    neon = run(build(tmp_path, "neon", CROSS, *builder.TARGETS["aarch64_neon"], "-static"), QEMU)
    scalar = run(build(tmp_path, "scalar", CROSS, *SCALAR, "-static"), QEMU)
    assert neon["simd"][0] == 1 and scalar["simd"][0] == 0
    assert_matches_scalar(neon, scalar)


@pytest.mark.skipif(CC is None, reason="needs gcc")
@pytest.mark.parametrize("isa", ["x86-64-v4", "x86-64-v3", "scalar"])
def test_the_kernels_are_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path, isa):
    if isa != "scalar" and not (AVX512 if isa == "x86-64-v4" else X86):
        pytest.skip(f"this CPU runs no {isa} code")
    flags = {"scalar": SCALAR, "x86-64-v4": V4, "x86-64-v3": AVX2}[isa]
    probe = subprocess.run([CC, *SANITIZE, "-x", "c", "-", "-o", str(tmp_path / "probe")], input="int main(void){}",
                           capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"{CC} has no sanitizer runtimes: {probe.stderr.strip()[:200]}")
    run(build(tmp_path, isa, CC, *flags, *SANITIZE),
        env={"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1", "UBSAN_OPTIONS": "print_stacktrace=1"})
