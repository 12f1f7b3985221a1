"""The CPU kernels as users get them: built at install in ISA variants (setup.py, through kernels/cpu/build.py),
the best one the CPU runs picked at load after an ABI and source check, and torch's kernels where only scalar C
would run or no build is installed."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from dflash_agent.kernels.cpu import build, cpu_dot

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")
LOGGER = "dflash_agent.kernels.cpu.cpu_dot"
VECTOR = cpu_dot.supports("x86_64_v3")
BEST = next((variant for variant in cpu_dot.MACHINES if cpu_dot.supports(variant)), None)  # what auto loads


@pytest.fixture(autouse=True)
def auto_mode(monkeypatch):
    monkeypatch.delenv(cpu_dot.DISABLE_ENV, raising=False)


def test_the_install_built_every_variant_and_auto_loads_the_best_without_compiling(monkeypatch):
    assert cpu_dot.prebuilt("generic") is not None, "pip install -e . builds the kernels (setup.py)"
    monkeypatch.setenv("CC", "/nonexistent/cc")  # no compiler is needed at run time
    lib = cpu_dot.load()
    if VECTOR:
        assert lib is not None and lib.path == cpu_dot.prebuilt(BEST)
        assert lib.simd == ("avx512" if BEST == "x86_64_v4_vnni" else "avx2")
    else:
        assert lib is None


def test_a_cpu_without_a_vector_variant_gets_torchs_kernels_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(cpu_dot, "cpu_flags", lambda: frozenset({"sse2", "sse4_2"}))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert cpu_dot.load() is None
    assert "no vector build of the CPU kernels for this CPU" in caplog.text and "torch's kernels" in caplog.text


def test_without_its_installed_builds_a_cpu_gets_torchs_kernels_and_says_so(monkeypatch, caplog):
    """A source tree never installed: no build at run time, a warning that says how to get one."""
    monkeypatch.setattr(cpu_dot, "prebuilt", lambda variant: None)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert cpu_dot.load() is None
    if VECTOR:
        assert "pip install -e ." in caplog.text and "torch's kernels" in caplog.text
    monkeypatch.setenv(cpu_dot.DISABLE_ENV, "native")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert cpu_dot.load() is None
    assert "an install with DFLASH_AGENT_CPU_DOT=native builds it" in caplog.text


def test_an_install_builds_the_variants_of_its_machine_and_native_when_asked():
    assert build.variants("x86_64", "") == ["generic", "x86_64_v4_vnni", "x86_64_v3"]
    assert build.variants("AMD64", "auto") == ["generic", "x86_64_v4_vnni", "x86_64_v3"]
    assert build.variants("aarch64", "native") == ["generic", "aarch64_neon", "native"]
    assert build.variants("riscv64", "") == ["generic"]
    assert set(build.TARGETS) == set(cpu_dot.VARIANTS) and set(build.MACHINES) < set(cpu_dot.VARIANTS)


def test_the_builder_makes_a_library_the_loader_takes(tmp_path):
    """What setup.py runs for each variant: here the generic one, into a folder of its own."""
    lib = cpu_dot.open_library(build.compile_kernels(tmp_path / "_cpu_dot_generic.so", build.TARGETS["generic"]))
    assert lib is not None and lib.simd == "scalar"


@pytest.mark.parametrize("compiler", ["/nonexistent/cc", "false"])
def test_a_compiler_that_fails_or_is_missing_is_a_build_error(tmp_path, compiler):
    with pytest.raises(build.BuildError, match=compiler):
        build.compile_kernels(tmp_path / "lib.so", (), cc=[compiler])
    assert not list(tmp_path.iterdir())


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
def test_every_build_agrees_vector_ones_bit_for_bit(monkeypatch):
    """The installed x86-64-v4 VNNI build, where the CPU runs it, gives the bits of the x86-64-v3 one; the generic
    build (scalar C, another summation order) agrees to float rounding: ggml tests each arch against its generic."""
    libs = {}
    vector = [variant for variant in ("x86_64_v3", "x86_64_v4_vnni") if cpu_dot.supports(variant)]
    for mode in (*vector, "generic"):
        monkeypatch.setenv(cpu_dot.DISABLE_ENV, mode)
        libs[mode] = cpu_dot.load()
        assert libs[mode] is not None, mode
    assert libs["generic"].simd == "scalar" and libs["x86_64_v3"].simd == "avx2"
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
            reference = y["x86_64_v3"]
            for variant in vector:
                assert torch.equal(y[variant], reference), (variant, bits, group, scales, rows)
            torch.testing.assert_close(y["generic"], reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))


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
