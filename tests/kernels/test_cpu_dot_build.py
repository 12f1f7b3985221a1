"""The CPU kernels as users get them: built at install in ISA variants (setup.py), the best one the CPU runs picked
at load after an ABI and source check, torch's kernels where only scalar C would run, and a run-time build that a
damaged, shared or read-only cache cannot break."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_agent.kernels import cpu_dot

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")
LOGGER = "dflash_agent.kernels.cpu_dot"
VECTOR = cpu_dot.supports("x86_64_v3")
BEST = next((variant for variant in cpu_dot.MACHINES if cpu_dot.supports(variant)), None)  # what auto loads


@pytest.fixture(autouse=True)
def auto_mode(monkeypatch):
    monkeypatch.delenv(cpu_dot.DISABLE_ENV, raising=False)


def test_the_install_built_every_variant_and_auto_loads_the_best_without_compiling(tmp_path, monkeypatch):
    assert cpu_dot.prebuilt("generic") is not None, "pip install -e . builds the kernels (setup.py)"
    monkeypatch.setenv("CC", "/nonexistent/cc")  # no compiler is needed at run time
    lib = cpu_dot.load(tmp_path)
    if VECTOR:
        assert lib is not None and lib.path == cpu_dot.prebuilt(BEST)
        assert lib.simd == ("avx512" if BEST == "x86_64_v4_vnni" else "avx2")
    else:
        assert lib is None
    assert not (tmp_path / "kernels").exists()


def test_a_cpu_without_a_vector_variant_gets_torchs_kernels_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_dot, "cpu_flags", lambda: frozenset({"sse2", "sse4_2"}))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert cpu_dot.load(tmp_path) is None
    assert "no vector build of the CPU kernels for this CPU" in caplog.text and "torch's kernels" in caplog.text
    assert not (tmp_path / "kernels").exists()  # nor did it compile a scalar build


def test_variants_need_what_they_use():
    assert cpu_dot.supports("generic", frozenset())
    assert not cpu_dot.supports("x86_64_v3", frozenset({"avx", "avx2", "fma"}))  # no BMI2, F16C, ...
    # an aarch64 CPU as /proc/cpuinfo lists it ("Features"); each vector variant only on its own machine
    arm = frozenset({"fp", "asimd", "evtstrm", "aes", "crc32", "atomics", "asimddp"})
    assert cpu_dot.supports("aarch64_neon", arm, machine="aarch64")
    assert not cpu_dot.supports("aarch64_neon", arm, machine="x86_64")
    assert not cpu_dot.supports("x86_64_v3", cpu_dot.VARIANTS["x86_64_v3"], machine="aarch64")
    # AVX-512 without VNNI (Skylake-X) runs the v3 build
    skylake_x = cpu_dot.VARIANTS["x86_64_v3"] | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert not cpu_dot.supports("x86_64_v4_vnni", skylake_x, machine="x86_64")
    assert cpu_dot.supports("x86_64_v4_vnni", skylake_x | {"avx512_vnni"}, machine="x86_64")
    if VECTOR:
        assert cpu_dot.supports("x86_64_v3", cpu_dot.VARIANTS["x86_64_v3"])


@pytest.mark.skipif(not VECTOR, reason="this CPU runs no vector variant")
def test_every_build_agrees_vector_ones_bit_for_bit(tmp_path, monkeypatch):
    """The installed x86-64-v3 build, and the AVX-512 one where the CPU runs it, give the bits of the build for this
    machine (-march=native); the generic build (scalar C, another summation order) agrees to float rounding: ggml
    tests each arch against its generic."""
    libs = {}
    vector = [variant for variant in ("x86_64_v3", "x86_64_v4_vnni") if cpu_dot.supports(variant)]
    for mode in (*vector, "native", "generic"):
        monkeypatch.setenv(cpu_dot.DISABLE_ENV, mode)
        libs[mode] = cpu_dot.load(tmp_path)
        assert libs[mode] is not None, mode
    assert libs["generic"].simd == "scalar" and libs["native"].path.parent == tmp_path / "kernels"
    gen = torch.Generator().manual_seed(7)
    # (bits, group, offsets m, offset, scales): float32, float16 or K-quant super-block headers
    for bits, group, with_m, offset, scales in ((4, 32, True, 0, "f32"), (4, 32, False, 8, "f16"),
                                                (4, 32, False, 0, "k"), (5, 32, False, 16, "f16"),
                                                (5, 32, True, 0, "f32"), (5, 32, False, 0, "k"), (8, 32, True, 0, "f32"),
                                                (8, 32, False, 0, "f16"), (8, 16, False, 0, "f32")):
        n, k = 67, 512
        values = torch.randint(-128, 128, (n, k), generator=gen) if bits == 8 else \
            torch.randint(0, 1 << bits, (n, k), generator=gen)
        m = torch.randn(n, k // group, generator=gen) if with_m else None
        d = torch.rand(n, k // group, generator=gen)
        if scales == "k":  # random headers: float16 d and dmin small, 6-bit scales and mins anything
            d = torch.randint(0, 256, (n, k // 256, 16), generator=gen, dtype=torch.uint8)
            d[:, :, 1] &= 0x13
            d[:, :, 3] &= 0x13
            d = d.reshape(n, -1)
        w = cpu_dot.IntMatrix.pack(values, d.half() if scales == "f16" else d, m, bits, group, offset)
        for rows in (1, 4, 9, 19):
            x = torch.randn(rows, k, generator=gen)
            y = {mode: lib.matmul(lib.quantize(x), w) for mode, lib in libs.items()}
            for variant in vector:
                assert torch.equal(y[variant], y["native"]), (variant, bits, group, scales, rows)
            torch.testing.assert_close(y["generic"], y["native"], rtol=1e-5, atol=1e-5 * float(y["native"].abs().max()))


def test_a_library_from_other_sources_is_refused(monkeypatch, caplog):
    path = cpu_dot.prebuilt("generic")
    assert path is not None and cpu_dot.open_library(path) is not None
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monkeypatch.setattr(cpu_dot, "source_digest", lambda: "0123456789abcdef")
        assert cpu_dot.open_library(path) is None  # an editable install whose C files changed since
        assert "older than their sources" in caplog.text and "pip install -e ." in caplog.text
        monkeypatch.undo()
        monkeypatch.setattr(cpu_dot, "ABI_VERSION", cpu_dot.ABI_VERSION + 1)
        assert cpu_dot.open_library(path) is None
        assert "built from other sources" in caplog.text
    not_a_library = path.parent / "__init__.py"
    assert cpu_dot.open_library(not_a_library) is None


def test_a_damaged_cached_build_is_rebuilt(tmp_path, caplog):
    path = cpu_dot.build(tmp_path)
    assert path is not None
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # what a crash before the data reached the disk would leave
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert cpu_dot.build(tmp_path) == path
    assert "damaged" in caplog.text
    assert path.read_bytes() == whole and cpu_dot.open_library(path) is not None


def test_a_cache_that_cannot_be_written_never_breaks_startup(tmp_path, monkeypatch, caplog):
    good = cpu_dot.build(tmp_path / "good")
    assert good is not None

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert cpu_dot.build(tmp_path / "good") == good  # a read-only cache holding a good build serves
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert cpu_dot.build(tmp_path / "empty") is None
    assert "Read-only file system" in caplog.text and "torch's kernels" in caplog.text
    monkeypatch.undo()
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert cpu_dot.build(a_file) is None  # a cache path that is not a folder


def test_a_compiler_command_of_several_words(tmp_path, monkeypatch):
    compiler = shutil.which("cc") or shutil.which("gcc")
    monkeypatch.setenv("CC", f"env {compiler}")  # as `ccache gcc` is written
    path = cpu_dot.build(tmp_path)
    assert path is not None and cpu_dot.open_library(path) is not None


def test_a_killed_builds_leftovers_are_removed(tmp_path):
    leftover = tmp_path / "kernels" / "building-abc123"
    leftover.mkdir(parents=True)
    (leftover / "cpu_dot-x.so").write_bytes(b"half")
    assert cpu_dot.build(tmp_path) is not None
    assert not leftover.exists()


def test_builders_started_together_compile_once(tmp_path):
    script = ("import logging, sys; from pathlib import Path; logging.basicConfig(level=logging.INFO); "
              "from dflash_agent.kernels import cpu_dot; print(cpu_dot.build(Path(sys.argv[1])))")
    env = {**os.environ, "PYTHONPATH": str(Path(cpu_dot.__file__).parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    results = [proc.communicate(timeout=300) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [err for _, err in results]
    assert len({out.strip() for out, _ in results}) == 1 and results[0][0].strip().endswith(".so")
    assert sum(err.count("compiling the CPU matmul kernels") for _, err in results) == 1
