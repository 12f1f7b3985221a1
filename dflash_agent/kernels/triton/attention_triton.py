"""The Triton kernels behind kernels.attention.cache_attention: flash-decoding over a KV cache masked by positions.

Programs split the keys into chunks (decode and verification steps; a sliding ring's are shorter, its keys being
few whatever the context: kernels.dispatch), keep an online softmax over their chunk for a tile of (query token,
query head) rows of one KV head, and a second kernel combines the chunks by their log-sum-exp. int8 caches are
scaled as they are read. Tile sizes: `_tiles`, checked by `dflash-agent bench --kernels` (compiled for sm_86 / 89 /
90 / 120, no GPU needed).

Several requests' decode rows (one query token each, over its own cache) share one launch of each kernel
(`rows_attention_launch`): a program serves one row as the launch of that row alone would (the same tile, keys
and chunks), reading its cache at element offsets from the first row's (kernels.attention.cache_offsets), so the
result does not depend on which rows share the launch; `write_rows_launch` writes their new keys and values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..attention import NO_WINDOW, OFFSET_ALIGN, KeysFromValues, blocked_scales
from ..dispatch import KEYS_PER_CHUNK, RING_KEYS_PER_CHUNK, SPLIT_ROWS
from .triton_support import Launch, dot_dtype


@dataclass(frozen=True)
class Tiles:
    rows: int  # (query token, query head) rows per program, at most
    keys: int  # keys per loop iteration
    warps: int
    stages: int  # software pipelining depth of the K / V loads


def _tiles(d: int, quantized: bool, values_only: bool = False) -> Tiles:
    """Tiles by head_dim and cache type, sized from compiles for sm_86 / 89 / 90 / 120 (`dflash-agent bench
    --kernels`): no spills anywhere, shared memory within 99 KB (RTX cards), and 2-stage pipelined K / V loads.

    The [rows, d] float32 accumulator, the query rows and a [keys, d] K and V tile per stage all scale with d,
    so rows and keys shrink as d grows: at d = 512 a 16-row program with 16 keys (bf16) keeps ~100 registers and
    48 KB of shared memory, two programs per SM. int8 caches are widened to float32 and scaled before the dot,
    which costs registers rather than shared memory, so they take 32-key tiles (fewer, larger loads). The
    drafter's d = 128 takes 64 x 64 tiles on 8 warps: on 4 warps it spilled on sm_120. A cache that keeps V alone
    rebuilds each key tile from its values, in halves of the head: at d = 512 16-key tiles with one stage of loads
    (~235 registers; two stages spilled).
    """
    if values_only and d > 256:
        return Tiles(16, 16, 8, 1)
    if d <= 128:
        return Tiles(64, 64, 8, 2)
    if d <= 256:
        return Tiles(32, 32, 8, 2)
    return Tiles(16, 32 if quantized else 16, 8, 2)


@triton.jit
def _rope_cos_sin(position, inv_freq):
    """cos and sin of the float32 angle position x inv_freq (as the reference and transformers round it), reduced to
    [-pi, pi] exactly enough (2 pi in two parts, fma) for polynomials to x^16 / x^15: within 2e-6 of the true values
    at any position up to 2^18. libdevice's cosf / sinf keep a local-memory path for large arguments, which the
    kernels' no-spill budget rules out."""
    angle = position * inv_freq
    turns = tl.floor(angle * 0.15915494309189535 + 0.5)
    # 2 pi = 6.28125 (8 bits: turns x it is exact) + 0.0019353071795864769
    r = tl.fma(-turns, 6.28125, angle)
    r = tl.fma(-turns, 0.0019353071795864769, r)
    r2 = r * r
    cos = 1.0 + r2 * (-1 / 2 + r2 * (1 / 24 + r2 * (-1 / 720 + r2 * (1 / 40320 + r2 * (-1 / 3628800 + r2 * (
        1 / 479001600 + r2 * (-1 / 87178291200 + r2 * (1 / 20922789888000))))))))
    sin = r * (1.0 + r2 * (-1 / 6 + r2 * (1 / 120 + r2 * (-1 / 5040 + r2 * (1 / 362880 + r2 * (-1 / 39916800 + r2 * (
        1 / 6227020800 + r2 * (-1 / 1307674368000))))))))
    return cos, sin


# T, S and the chunk vary from step to step: not specializing on them keeps one compiled kernel per tile shape.
@triton.jit(do_not_specialize=["T", "S", "chunk"])
def _cache_attention_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, qpos_ptr, kpos_ptr, off_ptr, out_ptr, part_ptr, lse_ptr, kw_ptr, kf_ptr,
    T, S, chunk, window, scale_log2,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_kss, stride_ksh, stride_vss, stride_vsh, stride_kpos, stride_off, stride_ot, stride_oh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_KPOS: tl.constexpr, QUANT: tl.constexpr, SCALE_BLOCK: tl.constexpr, SPLIT: tl.constexpr,
    ROWS: tl.constexpr, ALIGN: tl.constexpr, DOT: tl.constexpr, K_FROM_V: tl.constexpr,
):
    pid_r = tl.program_id(0)
    split = tl.program_id(1)
    kvh = tl.program_id(2)
    if ROWS:
        # T rows of one query token each, row `seq` over its own cache: its programs are those of a launch of that
        # row alone, with the row's q / out / positions at index seq and its cache at its element offsets
        tiles = (GROUP + BLOCK_R - 1) // BLOCK_R
        seq = pid_r // tiles
        r = (pid_r % tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < GROUP
        t = seq + r // GROUP
        offsets = off_ptr + seq * stride_off
        k_ptr += tl.multiple_of(tl.load(offsets), ALIGN)
        v_ptr += tl.multiple_of(tl.load(offsets + 1), ALIGN)
        if QUANT:
            ks_ptr += tl.multiple_of(tl.load(offsets + 2), ALIGN)
            vs_ptr += tl.multiple_of(tl.load(offsets + 3), ALIGN)
        kpos_ptr += seq * stride_kpos
    else:
        # row r of this KV head's tile = (query token r // GROUP, query head kvh * GROUP + r % GROUP)
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        t = r // GROUP
        r_ok = t < T
    h = kvh * GROUP + r % GROUP
    dim = tl.arange(0, D)
    qp = tl.load(qpos_ptr + t, mask=r_ok, other=-1).to(tl.int64)
    q_rows = q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh
    if K_FROM_V:
        # the cache keeps V alone and K = rope(V * w) is rebuilt tile by tile: in halves of the head (dim i pairs with
        # i + D / 2), so the RoPE angles and the pairs take [keys, D / 2] tiles, not [keys, D]
        half = tl.arange(0, D // 2)
        q = tl.load(q_rows + half[None, :], mask=r_ok[:, None], other=0.0)
        q_hi = tl.load(q_rows + D // 2 + half[None, :], mask=r_ok[:, None], other=0.0)
        w, w_hi = tl.load(kw_ptr + half), tl.load(kw_ptr + D // 2 + half)
        inv_freq = tl.load(kf_ptr + half)
        acc = tl.zeros((BLOCK_R, D // 2), tl.float32)
        acc_hi = tl.zeros((BLOCK_R, D // 2), tl.float32)
    else:
        q = tl.load(q_rows + dim[None, :], mask=r_ok[:, None], other=0.0)
        acc = tl.zeros((BLOCK_R, D), tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, S)
    if not HAS_KPOS:
        # slot = position: nothing past the last query can be visible, so a preallocated cache costs
        # only the keys written so far
        hi = tl.minimum(hi, (tl.max(qp) + 1).to(tl.int32))
    m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    for s0 in range(lo, hi, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < hi
        if HAS_KPOS:
            kp = tl.load(kpos_ptr + s, mask=s_ok, other=-1).to(tl.int64)
        else:
            kp = tl.where(s_ok, s, -1).to(tl.int64)
        if K_FROM_V:
            v_rows = v_ptr + s[:, None] * stride_vs + kvh * stride_vh
            vt = tl.load(v_rows + half[None, :], mask=s_ok[:, None], other=0)
            vt_hi = tl.load(v_rows + D // 2 + half[None, :], mask=s_ok[:, None], other=0)
            cos, sin = _rope_cos_sin(kp.to(tl.float32)[:, None], inv_freq[None, :])
            x, x_hi = vt.to(tl.float32) * w[None, :], vt_hi.to(tl.float32) * w_hi[None, :]
            kt, kt_hi = x * cos - x_hi * sin, x_hi * cos + x * sin
            scores = (tl.dot(q.to(DOT), tl.trans(kt.to(DOT)), input_precision="ieee")
                      + tl.dot(q_hi.to(DOT), tl.trans(kt_hi.to(DOT)), input_precision="ieee")) * scale_log2
        else:
            kt = tl.load(k_ptr + s[:, None] * stride_ks + kvh * stride_kh + dim[None, :], mask=s_ok[:, None],
                         other=0)
            vt = tl.load(v_ptr + s[:, None] * stride_vs + kvh * stride_vh + dim[None, :], mask=s_ok[:, None],
                         other=0)
            if QUANT:
                # one scale per SCALE_BLOCK values (contiguous per head: [blocks]), loaded once and broadcast over
                # its block, which keeps [keys, blocks] scales live rather than [keys, D]
                blocks = tl.arange(0, D // SCALE_BLOCK)
                ks = tl.load(ks_ptr + s[:, None] * stride_kss + kvh * stride_ksh + blocks[None, :],
                             mask=s_ok[:, None], other=0.0)
                vs = tl.load(vs_ptr + s[:, None] * stride_vss + kvh * stride_vsh + blocks[None, :],
                             mask=s_ok[:, None], other=0.0)
                kt = tl.reshape(tl.reshape(kt.to(tl.float32), (BLOCK_S, D // SCALE_BLOCK, SCALE_BLOCK))
                                * ks.to(tl.float32)[:, :, None], (BLOCK_S, D))
                vt = tl.reshape(tl.reshape(vt.to(tl.float32), (BLOCK_S, D // SCALE_BLOCK, SCALE_BLOCK))
                                * vs.to(tl.float32)[:, :, None], (BLOCK_S, D))
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
        if K_FROM_V:
            acc_hi = acc_hi * alpha[:, None] + tl.dot(p.to(DOT), vt_hi.to(DOT), input_precision="ieee")
        m_i = m_new
    norm = tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        # slot = position: a chunk past a row's position holds nothing it sees, and the combination skips it
        live = r_ok
        if not HAS_KPOS:
            live = r_ok & (lo <= qp)
        # int64: splits x rows x heads x head_dim passes 2^31 at a million keys
        at = (split * T + t).to(tl.int64) * (GROUP * tl.num_programs(2)) + h
        if K_FROM_V:
            tl.store(part_ptr + at[:, None] * D + half[None, :], acc / norm, mask=live[:, None])
            tl.store(part_ptr + at[:, None] * D + D // 2 + half[None, :], acc_hi / norm, mask=live[:, None])
        else:
            tl.store(part_ptr + at[:, None] * D + dim[None, :], acc / norm, mask=live[:, None])
        seen = l_i > 0  # a chunk with no visible key weighs 0 in the combination
        tl.store(lse_ptr + at, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")), mask=live)
    else:
        out_rows = out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh
        if K_FROM_V:
            tl.store(out_rows + half[None, :], (acc / norm).to(out_ptr.dtype.element_ty), mask=r_ok[:, None])
            tl.store(out_rows + D // 2 + half[None, :], (acc_hi / norm).to(out_ptr.dtype.element_ty),
                     mask=r_ok[:, None])
        else:
            tl.store(out_rows + dim[None, :], (acc / norm).to(out_ptr.dtype.element_ty), mask=r_ok[:, None])


@triton.jit(do_not_specialize=["T", "splits", "chunk"])
def _combine_chunks_kernel(
    part_ptr, lse_ptr, qpos_ptr, out_ptr, T, splits, chunk, stride_ot, stride_oh,
    H: tl.constexpr, D: tl.constexpr, HAS_KPOS: tl.constexpr,
):
    """Each (row, head)'s output from its chunks: their outputs weighted by 2^(lse - max lse), in chunk order; a
    row that saw no key gets zeros, as the one-pass kernel gives it."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    n = splits
    if not HAS_KPOS:  # chunks past the row's position were not written (the attention kernel's `live`)
        n = tl.minimum(splits, (tl.load(qpos_ptr + t) // chunk + 1).to(tl.int32))
    # chunk 0 holds every row's first keys, so it is always written
    row = t.to(tl.int64) * H + h  # int64: chunks x rows x heads x head_dim passes 2^31 at a million keys
    step = T.to(tl.int64) * H  # from one chunk's (row, head) to the next's
    first = tl.load(lse_ptr + row)
    m = first
    for c in range(1, n):
        m = tl.maximum(m, tl.load(lse_ptr + c * step + row))
    m = tl.where(m == float("-inf"), 0.0, m)
    dim = tl.arange(0, D)
    first_out = tl.load(part_ptr + row * D + dim)
    total = tl.exp2(first - m)
    acc = total * first_out
    for c in range(1, n):
        weight = tl.exp2(tl.load(lse_ptr + c * step + row) - m)
        acc += weight * tl.load(part_ptr + (c * step + row) * D + dim)
        total += weight
    # one chunk: its output as the kernel wrote it, which is what its one-pass launch stores (no rounding of
    # exp2 or division can tell the two apart)
    o = tl.where(n == 1, first_out, acc / tl.where(total > 0, total, 1.0))
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dim, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _write_rows_kernel(k_new_ptr, v_new_ptr, k_ptr, v_ptr, slot_ptr, off_ptr, stride_nt, stride_nh,
                       stride_ks, stride_kh, stride_vs, stride_vh, stride_off, D: tl.constexpr, ALIGN: tl.constexpr):
    """Row t's new key and value of KV head h into slot slot_ptr[t] of row t's cache (at its offsets)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    dim = tl.arange(0, D)
    slot = tl.load(slot_ptr + t)
    k_dst = k_ptr + tl.multiple_of(tl.load(off_ptr + t * stride_off), ALIGN) + slot * stride_ks + h * stride_kh
    v_dst = v_ptr + tl.multiple_of(tl.load(off_ptr + t * stride_off + 1), ALIGN) + slot * stride_vs + h * stride_vh
    tl.store(k_dst + dim, tl.load(k_new_ptr + t * stride_nt + h * stride_nh + dim))
    tl.store(v_dst + dim, tl.load(v_new_ptr + t * stride_nt + h * stride_nh + dim))


def triton_cache_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor | None, window: int | None,
                           scale: float, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                           keys_from: KeysFromValues | None = None) -> Tensor:
    """kernels.attention.cache_attention_reference's contract, on the Triton kernels."""
    q = q.contiguous() if q.stride(-1) != 1 else q
    return cache_attention_launch(q, k, v, q_pos, k_pos, window, scale, k_scale, v_scale, keys_from).run()


@dataclass(frozen=True)
class AttentionLaunch:
    launch: Launch
    combine: Launch | None  # the chunks' combination into `out`, when the keys are split
    out: Tensor  # [T, H, d]

    def run(self) -> Tensor:
        self.launch()
        if self.combine is not None:
            self.combine()
        return self.out


def cache_attention_launch(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor | None, window: int | None,
                           scale: float, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                           keys_from: KeysFromValues | None = None) -> AttentionLaunch:
    """The launches (and the buffers they write) for q (contiguous in head_dim) over the cache; shared by
    `triton_cache_attention` and the compile report (meta tensors are enough for the latter)."""
    return _launches(q, k, v, q_pos, k_pos, window, scale, k_scale, v_scale, None, keys_from)


def rows_attention_launch(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor | None, window: int | None,
                          scale: float, offsets: Tensor, k_scale: Tensor | None = None,
                          v_scale: Tensor | None = None, keys_from: KeysFromValues | None = None) -> AttentionLaunch:
    """kernels.attention.rows_cache_attention's launches. Each row's output is what `cache_attention_launch` of that
    row alone over its cache gives, bit for bit: its programs are the same, chunks included, which follow the slots;
    a full layer's row alone may be passed its cache up to its position only (as an eager step passes it), since
    the combination reads the chunks up to the row's position and a single chunk's combination is exact."""
    return _launches(q, k, v, q_pos, k_pos, window, scale, k_scale, v_scale, offsets, keys_from)


def _launches(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor | None, window: int | None, scale: float,
              k_scale: Tensor | None, v_scale: Tensor | None, offsets: Tensor | None,
              keys_from: KeysFromValues | None) -> AttentionLaunch:
    T, H, d = q.shape
    S, kv_heads = k.shape[0], k.shape[1]
    group = H // kv_heads
    if H % kv_heads:
        raise ValueError(f"{H} query heads are not a multiple of {kv_heads} KV heads")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the KV cache must be contiguous in head_dim")
    rows_mode = offsets is not None
    if rows_mode and k_pos is not None and (k_pos.dim() != 2 or k_pos.stride(-1) != 1):
        raise ValueError("several rows' key positions come as [rows, slots], contiguous in slots")
    quantized = k_scale is not None
    if keys_from is not None and (k.data_ptr() != v.data_ptr() or d % 2 or quantized):
        raise ValueError("keys rebuilt from values take a cache in the model's dtype that keeps V alone, of an even "
                         "head size")
    tiles = _tiles(d, quantized, keys_from is not None)
    rows = group if rows_mode else T * group  # the rows of one program's query tokens
    block_r = min(tiles.rows, max(16, triton.next_power_of_2(rows)))
    # a slot -> position map is a sliding ring's (fixed length: a window's keys); slot = position, a full cache's
    keys_per_chunk = RING_KEYS_PER_CHUNK if k_pos is not None else KEYS_PER_CHUNK
    splits = triton.cdiv(S, keys_per_chunk) if T <= SPLIT_ROWS or rows_mode else 1
    chunk = keys_per_chunk if splits > 1 else S
    out = torch.empty_like(q)
    if splits > 1:
        partial = torch.empty(splits, T, H, d, device=q.device, dtype=torch.float32)
        lse = torch.empty(splits, T, H, device=q.device, dtype=torch.float32)
    else:
        partial, lse = None, None
    if quantized:
        k_scale, v_scale = blocked_scales(k_scale), blocked_scales(v_scale)
        if k_scale.stride(-1) != 1 or v_scale.stride(-1) != 1 or d % k_scale.shape[-1]:
            raise ValueError(f"int8 cache scales must be contiguous blocks dividing head_dim {d}")
    row_programs = T * triton.cdiv(group, block_r) if rows_mode else triton.cdiv(rows, block_r)
    grid = (row_programs, splits, kv_heads)
    args = (
        q, k, v,
        k_scale if quantized else k, v_scale if quantized else v,
        q_pos, k_pos if k_pos is not None else q_pos, offsets if rows_mode else q_pos,
        out, out if partial is None else partial, out if lse is None else lse,  # unused without SPLIT
        k if keys_from is None else keys_from.weight, k if keys_from is None else keys_from.inv_freq,
        T, S, chunk, window or NO_WINDOW, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_scale.stride(0) if quantized else 0, k_scale.stride(1) if quantized else 0,
        v_scale.stride(0) if quantized else 0, v_scale.stride(1) if quantized else 0,
        k_pos.stride(0) if rows_mode and k_pos is not None else 0, offsets.stride(0) if rows_mode else 0,
        out.stride(0), out.stride(1),
    )
    meta = dict(
        GROUP=group, D=d, BLOCK_R=block_r, BLOCK_S=tiles.keys,
        HAS_KPOS=k_pos is not None, QUANT=quantized, SCALE_BLOCK=d // k_scale.shape[-1] if quantized else d,
        SPLIT=splits > 1, ROWS=rows_mode, ALIGN=OFFSET_ALIGN, DOT=dot_dtype(q.dtype), K_FROM_V=keys_from is not None,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    combine = None
    if partial is not None:
        combine = Launch(_combine_chunks_kernel, (T, H), (partial, lse, q_pos, out, T, splits, chunk,
                                                          out.stride(0), out.stride(1)),
                         dict(H=H, D=d, HAS_KPOS=k_pos is not None, num_warps=4))
    return AttentionLaunch(Launch(_cache_attention_kernel, grid, args, meta), combine, out)


def write_rows_launch(k_new: Tensor, v_new: Tensor, k: Tensor, v: Tensor, slots: Tensor, offsets: Tensor) -> Launch:
    """kernels.attention.write_rows' launch (k_new / v_new contiguous in head_dim)."""
    T, kv_heads, d = k_new.shape
    if k_new.stride() != v_new.stride() or k_new.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("new keys and values must share strides, and every tensor be contiguous in head_dim")
    return Launch(_write_rows_kernel, (T, kv_heads),
                  (k_new, v_new, k, v, slots, offsets, k_new.stride(0), k_new.stride(1),
                   k.stride(0), k.stride(1), v.stride(0), v.stride(1), offsets.stride(0)),
                  dict(D=d, ALIGN=OFFSET_ALIGN, num_warps=1))
