"""RMSNorm, optionally followed by RoPE or by a residual add (and a scale), in one Triton kernel: the CUDA path of
engine.model.gemma.RMSNorm.

In PyTorch a norm is five kernels (the weight and the input to float32, the norm, the offset, the cast back) and
the rotation of q / k five more. A decode step of Gemma 4 31B runs 420 norms: on an H200 those small kernels
took about a third of the step once the GEMVs were fast. Here each row is one program: the float32 sum of
squares, the weight as (offset + w), and for q / k the NeoX rotation (dim i pairs with i + d/2) with the step's
cos / sin tables, rounded to the output dtype once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_support import COMPILE_OPTIONS


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, res_ptr, scale_ptr, y_ptr, D, H, T, eps, offset,
                     HAS_WEIGHT: tl.constexpr, ROPE: tl.constexpr, RESIDUAL: tl.constexpr, SCALE: tl.constexpr,
                     BLOCK: tl.constexpr):
    # one row of D values; with ROPE the rows are [..., T, H] and row r rotates by position (r // H) % T; with
    # RESIDUAL the rounded norm is added to the residual's row, then with SCALE the rounded sum times the scale,
    # each rounded to y's dtype as PyTorch's separate add and multiply round them
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * r
    if HAS_WEIGHT:
        y = y * (offset + tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32))
    if ROPE:
        half = D // 2
        partner = tl.where(cols < half, cols + half, cols - half)
        xp = tl.load(x_ptr + row * D + partner, mask=ok, other=0.0).to(tl.float32) * r
        if HAS_WEIGHT:
            xp = xp * (offset + tl.load(w_ptr + partner, mask=ok, other=0.0).to(tl.float32))
        t = (row // H) % T
        cos = tl.load(cos_ptr + t * D + cols, mask=ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * D + cols, mask=ok, other=0.0).to(tl.float32)
        y = y * cos + tl.where(cols < half, -xp, xp) * sin
    if RESIDUAL:
        residual = tl.load(res_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + residual
        if SCALE:
            y = y.to(y_ptr.dtype.element_ty).to(tl.float32) * tl.load(scale_ptr).to(tl.float32)
    tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
             cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [..., D] over its last dim, times (offset + weight) when there is a weight, in x's dtype; with
    cos / sin [T, D], x is [..., T, heads, D] and each row is then rotated by its position's angles. residual (x's
    shape and dtype): the result is residual + the norm, and with scale (one value) that sum times scale: a decoder
    layer's residual stream in the norm's launch, rounded as PyTorch's add and multiply would round it."""
    d = x.shape[-1]
    if weight is not None and weight.shape != (d,):
        raise ValueError(f"a norm over {d} values got a weight of shape {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"a residual {tuple(residual.shape)} {residual.dtype} for rows {tuple(x.shape)} {x.dtype}")
    if scale is not None and (residual is None or scale.numel() != 1):
        raise ValueError("a scale goes with a residual, and is one value")
    heads = steps = 1
    if cos is not None:
        assert sin is not None
        if x.dim() < 3 or cos.shape != (x.shape[-3], d) or sin.shape != cos.shape or d % 2:
            raise ValueError(f"RoPE tables {tuple(cos.shape)} do not fit rows of {tuple(x.shape)}")
        steps, heads = x.shape[-3], x.shape[-2]
        cos, sin = cos.contiguous(), sin.contiguous()
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // d
    if rows == 0:
        return y
    block = triton.next_power_of_2(d)
    warps = 1 if block <= 512 else 4 if block <= 2048 else 8
    _rms_norm_kernel[(rows,)](
        x, x if weight is None else weight, x if cos is None else cos, x if sin is None else sin,
        x if residual is None else residual.contiguous(), x if scale is None else scale, y,
        d, heads, steps, eps, offset, HAS_WEIGHT=weight is not None, ROPE=cos is not None,
        RESIDUAL=residual is not None, SCALE=scale is not None, BLOCK=block, num_warps=warps, **COMPILE_OPTIONS,
    )
    return y
