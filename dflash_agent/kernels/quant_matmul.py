"""y = x @ W^T straight from packed GGUF blocks, in Triton: the CUDA path for GGUF weights.

W is [N, K] in ggml's layout: each row is K / block_size blocks of type_size bytes, and no block
straddles two rows. The reference is engine.quant.dequantize (bit-exact against gguf-py) followed by
F.linear; every weight this kernel dequantizes has exactly the reference's float32 value.

One kernel, three launch shapes (`launch_shape`):
- decode, 1 row: BLOCK_M = 1, a GEMV whose products are plain float32 FMAs (tensor cores need 16 rows);
- verification, <= 16 rows: one 16-row tile, tl.dot;
- prefill, many rows: 64 x 64 tiles, tl.dot.
Decode and verification read every weight byte once per call, which is what makes them run at the
memory-bandwidth roofline rather than at the tensor cores' rate.

The packed fields of a block are read in "planes" of bytes that are contiguous in memory (for Q4_0 the
low and the high nibbles of the same 16 bytes). A dot product does not care about element order, so each
plane is multiplied with the matching strided slice of x instead of re-interleaving weights in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .triton_support import dot_dtype

_T = GGMLQuantizationType

# Kernel-side format codes (constexpr), one per supported GGML type.
_CODES = {_T.Q4_0: 0, _T.Q5_0: 1, _T.Q8_0: 2, _T.Q4_K: 3, _T.Q5_K: 4, _T.Q6_K: 5}
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_CODES)

# Blocks per K step: eight 32-wide blocks (256 values) for the simple formats, one super-block for K-quants.
_MAX_BLOCKS_PER_STEP = 8
DECODE_ROWS = 1
VERIFY_ROWS = 16


@dataclass(frozen=True)
class LaunchShape:
    block_m: int
    block_n: int
    num_warps: int


def launch_shape(m: int) -> LaunchShape:
    """Tile sizes by number of activation rows. Chosen from first principles (unmeasured: no GPU here)."""
    if m <= DECODE_ROWS:
        return LaunchShape(1, 16, 4)
    if m <= VERIFY_ROWS:
        return LaunchShape(16, 32, 4)
    return LaunchShape(64, 64, 8)


@triton.jit
def _accumulate(acc, x, w, ONE_ROW: tl.constexpr, DOT: tl.constexpr):
    # acc [BM, BN] float32 += x [BM, BK] @ w[BN, BK]^T; w holds the exact float32 dequantized values
    if ONE_ROW:
        acc += tl.sum(x.to(tl.float32) * w, axis=1)[None, :]
    else:
        acc = tl.dot(x.to(DOT), tl.trans(w.to(DOT)), acc, input_precision="ieee")
    return acc


@triton.jit
def _load_x(x_rows, m_ok, k):
    # x_rows [BM] pointers to row starts, k [BK] column offsets -> [BM, BK]; rows past M read as 0
    return tl.load(x_rows[:, None] + k[None, :], mask=m_ok[:, None], other=0.0)


@triton.jit
def _half(h_rows, offset):
    # an fp16 field at `offset` halves into each row (all fields sit at even byte offsets) -> float32
    return tl.load(h_rows[:, None] + offset).to(tl.float32)


@triton.jit
def _q4_0_step(acc, w_rows, h_rows, x_rows, m_ok, blk, NB: tl.constexpr, BN: tl.constexpr,
               ONE_ROW: tl.constexpr, DOT: tl.constexpr):
    # 18-byte blocks: fp16 d, then 16 bytes whose low nibbles are values 0..15 and high nibbles 16..31
    i = tl.arange(0, 16)
    q = tl.load(w_rows[:, None, None] + (blk * 18 + 2)[None, :, None] + i[None, None, :])
    d = _half(h_rows, blk[None, :] * 9)[:, :, None]
    k = tl.reshape(blk[:, None] * 32 + i[None, :], (NB * 16,))
    lo = tl.reshape(((q & 15).to(tl.float32) - 8.0) * d, (BN, NB * 16))
    acc = _accumulate(acc, _load_x(x_rows, m_ok, k), lo, ONE_ROW, DOT)
    hi = tl.reshape(((q >> 4).to(tl.float32) - 8.0) * d, (BN, NB * 16))
    return _accumulate(acc, _load_x(x_rows, m_ok, k + 16), hi, ONE_ROW, DOT)


@triton.jit
def _q5_0_step(acc, w_rows, h_rows, x_rows, m_ok, blk, NB: tl.constexpr, BN: tl.constexpr,
               ONE_ROW: tl.constexpr, DOT: tl.constexpr):
    # 22-byte blocks: fp16 d, 4 bytes whose bit j is the 5th bit of value j, then Q4_0's 16 nibble bytes
    i = tl.arange(0, 16)
    base = w_rows[:, None, None] + (blk * 22)[None, :, None]
    q = tl.load(base + 6 + i[None, None, :])
    qh_lo = tl.load(base + 2 + (i // 8)[None, None, :])
    qh_hi = tl.load(base + 4 + (i // 8)[None, None, :])
    bit = (i % 8)[None, None, :]
    d = _half(h_rows, blk[None, :] * 11)[:, :, None]
    k = tl.reshape(blk[:, None] * 32 + i[None, :], (NB * 16,))
    q_lo = (q & 15) | (((qh_lo >> bit) & 1) << 4)
    lo = tl.reshape((q_lo.to(tl.float32) - 16.0) * d, (BN, NB * 16))
    acc = _accumulate(acc, _load_x(x_rows, m_ok, k), lo, ONE_ROW, DOT)
    q_hi = (q >> 4) | (((qh_hi >> bit) & 1) << 4)
    hi = tl.reshape((q_hi.to(tl.float32) - 16.0) * d, (BN, NB * 16))
    return _accumulate(acc, _load_x(x_rows, m_ok, k + 16), hi, ONE_ROW, DOT)


@triton.jit
def _q8_0_step(acc, w_rows, h_rows, x_rows, m_ok, blk, NB: tl.constexpr, BN: tl.constexpr,
               ONE_ROW: tl.constexpr, DOT: tl.constexpr):
    # 34-byte blocks: fp16 d, then 32 int8 values
    i = tl.arange(0, 32)
    q = tl.load(w_rows[:, None, None] + (blk * 34 + 2)[None, :, None] + i[None, None, :])
    d = _half(h_rows, blk[None, :] * 17)[:, :, None]
    w = tl.reshape(q.to(tl.int8, bitcast=True).to(tl.float32) * d, (BN, NB * 32))
    k = tl.reshape(blk[:, None] * 32 + i[None, :], (NB * 32,))
    return _accumulate(acc, _load_x(x_rows, m_ok, k), w, ONE_ROW, DOT)


@triton.jit
def _k_scale_min(scales, s):
    # eight 6-bit (scale, min) pairs in 12 bytes (gguf-py's Q4_K.get_scale_min); scales [BN, NB] pointers,
    # s [S] sub-block indices -> ([BN, NB, S], [BN, NB, S]) as float32
    p = scales[:, :, None]
    low = (s < 4)[None, None, :]
    a = tl.load(p + s[None, None, :])
    b = tl.load(p + (s + 4)[None, None, :])
    c = tl.load(p + tl.where(s >= 4, s - 4, s)[None, None, :])
    sc = tl.where(low, a & 63, (b & 15) | ((c >> 2) & 48))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 2) & 48))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _k_affine(q, d, dmin, sc, mn):
    # Q4_K/Q5_K value: (d * sc) * q - dmin * mn; q [BN, NB, 4, 32], the rest [BN, NB(, 4)]
    scale = (d[:, :, None] * sc)[:, :, :, None]
    offset = (dmin[:, :, None] * mn)[:, :, :, None]
    return q.to(tl.float32) * scale - offset


@triton.jit
def _q45_k_step(acc, w_rows, h_rows, x_rows, m_ok, blk, NB: tl.constexpr, BN: tl.constexpr,
                FIVE_BITS: tl.constexpr, ONE_ROW: tl.constexpr, DOT: tl.constexpr):
    # Q4_K (144 bytes): fp16 d, fp16 dmin, 12 scale bytes, 128 nibble bytes. Sub-block s = 2g + h (g < 4)
    # holds values 32s..32s+31 in the h-th nibbles of bytes 32g..32g+31. Q5_K (176 bytes) adds 32 bytes
    # before the nibbles whose bit s is the 5th bit of value i of sub-block s.
    TS: tl.constexpr = 176 if FIVE_BITS else 144
    QS: tl.constexpr = 48 if FIVE_BITS else 16
    g = tl.arange(0, 4)
    i = tl.arange(0, 32)
    base = w_rows[:, None] + (blk * TS)[None, :]
    q = tl.load(base[:, :, None, None] + QS + (g * 32)[None, None, :, None] + i[None, None, None, :])
    d = _half(h_rows, blk[None, :] * (TS // 2))
    dmin = _half(h_rows, blk[None, :] * (TS // 2) + 1)
    k = tl.reshape(blk[:, None, None] * 256 + (g * 64)[None, :, None] + i[None, None, :], (NB * 128,))
    if FIVE_BITS:
        qh = tl.load(base[:, :, None] + 16 + i[None, None, :])[:, :, None, :]
    for h in tl.static_range(2):
        s = 2 * g + h
        sc, mn = _k_scale_min(base + 4, s)
        q_h = (q >> (4 * h)) & 15
        if FIVE_BITS:
            q_h = q_h | (((qh >> s[None, None, :, None]) & 1) << 4)
        w = tl.reshape(_k_affine(q_h, d, dmin, sc, mn), (BN, NB * 128))
        acc = _accumulate(acc, _load_x(x_rows, m_ok, k + 32 * h), w, ONE_ROW, DOT)
    return acc


@triton.jit
def _q6_k_step(acc, w_rows, h_rows, x_rows, m_ok, blk, NB: tl.constexpr, BN: tl.constexpr,
               ONE_ROW: tl.constexpr, DOT: tl.constexpr):
    # 210 bytes: 128 low-nibble bytes ql, 64 bytes of 2-bit highs qh, 16 int8 scales, fp16 d.
    # Value j = 128g + 64h + 32u + i (g, h, u < 2, i < 32): low = nibble h of ql[64g + 32u + i],
    # high = bits 2(2h + u) of qh[32g + i], scale = scales[j // 16]; value = d * scale * (q - 32).
    # c = 2g + u runs over the four 32-byte runs of ql; h picks the plane.
    c = tl.arange(0, 4)
    i = tl.arange(0, 32)
    g, u = c // 2, c % 2
    base = (w_rows[:, None] + (blk * 210)[None, :])[:, :, None, None]
    ql = tl.load(base + (c * 32)[None, None, :, None] + i[None, None, None, :])
    qh = tl.load(base + 128 + (g * 32)[None, None, :, None] + i[None, None, None, :])
    d = _half(h_rows, blk[None, :] * 105 + 104)[:, :, None, None]
    k = tl.reshape(blk[:, None, None] * 256 + (g * 128 + u * 32)[None, :, None] + i[None, None, :], (NB * 128,))
    for h in tl.static_range(2):
        scale_at = (g * 8 + u * 2 + h * 4)[None, None, :, None] + (i // 16)[None, None, None, :]
        sc = tl.load(base + 192 + scale_at).to(tl.int8, bitcast=True).to(tl.float32)
        shift = (h * 4 + u * 2)[None, None, :, None]
        q = ((ql >> (4 * h)) & 15) | (((qh >> shift) & 3) << 4)
        w = tl.reshape((q.to(tl.float32) - 32.0) * (d * sc), (BN, NB * 128))
        acc = _accumulate(acc, _load_x(x_rows, m_ok, k + 64 * h), w, ONE_ROW, DOT)
    return acc


@triton.jit
def _quant_matmul_kernel(
    x_ptr, w_ptr, h_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, row_bytes,
    FORMAT: tl.constexpr, BLOCK_VALUES: tl.constexpr, NB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    # Rows past N read row 0 (always in bounds) and are dropped at the store: no masks on weight loads.
    n_safe = tl.where(n_ok, n, 0).to(tl.int64)
    w_rows = w_ptr + n_safe * row_bytes
    h_rows = h_ptr + n_safe * (row_bytes // 2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    x_rows = x_ptr + m.to(tl.int64) * stride_xm
    ONE_ROW: tl.constexpr = BLOCK_M == 1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(K // (NB * BLOCK_VALUES)):
        blk = step * NB + tl.arange(0, NB)
        if FORMAT == 0:
            acc = _q4_0_step(acc, w_rows, h_rows, x_rows, m_ok, blk, NB, BLOCK_N, ONE_ROW, DOT)
        elif FORMAT == 1:
            acc = _q5_0_step(acc, w_rows, h_rows, x_rows, m_ok, blk, NB, BLOCK_N, ONE_ROW, DOT)
        elif FORMAT == 2:
            acc = _q8_0_step(acc, w_rows, h_rows, x_rows, m_ok, blk, NB, BLOCK_N, ONE_ROW, DOT)
        elif FORMAT == 3:
            acc = _q45_k_step(acc, w_rows, h_rows, x_rows, m_ok, blk, NB, BLOCK_N, False, ONE_ROW, DOT)
        elif FORMAT == 4:
            acc = _q45_k_step(acc, w_rows, h_rows, x_rows, m_ok, blk, NB, BLOCK_N, True, ONE_ROW, DOT)
        else:
            acc = _q6_k_step(acc, w_rows, h_rows, x_rows, m_ok, blk, NB, BLOCK_N, ONE_ROW, DOT)
    y = y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _blocks_per_step(qtype: GGMLQuantizationType, k: int) -> int:
    block, _ = GGML_QUANT_SIZES[qtype]
    if block == 256:
        return 1
    nb = _MAX_BLOCKS_PER_STEP
    while (k // block) % nb:
        nb //= 2
    return nb


def quant_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, out_features: int) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., out_features] in x's dtype, where `raw` holds W [out_features, K] as packed
    GGUF blocks (uint8, contiguous, on x's device)."""
    if qtype not in _CODES:
        supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=lambda t: t.value))
        raise ValueError(f"no packed matmul kernel for {qtype.name} (supported: {supported})")
    k = x.shape[-1]
    block, type_size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"{qtype.name} rows need a multiple of {block} values, got {k}")
    row_bytes = k // block * type_size
    if raw.dtype != torch.uint8 or raw.numel() != out_features * row_bytes or not raw.is_contiguous():
        raise ValueError(f"expected {out_features * row_bytes} contiguous uint8 bytes for a {qtype.name} "
                         f"[{out_features}, {k}] weight, got {raw.numel()} {raw.dtype}")
    if raw.device != x.device:
        raise ValueError(f"weight on {raw.device}, activations on {x.device}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, out_features, device=x.device, dtype=x.dtype)
    if m == 0:
        return y.reshape(*x.shape[:-1], out_features)
    shape = launch_shape(m)
    grid = (triton.cdiv(out_features, shape.block_n), triton.cdiv(m, shape.block_m))
    # The fp16 scales are read through a half view of the same bytes (every scale sits at an even offset).
    _quant_matmul_kernel[grid](
        x2, raw, raw.view(torch.float16), y,
        m, out_features, k, x2.stride(0), y.stride(0), row_bytes,
        FORMAT=_CODES[qtype], BLOCK_VALUES=block, NB=_blocks_per_step(qtype, k),
        BLOCK_M=shape.block_m, BLOCK_N=shape.block_n, DOT=dot_dtype(x.dtype),
        num_warps=shape.num_warps,
    )
    return y.reshape(*x.shape[:-1], out_features)
