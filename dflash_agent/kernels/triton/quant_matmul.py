"""y = x @ W^T straight from packed GGUF blocks, in Triton: the CUDA path for GGUF weights.

W is [N, K] in ggml's layout: each row is K / block_size blocks of type_size bytes, and no block
straddles two rows. The reference is engine.formats.quant.dequantize (bit-exact against gguf-py) followed by
F.linear. The tl.dot tiles multiply each weight's quant as the small integer it is (q - 8 for Q4_0; exact in bfloat16,
`_small_int`) and apply a block's (or sub-block's) scale to that block's float32 sums, so no weight is rounded to a
half type and a value costs an unpack, an OR and a subtraction, its multiply-add riding on the tensor cores. No
kernel fuses a multiply and an add by itself (triton_support.COMPILE_OPTIONS), so every compiled variant of a
kernel rounds alike.

One kernel, three launch shapes (`launch_shape`):
- decode and verification, <= 16 rows: of one sequence, or several sequences' steps (concurrent requests' decode
  rows and speculative blocks, `quant_matmul`'s `one_token_rows`): 16-row tiles, tl.dot, whose rows never mix. A
  decode row takes the same tile as a block of 16 (tensor cores need 16 rows; the other 15 are masked loads and
  idle tensor-core work), so a step costs its weight bytes whatever its rows, and a request decodes the same alone
  or beside others: one shape, one rounding, for every step of one to 16 rows of each sequence;
- prefill, many rows: 64 x 64 tiles, tl.dot;
- a MoE decode step's token-expert pairs, each one row against a matrix of its own (`grouped_quant_matmul`'s
  single): a GEMV of float32 multiply-adds, d * sum((q - 8) * x) a block.
K is split (below) by the output tiles of one row block alone, never by how many rows a launch has, for the same
reason: a row's sums must not depend on its neighbours (the lossless guarantee of batched decoding).
Decode and verification read every weight byte once per call, which is what makes them run at the
memory-bandwidth roofline rather than at the tensor cores' rate. They reach it only with enough loads in flight
and few instructions a weight: where the output tiles alone are too few programs to fill the GPU (a down
projection has 4x fewer rows than inputs), K is split between programs (`split_k`) that write float32 partial
sums, added after the kernel. (Compiled for sm_90, the old float32 GEMV spent 0.38 warp instructions a Q4_0 weight
and ran at about 1 TB/s on an H200, 8 rows costing nearly 8 times one; the 16-row tile spends 0.24.)

The packed fields of a block are read in "planes" of bytes that are contiguous in memory (for Q4_0 the
low and the high nibbles of the same 16 bytes). A dot product does not care about element order, so each
plane is multiplied with the matching strided slice of x instead of re-interleaving weights in registers.
K-quant super-blocks are taken one 32-value sub-block at a time (its bytes, its scale and min as per-row
scalars; Q6_K one 16-value run, one scale), so only a [BLOCK_N, 32] tile of dequantized weights is live: a whole
256-value super-block at once needed 255 registers for the Q6_K GEMV and spilled 824 bytes per thread in the verify
tile (sm_89).
`dflash-agent bench --kernels` compiles every launch the engine makes for sm_86 / 89 / 90 / 120 and checks
registers, spills and shared memory against launch_shape's budgets. On a GPU, kernels.triton.quant_tuning replaces
launch_shape's decode tile and split_k's split by the fastest it times for each large matrix (a `TileChoice`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..dispatch import PACKED_TYPES, VERIFY_ROWS
from .triton_support import Launch, dot_dtype

_T = GGMLQuantizationType

# Kernel-side format codes (constexpr), one per supported GGML type.
_CODES = {_T.Q4_0: 0, _T.Q5_0: 1, _T.Q8_0: 2, _T.Q4_K: 3, _T.Q5_K: 4, _T.Q6_K: 5}
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = PACKED_TYPES  # one list, importable without Triton
assert set(_CODES) == PACKED_TYPES, "every packed type needs a kernel format code"

@dataclass(frozen=True)
class LaunchShape:
    block_m: int  # rows a program computes
    block_n: int
    num_warps: int
    # 32-value blocks per K step of the simple formats (Q4_0, Q5_0, Q8_0), at most; K-quants step one
    # 256-value super-block at a time
    blocks: int
    gemv: bool = False  # one row's float32 multiply-adds (a MoE decode step's expert pairs), not tl.dot tiles
    num_stages: int = 3  # Triton's software pipelining: loads in flight a K step ahead, through shared memory


@dataclass(frozen=True)
class TileChoice:
    """One matrix's launch for every step of up to VERIFY_ROWS rows (a decode row, a verification block, several
    sequences' steps): the tile shape and the ways K splits, fixed per matrix, so every such step rounds alike.
    kernels.triton.quant_tuning chooses it by timing on the GPU that runs it; without one, `launch_shape` and
    `default_split`."""

    shape: LaunchShape
    split: int


# Programs a launch should have per SM before K is split: ~16 programs of 1-2 warps keep enough weight loads in
# flight on an H200 (docs/benchmarks.md: a Q4_0 GEMV split 4 ways)
PROGRAMS_PER_SM = 16
MAX_SPLIT = 8
RTX_SMS = 128  # an RTX 4090: the SM count the compile report plans for, having no device to ask


def launch_shape(m: int, qtype: GGMLQuantizationType) -> LaunchShape:
    """Tile sizes by number of activation rows, held to the compile budgets of `dflash-agent bench --kernels` on
    sm_86 / 89 / 90 / 120 (nothing spilled, shared memory within 80 KB).

    - decode and verification, <= VERIFY_ROWS rows (of one sequence, or several sequences' steps): 64 x 16 tiles (the
      weights' 64 rows by x's 16), 4 warps: a wgmma of one warpgroup on sm_90. A decode row costs what a verify block
      costs (the weight bytes, read once), which is what lets several requests' rows and speculation ride along;
    - prefill: 64 x 64 tiles, 8 warps; 128 values of a simple format per step, because the dequantized
      [BLOCK_N, values] tile beside the tensor-core operands is what spilled at 256.
    """
    if m <= VERIFY_ROWS:
        # two stages, not three: three spilled 8 bytes a thread of the Q6_K tile on sm_86 / sm_89, where two spilled
        # Q5_K's (8 bytes, 168 registers; three take 140 and spill nothing)
        return LaunchShape(VERIFY_ROWS, 64, 4, 4, num_stages=3 if qtype == _T.Q5_K else 2)
    # Q6_K's prefill tile spilled 32 bytes a thread on sm_120 at three stages once its loads took two bytes at a time
    return LaunchShape(64, 64, 8, 4, num_stages=2 if qtype == _T.Q6_K else 3)


def decode_shape(qtype: GGMLQuantizationType) -> LaunchShape:
    """The GEMV's shape: one row of x against a matrix of its own (a MoE decode step's token-expert pairs)."""
    if GGML_QUANT_SIZES[qtype][0] == 256:
        return LaunchShape(1, 16, 1, 1, gemv=True)
    return LaunchShape(1, 8, 1, 8, gemv=True)


def split_k(programs: int, steps: int, sms: int) -> int:
    """How many ways to split K's `steps` so `programs` output tiles fill `sms` SMs (a power of two that divides
    the steps, at most MAX_SPLIT)."""
    split = 1
    while programs * split < PROGRAMS_PER_SM * sms and split < MAX_SPLIT and steps % (2 * split) == 0:
        split *= 2
    return split


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def _load_xt(x_rows, m_ok, k, DOT: tl.constexpr):
    # x_rows [BM] pointers to row starts, k [BK] column offsets -> x^T [BK, BM] as tl.dot's operand type; rows past M
    # read as 0
    return tl.load(x_rows[None, :] + k[:, None], mask=m_ok[None, :], other=0.0).to(DOT)


@triton.jit
def _dot(w, xt, acc=None):
    # [BN, BK] @ [BK, BM] on the tensor cores, accumulated in float32; "ieee": float32 operands stay float32, not TF32
    return tl.dot(w, xt, acc, input_precision="ieee")


# A weight's small integer becomes a float through its bits, not a conversion instruction: those issue at a quarter
# of a float add's rate (16 a clock an SM on sm_86 to sm_90), and the GEMV is bound by instructions, not bytes
# (docs/benchmarks.md). Exact: 2^23 + q is a float32 whose mantissa is q.
@triton.jit
def _uint_f32(q, offset: tl.constexpr):
    # q - offset as float32 for integers 0 <= q < 2^23: OR q into 2^23's mantissa, subtract 2^23 + offset
    return (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _int8_f32(q):
    # a signed byte held as uint8, as float32: its bits offset by 128 are 0..255
    return _uint_f32(q ^ 0x80, 128)


@triton.jit
def _small_int(q, offset: tl.constexpr, DOT: tl.constexpr):
    # q - offset for a quant 0 <= q < 128, exactly, in tl.dot's operand type, by the same trick: 128 + q is a
    # bfloat16 (1024 + q a float16) whose mantissa is q. The tiles multiply these small integers and apply a block's
    # scale to its sum, so no weight is rounded to a half type and a value costs no multiply of its own.
    if DOT == tl.bfloat16:
        return (q.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - (128.0 + offset)
    elif DOT == tl.float16:
        return (q.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + offset)
    else:
        return _uint_f32(q, offset)


@triton.jit
def _half(h_rows, offset):
    # an fp16 field at `offset` halves into each row (all fields sit at even byte offsets) -> float32
    return tl.load(h_rows[:, None] + offset).to(tl.float32)


# The tl.dot tiles' steps take a simple format one block at a time: [BLOCK_N, 16 or 32] tiles straight from the
# loads. Taking NB blocks as one [BLOCK_N, NB, 16] load reshaped to [BLOCK_N, NB * 16] made Triton move the tile
# through shared memory, about half as fast on an H200 (docs/benchmarks.md). The weights are tl.dot's first operand
# (acc is [BLOCK_N, BLOCK_M], y transposed): its 64 rows and 4 warps make a warpgroup's wgmma on sm_90, whose other
# operand (x, 16 rows at most) is the small one; a block's scale multiplies the block's sums.
@triton.jit
def _q4_0_step(acc, w_rows, h_rows, x_rows, m_ok, step, NB: tl.constexpr, DOT: tl.constexpr):
    # 18-byte blocks: fp16 d, then 16 bytes whose low nibbles are values 0..15 and high nibbles 16..31
    i = tl.arange(0, 16)
    for j in tl.static_range(NB):
        b = step * NB + j
        q = tl.load(w_rows[:, None] + (b * 18 + 2) + i[None, :])
        d = tl.load(h_rows + b * 9).to(tl.float32)
        part = _dot(_small_int(q & 15, 8, DOT), _load_xt(x_rows, m_ok, b * 32 + i, DOT))
        part = _dot(_small_int(q >> 4, 8, DOT), _load_xt(x_rows, m_ok, b * 32 + 16 + i, DOT), part)
        acc = tl.fma(d[:, None], part, acc)
    return acc


@triton.jit
def _q5_0_step(acc, w_rows, h_rows, x_rows, m_ok, step, NB: tl.constexpr, DOT: tl.constexpr):
    # 22-byte blocks: fp16 d, 4 bytes whose bit j is the 5th bit of value j, then Q4_0's 16 nibble bytes
    i = tl.arange(0, 16)
    bit = (i % 8)[None, :]
    for j in tl.static_range(NB):
        b = step * NB + j
        base = w_rows[:, None] + b * 22
        q = tl.load(base + 6 + i[None, :])
        q_lo = (q & 15) | (((tl.load(base + 2 + (i // 8)[None, :]) >> bit) & 1) << 4)
        q_hi = (q >> 4) | (((tl.load(base + 4 + (i // 8)[None, :]) >> bit) & 1) << 4)
        d = tl.load(h_rows + b * 11).to(tl.float32)
        part = _dot(_small_int(q_lo, 16, DOT), _load_xt(x_rows, m_ok, b * 32 + i, DOT))
        part = _dot(_small_int(q_hi, 16, DOT), _load_xt(x_rows, m_ok, b * 32 + 16 + i, DOT), part)
        acc = tl.fma(d[:, None], part, acc)
    return acc


@triton.jit
def _q8_0_step(acc, w_rows, h_rows, x_rows, m_ok, step, NB: tl.constexpr, DOT: tl.constexpr):
    # 34-byte blocks: fp16 d, then 32 int8 values (a conversion: 256 values do not fit a bfloat16's mantissa)
    i = tl.arange(0, 32)
    for j in tl.static_range(NB):
        b = step * NB + j
        q = tl.load(w_rows[:, None] + (b * 34 + 2) + i[None, :])
        d = tl.load(h_rows + b * 17).to(tl.float32)
        part = _dot(q.to(tl.int8, bitcast=True).to(DOT), _load_xt(x_rows, m_ok, b * 32 + i, DOT))
        acc = tl.fma(d[:, None], part, acc)
    return acc


@triton.jit
def _k_scale_min(scales, S: tl.constexpr):
    # sub-block S's 6-bit (scale, min) of the eight packed in 12 bytes (gguf-py's Q4_K.get_scale_min);
    # scales [BN] pointers -> ([BN], [BN]) float32
    if S < 4:
        sc = tl.load(scales + S) & 63
        mn = tl.load(scales + S + 4) & 63
    else:
        b = tl.load(scales + S + 4)
        sc = (b & 15) | ((tl.load(scales + S - 4) >> 2) & 48)
        mn = (b >> 4) | ((tl.load(scales + S) >> 2) & 48)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q45_k_step(acc, w_rows, h_rows, x_ptr, m_ok, b, FIVE_BITS: tl.constexpr, GEMV: tl.constexpr, DOT: tl.constexpr):
    # Super-block b of each row. Q4_K (144 bytes): fp16 d, fp16 dmin, 12 scale bytes, 128 nibble bytes;
    # sub-block s = 2g + h (g < 4) holds values 32s..32s+31 in the h-th nibbles of bytes 32g..32g+31. Q5_K
    # (176 bytes) adds 32 bytes before the nibbles whose bit s is the 5th bit of value i of sub-block s.
    # One 32-value sub-block at a time: the fewest values live at once (registers, not spills). Either way a
    # sub-block adds d * sc * sum(q * x) - dmin * mn * sum(x): the GEMV (x_ptr one row of x, acc [BN]) by float32
    # multiply-adds, the tile (x_ptr its rows' pointers, acc [BN, BM]) by tl.dot.
    TS: tl.constexpr = 176 if FIVE_BITS else 144
    QS: tl.constexpr = 48 if FIVE_BITS else 16
    i = tl.arange(0, 32)
    base = w_rows + b * TS
    d = tl.load(h_rows + b * (TS // 2)).to(tl.float32)
    dmin = tl.load(h_rows + b * (TS // 2) + 1).to(tl.float32)
    if FIVE_BITS:
        qh = tl.load(base[:, None] + 16 + i[None, :])
    for g in tl.static_range(4):
        q = tl.load(base[:, None] + (QS + g * 32) + i[None, :])
        for h in tl.static_range(2):
            sc, mn = _k_scale_min(base + 4, 2 * g + h)
            q_h = (q >> (4 * h)) & 15
            if FIVE_BITS:
                q_h = q_h | (((qh >> (2 * g + h)) & 1) << 4)
            k = b * 256 + (g * 64 + h * 32) + i
            if GEMV:
                x = tl.load(x_ptr + k).to(tl.float32)
                acc += d * sc * tl.sum(_uint_f32(q_h, 0) * x[None, :], axis=1) - dmin * mn * tl.sum(x)
            else:
                # sum(x) by the tensor cores too (a reduction across lanes cost 36 instructions a sub-block on sm_90)
                xt = _load_xt(x_ptr, m_ok, k, DOT)
                acc = tl.fma((d * sc)[:, None], _dot(_small_int(q_h, 0, DOT), xt), acc)
                acc = tl.fma((-dmin * mn)[:, None], _dot(tl.full(q_h.shape, 1.0, DOT), xt), acc)
    return acc


@triton.jit
def _q6_k_step(acc, w_rows, h_rows, x_rows, m_ok, b, DOT: tl.constexpr):
    # 210 bytes: 128 low-nibble bytes ql, 64 bytes of 2-bit highs qh, 16 int8 scales, fp16 d.
    # Value j = 128g + 64h + 32u + 16s + i (g, h, u, s < 2, i < 16): low = nibble h of ql[64g + 32u + 16s + i],
    # high = bits 2(2h + u) of qh[32g + 16s + i], scale = scales[j // 16]; value = d * scale * (q - 32).
    # One 16-value run (one scale) at a time, each adding d * scale * sum((q - 32) * x) to the tile.
    i = tl.arange(0, 16)
    base = w_rows + b * 210
    d = tl.load(h_rows + b * 105 + 104).to(tl.float32)
    for g in range(2):  # a loop, not unrolled: unrolled, the tile spilled 8 bytes a thread on sm_86 / sm_89
        for s in tl.static_range(2):
            qh = tl.load(base[:, None] + (128 + g * 32 + s * 16) + i[None, :])
            for u in tl.static_range(2):
                ql = tl.load(base[:, None] + (g * 64 + u * 32 + s * 16) + i[None, :])
                for h in tl.static_range(2):
                    q = ((ql >> (4 * h)) & 15) | (((qh >> (h * 4 + u * 2)) & 3) << 4)
                    k = b * 256 + (g * 128 + h * 64 + u * 32 + s * 16) + i
                    scale = d * _int8_f32(tl.load(base + (192 + g * 8 + h * 4 + u * 2 + s)))
                    acc = tl.fma(scale[:, None], _dot(_small_int(q, 32, DOT), _load_xt(x_rows, m_ok, k, DOT)), acc)
    return acc


@triton.jit
def _q6_k_gemv(acc, w_rows, h_rows, x_ptr, b, BN: tl.constexpr):
    # _q6_k_step's super-block for one row (acc [BN]), a 32-value run at a time: d * scale * sum((q - 32) * x) for
    # each of its two 16-value halves
    i = tl.arange(0, 32)
    base = w_rows + b * 210
    d = tl.load(h_rows + b * 105 + 104).to(tl.float32)
    for g in tl.static_range(2):
        qh = tl.load(base[:, None] + (128 + g * 32) + i[None, :])
        for u in tl.static_range(2):
            ql = tl.load(base[:, None] + (g * 64 + u * 32) + i[None, :])
            for h in tl.static_range(2):
                at = base + (192 + g * 8 + h * 4 + u * 2)  # the run's two scales: values i < 16, i >= 16
                q = ((ql >> (4 * h)) & 15) | (((qh >> (h * 4 + u * 2)) & 3) << 4)
                x = tl.load(x_ptr + b * 256 + (g * 128 + h * 64 + u * 32) + i).to(tl.float32)
                qx = tl.sum(tl.reshape(_uint_f32(q, 32) * x[None, :], (BN, 2, 16)), axis=2)
                sc = _int8_f32(tl.load(at[:, None] + tl.arange(0, 2)[None, :]))
                acc += d * tl.sum(sc * qx, axis=1)
    return acc


# The simple formats' GEMV steps (one row of x at x_ptr, acc [BN] float32): each block's scale and offset multiply
# its sums, not its values.
@triton.jit
def _q4_0_gemv(acc, w_rows, h_rows, x_ptr, blk):
    i = tl.arange(0, 16)
    q = tl.load(w_rows[:, None, None] + (blk * 18 + 2)[None, :, None] + i[None, None, :])
    d = _half(h_rows, blk[None, :] * 9)
    x_lo = tl.load(x_ptr + blk[:, None] * 32 + i[None, :]).to(tl.float32)
    x_hi = tl.load(x_ptr + blk[:, None] * 32 + 16 + i[None, :]).to(tl.float32)
    qx = tl.sum(_uint_f32(q & 15, 8) * x_lo[None, :, :] + _uint_f32(q >> 4, 8) * x_hi[None, :, :], axis=2)
    return acc + tl.sum(d * qx, axis=1)


@triton.jit
def _q5_0_gemv(acc, w_rows, h_rows, x_ptr, blk):
    i = tl.arange(0, 16)
    base = w_rows[:, None, None] + (blk * 22)[None, :, None]
    q = tl.load(base + 6 + i[None, None, :])
    bit = (i % 8)[None, None, :]
    q_lo = (q & 15) | (((tl.load(base + 2 + (i // 8)[None, None, :]) >> bit) & 1) << 4)
    q_hi = (q >> 4) | (((tl.load(base + 4 + (i // 8)[None, None, :]) >> bit) & 1) << 4)
    d = _half(h_rows, blk[None, :] * 11)
    x_lo = tl.load(x_ptr + blk[:, None] * 32 + i[None, :]).to(tl.float32)
    x_hi = tl.load(x_ptr + blk[:, None] * 32 + 16 + i[None, :]).to(tl.float32)
    qx = tl.sum(_uint_f32(q_lo, 16) * x_lo[None, :, :] + _uint_f32(q_hi, 16) * x_hi[None, :, :], axis=2)
    return acc + tl.sum(d * qx, axis=1)


@triton.jit
def _q8_0_gemv(acc, w_rows, h_rows, x_ptr, blk):
    i = tl.arange(0, 32)
    w = _int8_f32(tl.load(w_rows[:, None, None] + (blk * 34 + 2)[None, :, None] + i[None, None, :]))
    d = _half(h_rows, blk[None, :] * 17)
    x = tl.load(x_ptr + blk[:, None] * 32 + i[None, :]).to(tl.float32)
    return acc + tl.sum(d * tl.sum(w * x[None, :, :], axis=2), axis=1)


# M varies with every prompt chunk and speculative block, STEPS with the split: not specializing on them (== 1,
# divisible by 16) keeps one compiled kernel per launch shape instead of a recompile for each.
@triton.jit(do_not_specialize=["M", "STEPS"])
def _quant_matmul_kernel(
    x_ptr, w_ptr, h_ptr, y_ptr, x_row_ptr, expert_ptr,
    M, N, stride_xm, stride_ym, stride_ys, row_bytes, STEPS, expert_bytes,
    FORMAT: tl.constexpr, NB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
    GROUPED: tl.constexpr, GEMV: tl.constexpr,
):
    # program (n, m, s) writes rows m, columns n of y's split s: the products over K steps s*STEPS..(s+1)*STEPS-1.
    # GROUPED (a MoE layer's experts, grouped_quant_matmul): w is a stack of matrices of expert_bytes each, tile m
    # multiplies with matrix expert_ptr[m], and y's row r is x's row x_row_ptr[r] (-1: a padding row, left 0).
    # GEMV (BLOCK_M = 1): one row of x, by float32 multiply-adds.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    # Rows past N read row 0 (always in bounds) and are dropped at the store: no masks on weight loads.
    n_safe = tl.where(n_ok, n, 0).to(tl.int64)
    # Every GGUF block is an even number of bytes, so every row and field starts 2-byte aligned; spelt as 2 x halves,
    # the compiler knows it and loads two bytes at a time where it loaded one (Q6_K's 210-byte rows, whose length no
    # power of two past 2 divides: its tile went from 0.433 to 0.395 warp instructions a weight on sm_90).
    if GROUPED:
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
        w_ptr += expert * (2 * (expert_bytes // 2))
        h_ptr += expert * (expert_bytes // 2)
    row_halves = row_bytes // 2
    w_rows = w_ptr + n_safe * (2 * row_halves)
    h_rows = h_ptr + n_safe * row_halves
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    x_row = m
    if GROUPED:
        x_row = tl.load(x_row_ptr + m, mask=m_ok, other=-1)
        m_ok = m_ok & (x_row >= 0)
        x_row = tl.where(m_ok, x_row, 0)
    first = pid_s * STEPS
    if GEMV:
        x_ptr += tl.sum(x_row).to(tl.int64) * stride_xm  # the one row
        gemv = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for step in range(first, first + STEPS):
            blk = step * NB + tl.arange(0, NB)
            if FORMAT == 0:
                gemv = _q4_0_gemv(gemv, w_rows, h_rows, x_ptr, blk)
            elif FORMAT == 1:
                gemv = _q5_0_gemv(gemv, w_rows, h_rows, x_ptr, blk)
            elif FORMAT == 2:
                gemv = _q8_0_gemv(gemv, w_rows, h_rows, x_ptr, blk)
            elif FORMAT == 3:
                gemv = _q45_k_step(gemv, w_rows, h_rows, x_ptr, m_ok, step, False, True, DOT)
            elif FORMAT == 4:
                gemv = _q45_k_step(gemv, w_rows, h_rows, x_ptr, m_ok, step, True, True, DOT)
            else:
                gemv = _q6_k_gemv(gemv, w_rows, h_rows, x_ptr, step, BLOCK_N)
        acc = gemv[:, None]
    else:
        x_rows = x_ptr + x_row.to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for step in range(first, first + STEPS):
            if FORMAT == 0:
                acc = _q4_0_step(acc, w_rows, h_rows, x_rows, m_ok, step, NB, DOT)
            elif FORMAT == 1:
                acc = _q5_0_step(acc, w_rows, h_rows, x_rows, m_ok, step, NB, DOT)
            elif FORMAT == 2:
                acc = _q8_0_step(acc, w_rows, h_rows, x_rows, m_ok, step, NB, DOT)
            elif FORMAT == 3:
                acc = _q45_k_step(acc, w_rows, h_rows, x_rows, m_ok, step, False, False, DOT)
            elif FORMAT == 4:
                acc = _q45_k_step(acc, w_rows, h_rows, x_rows, m_ok, step, True, False, DOT)
            else:
                acc = _q6_k_step(acc, w_rows, h_rows, x_rows, m_ok, step, DOT)
    y = y_ptr + pid_s.to(tl.int64) * stride_ys + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def k_steps(qtype: GGMLQuantizationType, k: int, shape: LaunchShape) -> int:
    """The K steps of a row of K values in `shape`'s launches."""
    return k // (_blocks_per_step(qtype, k, shape.blocks) * GGML_QUANT_SIZES[qtype][0])


def default_split(qtype: GGMLQuantizationType, n: int, k: int, shape: LaunchShape, sms: int) -> int:
    """How many ways K splits untuned: by one row block's tiles (a row's sums never depend on how many rows there
    are), where a decode or verification launch has too few programs for the SMs; never for prefill tiles."""
    if shape.block_m > VERIFY_ROWS:
        return 1
    return split_k(triton.cdiv(n, shape.block_n), k_steps(qtype, k, shape), sms)


def _blocks_per_step(qtype: GGMLQuantizationType, k: int, most: int) -> int:
    block, _ = GGML_QUANT_SIZES[qtype]
    if block == 256:
        return 1
    nb = most
    while (k // block) % nb:
        nb //= 2
    return nb


# Partial sums add in split order whatever the rows (torch's sum chooses its order by the tensor's sizes), and in one
# launch, not a sum and a copy: nearly every decode matmul splits, and each launch costs a step ~1 us. M varies with
# the step's rows: one compiled kernel for all of them.
@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(part_ptr, y_ptr, M, N, stride_ym, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    # y[m, n] = the float32 sum of partials[0..SPLIT-1, m, n] in that order, rounded once to y's dtype
    m = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < N
    at = part_ptr + m * N + n
    split_stride = M.to(tl.int64) * N
    total = tl.load(at, mask=n_ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        total += tl.load(at + s * split_stride, mask=n_ok, other=0.0)
    tl.store(y_ptr + m * stride_ym + n, total.to(y_ptr.dtype.element_ty), mask=n_ok)


SUM_BLOCK = 1024  # outputs a program of _sum_splits_kernel


@dataclass(frozen=True)
class QuantMatmulLaunch:
    launch: Launch
    y: torch.Tensor  # [M, N], written by the kernel when K is not split
    partials: torch.Tensor | None  # [split, M, N] float32 when it is: y is their sum
    total: Launch | None  # the sum, when K is split

    def __call__(self) -> None:
        self.launch()
        if self.total is not None:
            self.total()


def quant_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, out_features: int,
                 one_token_rows: int | None = None, tile: TileChoice | None = None) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., out_features] in x's dtype, where `raw` holds W [out_features, K] as packed
    GGUF blocks (uint8, contiguous, on x's device).

    one_token_rows: None, x's rows are one sequence's (a decode step, a verification block or a prompt chunk: the
    launch shape goes by their number); else x [M, K] holds several sequences' steps (its first one_token_rows rows
    one-token steps, the rest verification blocks), which all take the 16-row tiles, as each step alone does: each
    row comes out as its sequence's step alone gives it.
    tile: the matrix's tuned launch for steps of up to VERIFY_ROWS rows (None: the default)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], out_features, device=x.device, dtype=x.dtype)
    if one_token_rows is None:
        plan = quant_matmul_launch(x2, raw, qtype, y, tile=tile)
    else:
        if x.dim() != 2 or not 0 <= one_token_rows <= x.shape[0]:
            raise ValueError(f"{one_token_rows} one-token rows of a [{', '.join(map(str, x.shape))}] batch")
        plan = quant_matmul_launch(x2, raw, qtype, y, several_sequences=True, tile=tile)
    if plan is not None:
        plan()
    return y.reshape(*x.shape[:-1], out_features)


def _checked_row_bytes(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, matrices: int, n: int) -> int:
    """The bytes of a row of `matrices` packed [n, K] matrices in `raw` (K: x's width), after checking raw holds
    exactly them, beside x."""
    k = x.shape[1]
    if qtype not in _CODES:
        supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=lambda t: t.value))
        raise ValueError(f"no packed matmul kernel for {qtype.name} (supported: {supported})")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"{qtype.name} rows need a multiple of {block} values, got {k}")
    row_bytes = k // block * type_size
    if raw.dtype != torch.uint8 or raw.numel() != matrices * n * row_bytes or not raw.is_contiguous():
        what = f"a {qtype.name}" if matrices == 1 else f"{matrices} {qtype.name}"
        raise ValueError(f"expected {matrices * n * row_bytes} contiguous uint8 bytes for {what} [{n}, {k}] "
                         f"matri{'x' if matrices == 1 else 'ces'}, got {raw.numel()} {raw.dtype}")
    if raw.device != x.device:
        raise ValueError(f"weight on {raw.device}, activations on {x.device}")
    return row_bytes


def quant_matmul_launch(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, y: torch.Tensor,
                        several_sequences: bool = False, tile: TileChoice | None = None) -> QuantMatmulLaunch | None:
    """The launch (and the buffers it writes) for y [M, N] = x [M, K] @ W^T (x rows contiguous), after checking
    the operands; None when M = 0. several_sequences: x holds several sequences' steps of at most VERIFY_ROWS rows
    each, which take the 16-row tiles whatever M is (more rows take more tiles, never a wider one, and K splits by
    the columns alone), so a row's sums are those of its step alone. tile: the tuned launch of such steps (and of
    one sequence's up to VERIFY_ROWS rows). Shared by `quant_matmul` and the compile report (meta tensors are enough
    for the latter, which plans for an RTX 4090's SMs)."""
    row_bytes = _checked_row_bytes(x, raw, qtype, 1, y.shape[1])
    if x.shape[0] == 0:
        return None
    if tile is not None and (several_sequences or x.shape[0] <= VERIFY_ROWS):
        if tile.shape.block_m != VERIFY_ROWS or tile.shape.gemv:
            raise ValueError(f"a tuned tile has {VERIFY_ROWS} rows of tl.dot, got {tile.shape}")
        return _launch(x, raw, qtype, y, tile.shape, row_bytes, split=tile.split)
    shape = launch_shape(VERIFY_ROWS if several_sequences else x.shape[0], qtype)
    return _launch(x, raw, qtype, y, shape, row_bytes)


def _launch(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, y: torch.Tensor, shape: LaunchShape,
            row_bytes: int, x_rows: torch.Tensor | None = None, tile_expert: torch.Tensor | None = None,
            expert_bytes: int = 0, split: int | None = None) -> QuantMatmulLaunch:
    """The kernel's launch for y [M, N] in `shape`'s tiles, K split `split` ways (None: where a decode or verify
    launch has too few programs for the SMs, `default_split`); grouped (x_rows and tile_expert given): tile t
    multiplies stack matrix tile_expert[t]."""
    m, out_features = y.shape
    k = x.shape[1]
    steps = k_steps(qtype, k, shape)
    if split is None:
        split = default_split(qtype, out_features, k, shape, _sm_count(x.device.index or 0) if x.is_cuda else RTX_SMS)
    elif split < 1 or steps % split:
        raise ValueError(f"K of {steps} steps does not split {split} ways")
    nb = _blocks_per_step(qtype, k, shape.blocks)
    partials, total = None, None
    if split > 1:
        partials = torch.empty(split, m, out_features, device=x.device, dtype=torch.float32)
        total = Launch(_sum_splits_kernel, (triton.cdiv(out_features, SUM_BLOCK), m),
                       (partials, y, m, out_features, y.stride(0)), dict(SPLIT=split, BLOCK=SUM_BLOCK, num_warps=4))
    out = y if partials is None else partials
    grid = (triton.cdiv(out_features, shape.block_n), triton.cdiv(m, shape.block_m), split)
    # The fp16 scales are read through a half view of the same bytes (every scale sits at an even offset).
    launch = Launch(
        _quant_matmul_kernel, grid,
        (x, raw, raw.view(torch.float16), out, x_rows, tile_expert, m, out_features, x.stride(0), out.stride(-2),
         out.stride(0) if partials is not None else 0, row_bytes, steps // split, expert_bytes),
        dict(FORMAT=_CODES[qtype], NB=nb, BLOCK_M=shape.block_m, BLOCK_N=shape.block_n, DOT=dot_dtype(x.dtype),
             GROUPED=x_rows is not None, GEMV=shape.gemv, num_warps=shape.num_warps, num_stages=shape.num_stages),
    )
    return QuantMatmulLaunch(launch, y, partials, total)


def grouped_quant_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, experts: int,
                         out_features: int, x_rows: torch.Tensor, chosen: torch.Tensor,
                         single: bool = False) -> torch.Tensor:
    """y [P, out_features] with y[p] = x[x_rows[p]] @ W[chosen[p]]^T, where `raw` holds a stack W [experts,
    out_features, K] of packed GGUF matrices (a MoE layer's experts): every pair of one launch. single: no expert
    appears twice in `chosen` (one token's top k), which a decode step knows without asking the GPU: each pair is
    a GEMV program row. Otherwise the pairs are sorted by expert and each expert's rows padded to whole tiles of
    the verification or prefill shape (for the most rows any expert has), so a tile reads one expert's weights once
    for all its rows."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    pairs = chosen.shape[0]
    y = torch.empty(pairs, out_features, device=x.device, dtype=x.dtype)
    if pairs == 0:
        return y
    x_rows, chosen = x_rows.to(torch.int32), chosen.to(torch.int32)
    if single:
        grouped_launch(x, raw, qtype, experts, x_rows, chosen, y, decode_shape(qtype))()
        return y
    shape = launch_shape(int(torch.bincount(chosen, minlength=experts).max()), qtype)
    bm = shape.block_m
    order = torch.argsort(chosen, stable=True)
    by_expert = chosen[order].long()
    counts = torch.bincount(chosen, minlength=experts)
    tiles = (counts + bm - 1) // bm
    first_row = (torch.cumsum(tiles, 0) - tiles) * bm  # each expert's first padded row
    first_pair = torch.cumsum(counts, 0) - counts  # and first sorted pair
    padded = first_row[by_expert] + torch.arange(pairs, device=x.device) - first_pair[by_expert]
    tile_expert = torch.repeat_interleave(torch.arange(experts, device=x.device, dtype=torch.int32), tiles)
    padded_rows = torch.full((tile_expert.shape[0] * bm,), -1, device=x.device, dtype=torch.int32)
    padded_rows[padded] = x_rows[order]
    out = torch.empty(padded_rows.shape[0], out_features, device=x.device, dtype=x.dtype)
    grouped_launch(x, raw, qtype, experts, padded_rows, tile_expert, out, shape)()
    y[order] = out[padded]
    return y


def grouped_launch(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, experts: int,
                   x_rows: torch.Tensor, tile_expert: torch.Tensor, y: torch.Tensor,
                   shape: LaunchShape) -> QuantMatmulLaunch:
    """The launch for y [M, N] (M a whole number of shape.block_m tiles) where tile t multiplies matrix
    tile_expert[t] of the stack in `raw` with x's rows x_rows [M] int32 (-1: a padding row). Shared by
    grouped_quant_matmul and the compile report (meta tensors are enough for the latter)."""
    m, out_features = y.shape
    row_bytes = _checked_row_bytes(x, raw, qtype, experts, out_features)
    if m % shape.block_m or tile_expert.shape[0] != m // shape.block_m or x_rows.shape[0] != m:
        raise ValueError(f"{m} rows are not {tile_expert.shape[0]} tiles of {shape.block_m}")
    return _launch(x, raw, qtype, y, shape, row_bytes, x_rows, tile_expert, out_features * row_bytes)
