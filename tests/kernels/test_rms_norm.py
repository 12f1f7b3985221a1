"""The fused RMSNorm (+ RoPE) kernel against engine.model's PyTorch norm and rotation, on the GPU or interpreted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_agent.engine.model.gemma import rope_tables, rotate

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def reference(x, weight, eps, offset, cos=None, sin=None):
    """The PyTorch path in float64: the norm, then the rotation."""
    w = None if weight is None else offset + weight.double()
    y = F.rms_norm(x.double(), (x.shape[-1],), w, eps)
    return y if cos is None else rotate(y, cos.double(), sin.double())


def check(y, ref, dtype, ulps):
    assert y.dtype == dtype and y.shape == ref.shape
    tol = ulps * UNIT_ROUNDOFF[dtype] * float(ref.abs().max()) + 1e-6
    err = float((y.double() - ref).abs().max())
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


def run(kernels, *args):
    moved = [a.to(kernels.device) if isinstance(a, torch.Tensor) else a for a in args]
    return kernels.load("triton.rms_norm").rms_norm(*moved).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [96, 640])  # not a power of two: masked tails
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norm(kernels, dtype, d, offset) -> None:
    x = (torch.randn(3, 5, d) * 4).to(dtype)
    weight = torch.randn(d).to(dtype)
    check(run(kernels, x, weight, 1e-6, offset), reference(x, weight, 1e-6, offset), dtype, 2)
    check(run(kernels, x, None, 1e-6, offset), reference(x, None, 1e-6, offset), dtype, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_then_rope(kernels, dtype) -> None:
    T, heads, d = 4, 3, 64
    x = torch.randn(2, T, heads, d).to(dtype)  # a leading batch dim: rows wrap around T
    weight = torch.randn(d).to(dtype)
    inv_freq = 1.0 / (10_000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_tables(inv_freq, torch.tensor([0, 7, 300, 4095]), dtype)
    # float32 math rounded once: within a few units of the float64 reference (the tables are in x's dtype)
    check(run(kernels, x, weight, 1e-6, 0.0, cos, sin), reference(x, weight, 1e-6, 0.0, cos, sin), dtype, 4)


def test_module_takes_the_kernel_and_agrees_with_pytorch(kernels, monkeypatch) -> None:
    """engine.model.RMSNorm sends rows to the kernel where Triton runs, and both paths give the same values."""
    from dflash_agent.engine.model import gemma as model

    norm = model.RMSNorm(32, 1e-6, 0.0)
    norm.weight = torch.randn(32)
    x = torch.randn(2, 4, 32)
    cos, sin = rope_tables(torch.rand(16), torch.arange(2), torch.float32)
    module = kernels.load("triton.rms_norm")
    calls = []
    kernel = module.rms_norm
    monkeypatch.setattr(module, "rms_norm", lambda *a: calls.append(1) or kernel(*a))
    fused = norm.to(kernels.device)(x.to(kernels.device), cos.to(kernels.device), sin.to(kernels.device)).cpu()
    assert calls == [1]
    monkeypatch.setattr(model, "triton_runs", lambda t: False)
    plain = norm.cpu()(x, cos, sin)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_bad_shapes(kernels) -> None:
    rms_norm = kernels.load("triton.rms_norm").rms_norm
    with pytest.raises(ValueError, match="weight of shape"):
        rms_norm(torch.randn(2, 8), torch.randn(4), 1e-6, 0.0)
    with pytest.raises(ValueError, match="RoPE tables"):
        rms_norm(torch.randn(3, 2, 8), None, 1e-6, 0.0, torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="a residual"):
        rms_norm(torch.randn(2, 8), None, 1e-6, 0.0, residual=torch.randn(2, 4))
    with pytest.raises(ValueError, match="a scale goes with a residual"):
        rms_norm(torch.randn(2, 8), None, 1e-6, 0.0, scale=torch.ones(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_residual_and_scale_round_as_pytorch_does(kernels, dtype) -> None:
    """A decoder layer's `x + norm(attn)` (then `* layer_scalar`) in the norm's launch: bit for bit PyTorch's add and
    multiply of the kernel's own norm, each rounded to the dtype."""
    if dtype == torch.bfloat16 and kernels.device.type != "cuda":
        pytest.skip("Triton's interpreter converts to bfloat16 by truncating")
    x, residual = (torch.randn(3, 640) * 4).to(dtype), (torch.randn(3, 640) * 30).to(dtype)
    weight, scale = torch.randn(640).to(dtype), torch.tensor([0.37]).to(dtype)
    norm = run(kernels, x, weight, 1e-6, 1.0)
    assert torch.equal(run(kernels, x, weight, 1e-6, 1.0, None, None, residual), residual + norm)
    assert torch.equal(run(kernels, x, weight, 1e-6, 1.0, None, None, residual, scale), (residual + norm) * scale)
