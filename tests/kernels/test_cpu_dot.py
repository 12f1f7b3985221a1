"""kernels.cpu_dot: built once per machine into the cache, refused cleanly without a compiler, and its
activation quantization and matmuls against plain float32 arithmetic (tests/engine/test_cpu_packed.py checks
them on every GGUF format)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from dflash_agent.kernels import cpu_dot

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")


@pytest.fixture
def lib(tmp_path):
    built = cpu_dot.load(tmp_path)
    assert built is not None
    return built


def test_built_once_into_the_cache_and_reused(tmp_path):
    first = cpu_dot.load(tmp_path)
    assert first is not None and first.path.parent == tmp_path / "kernels"
    stamp = first.path.stat().st_mtime_ns
    second = cpu_dot.load(tmp_path)
    assert second is not None and second.path == first.path and second.path.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.path.name]  # no temporary left behind


@pytest.mark.parametrize("compiler", ["/nonexistent/cc", "false"])
def test_no_working_compiler_falls_back_with_a_warning(tmp_path, monkeypatch, caplog, compiler):
    monkeypatch.setenv("CC", compiler)
    with caplog.at_level(logging.WARNING, logger="dflash_agent.kernels.cpu_dot"):
        assert cpu_dot.load(tmp_path) is None
    assert "torch's kernels" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_disabled_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_dot.DISABLE_ENV, "0")
    assert cpu_dot.load(tmp_path) is None


def test_activations_are_int16_per_block_of_32(lib):
    x = torch.randn(3, 128) * torch.logspace(-3, 2, 128)
    acts = lib.quantize(x)
    assert acts.xq.dtype == torch.int16 and acts.xs.shape == (3, 4) and acts.xsum.shape == (3, 4)
    back = (acts.xq.float().view(3, 4, 32) * acts.xs[..., None]).view(3, 128)
    assert float((back - x).abs().max()) <= float(acts.xs.max()) / 2 + 1e-9  # within half a step of its block
    torch.testing.assert_close(acts.xsum, acts.xq.float().view(3, 4, 32).sum(-1) * acts.xs)
    with pytest.raises(ValueError, match="multiple of 32"):
        lib.quantize(torch.randn(2, 40))


@pytest.mark.parametrize("group", [32, 16])
def test_s8_matmul_is_the_float_matmul(lib, group):
    n, k = 37, 256
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    d, m = torch.rand(n, k // group), (torch.randn(n, k // group) if group == 32 else None)
    w = (q.float().view(n, -1, group) * d[..., None] + (0 if m is None else m[..., None])).view(n, k)
    x = torch.randn(7, k)  # a tile of 4 rows and 3 left over
    y = lib.matmul_s8(lib.quantize(x), q, d, m, group)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-3 * float((x @ w.T).abs().max()))


def test_u4_matmul_is_the_float_matmul(lib):
    n, k = 37, 256
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    pairs = q.view(n, k // 32, 2, 16)
    packed = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    d, m = torch.rand(n, k // 32), torch.randn(n, k // 32)
    w = (q.float().view(n, -1, 32) * d[..., None] + m[..., None]).view(n, k)
    x = torch.randn(7, k)
    y = lib.matmul_u4(lib.quantize(x), packed, d, m)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-3 * float((x @ w.T).abs().max()))


def test_linear_is_quantize_then_matmul_in_one_call(lib):
    n, k = 37, 256
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    d, m = torch.rand(n, k // 32), torch.randn(n, k // 32)
    x = torch.randn(6, k)
    assert torch.equal(lib.linear(x, q, d, m, 32), lib.matmul_s8(lib.quantize(x), q, d, m, 32))
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    assert torch.equal(lib.linear(x, packed, d, m, 32), lib.matmul_u4(lib.quantize(x), packed, d, m))
