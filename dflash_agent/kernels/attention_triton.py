"""The Triton kernel behind kernels.attention.cache_attention: flash-decoding over a KV cache masked by positions.

Programs split the keys into chunks (decode and verification steps), keep an online softmax over their
chunk for a tile of (query token, query head) rows of one KV head, and a short PyTorch reduction combines
the chunks by their log-sum-exp. int8 caches are scaled as they are read.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention import NO_WINDOW, blocked_scales
from .dispatch import KEYS_PER_CHUNK, SPLIT_ROWS
from .triton_support import dot_dtype


def _tiles(d: int) -> tuple[int, int, int]:
    """(rows per program, keys per iteration, warps) by head_dim; unmeasured choices (no GPU here) that keep
    a [rows, d] float32 accumulator and a [keys, d] K/V tile within one SM's registers and shared memory."""
    if d >= 512:
        return 32, 32, 8
    return 64, 64, 4


@triton.jit
def _cache_attention_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, qpos_ptr, kpos_ptr, out_ptr, part_ptr, lse_ptr,
    T, S, chunk, window, scale_log2,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_kss, stride_ksh, stride_vss, stride_vsh, stride_ot, stride_oh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_KPOS: tl.constexpr, QUANT: tl.constexpr, SCALE_BLOCK: tl.constexpr, SPLIT: tl.constexpr,
    DOT: tl.constexpr,
):
    pid_r = tl.program_id(0)
    split = tl.program_id(1)
    kvh = tl.program_id(2)
    # row r of this KV head's tile = (query token r // GROUP, query head kvh * GROUP + r % GROUP)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    t = r // GROUP
    h = kvh * GROUP + r % GROUP
    r_ok = t < T
    dim = tl.arange(0, D)
    qp = tl.load(qpos_ptr + t, mask=r_ok, other=-1).to(tl.int64)
    q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + dim[None, :],
                mask=r_ok[:, None], other=0.0)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, S)
    if not HAS_KPOS:
        # slot = position: nothing past the last query can be visible, so a preallocated cache costs
        # only the keys written so far
        hi = tl.minimum(hi, (tl.max(qp) + 1).to(tl.int32))
    m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, D), tl.float32)
    for s0 in range(lo, hi, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < hi
        if HAS_KPOS:
            kp = tl.load(kpos_ptr + s, mask=s_ok, other=-1).to(tl.int64)
        else:
            kp = tl.where(s_ok, s, -1).to(tl.int64)
        kt = tl.load(k_ptr + s[:, None] * stride_ks + kvh * stride_kh + dim[None, :], mask=s_ok[:, None], other=0)
        vt = tl.load(v_ptr + s[:, None] * stride_vs + kvh * stride_vh + dim[None, :], mask=s_ok[:, None], other=0)
        if QUANT:
            # each value's scale (scales are contiguous per head: [blocks]); repeated addresses hit the cache
            blk = (dim // SCALE_BLOCK)[None, :]
            ks = tl.load(ks_ptr + s[:, None] * stride_kss + kvh * stride_ksh + blk, mask=s_ok[:, None], other=0.0)
            vs = tl.load(vs_ptr + s[:, None] * stride_vss + kvh * stride_vsh + blk, mask=s_ok[:, None], other=0.0)
            kt = kt.to(tl.float32) * ks.to(tl.float32)
            vt = vt.to(tl.float32) * vs.to(tl.float32)
        scores = tl.dot(q.to(DOT), tl.trans(kt.to(DOT)), input_precision="ieee") * scale_log2
        visible = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # rows that have seen no visible key yet keep m = -inf; shift them by 0 so exp2 gives 0, not NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), vt.to(DOT), input_precision="ieee")
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        at = (split * T + t) * (GROUP * tl.num_programs(2)) + h
        tl.store(part_ptr + at[:, None] * D + dim[None, :], o, mask=r_ok[:, None])
        seen = l_i > 0  # a chunk with no visible key weighs 0 in the combination
        tl.store(lse_ptr + at, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")), mask=r_ok)
    else:
        tl.store(out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + dim[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])


def triton_cache_attention(q, k, v, q_pos, k_pos, window, scale, k_scale=None, v_scale=None) -> torch.Tensor:
    """kernels.attention.cache_attention_reference's contract, on the Triton kernel."""
    T, H, d = q.shape
    S, kv_heads = k.shape[0], k.shape[1]
    group = H // kv_heads
    if H % kv_heads:
        raise ValueError(f"{H} query heads are not a multiple of {kv_heads} KV heads")
    q = q.contiguous() if q.stride(-1) != 1 else q
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the KV cache must be contiguous in head_dim")
    block_r, block_s, warps = _tiles(d)
    rows = T * group
    block_r = min(block_r, max(16, triton.next_power_of_2(rows)))
    splits = triton.cdiv(S, KEYS_PER_CHUNK) if T <= SPLIT_ROWS else 1
    chunk = KEYS_PER_CHUNK if splits > 1 else S
    out = torch.empty_like(q)
    if splits > 1:
        partial = torch.empty(splits, T, H, d, device=q.device, dtype=torch.float32)
        lse = torch.empty(splits, T, H, device=q.device, dtype=torch.float32)
    else:
        partial, lse = out, out  # unused by the kernel (SPLIT=False)
    quantized = k_scale is not None
    if quantized:
        k_scale, v_scale = blocked_scales(k_scale), blocked_scales(v_scale)
        if k_scale.stride(-1) != 1 or v_scale.stride(-1) != 1 or d % k_scale.shape[-1]:
            raise ValueError(f"int8 cache scales must be contiguous blocks dividing head_dim {d}")
    grid = (triton.cdiv(rows, block_r), splits, kv_heads)
    _cache_attention_kernel[grid](
        q, k, v,
        k_scale if quantized else k, v_scale if quantized else v,
        q_pos, k_pos if k_pos is not None else q_pos,
        out, partial, lse,
        T, S, chunk, window or NO_WINDOW, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_scale.stride(0) if quantized else 0, k_scale.stride(1) if quantized else 0,
        v_scale.stride(0) if quantized else 0, v_scale.stride(1) if quantized else 0,
        out.stride(0), out.stride(1),
        GROUP=group, D=d, BLOCK_R=block_r, BLOCK_S=block_s,
        HAS_KPOS=k_pos is not None, QUANT=quantized, SCALE_BLOCK=d // k_scale.shape[-1] if quantized else d,
        SPLIT=splits > 1, DOT=dot_dtype(q.dtype),
        num_warps=warps,
    )
    if splits == 1:
        return out
    # log-sum-exp (base 2) weighted mean of the chunks; chunks a row could not see have weight 0
    weight = torch.exp2(lse - lse.amax(0, keepdim=True))
    combined = (partial * weight[..., None]).sum(0) / weight.sum(0)[..., None]
    return combined.to(q.dtype)
