"""Dequantizers for GGUF (ggml) block-quantized tensors, in plain torch.

The output is bit-identical to gguf-py's numpy reference
(`gguf.quants.dequantize`), and the kernels follow its operation order anyway:
fp16 scales widened to float32, sub-scale products formed first
(Q4_K is `(d * sc) * q - (dmin * m)`), each step rounded on its own.
The order turns out not to matter: an fp16 significand (11 bits) times a
sub-scale (<= 7 bits) times a quant (<= 6 bits) fits in float32's 24, so every
product is exact and the only rounding is the final `+ m` / `- dmin * m`.
Regrouping or fusing into an FMA (torch.compile may) gives the same bits.

The kernels are vectorized over blocks and run on any device. The float steps
work in place on the freshly widened quants (same rounding, one output-sized
float32 buffer instead of several), but the unpacking still makes a few
uint8 temporaries of output size, so dequantize big tensors one at a time.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import GGUFError, UnsupportedTensorType

QK_K = 256
K_SCALE_SIZE = 12


def half_floats(field: torch.Tensor) -> torch.Tensor:
    # [n, 2] uint8 -> [n, 1] float32. Exact for every non-NaN half; NaNs stay NaN but torch's
    # CPU path returns one canonical NaN where numpy keeps sign and payload
    return field.view(torch.float16).to(torch.float32)


def bit_fields(x: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    # [..., k] -> [..., len(shifts), k]: the bit fields of every byte, one shift per row,
    # which is the layout all ggml formats use (low nibble/bits first)
    return torch.stack([(x >> s) & mask for s in shifts], dim=-2)


def nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    # [n, b] -> [n, b // width, 2, width]: for each `width` bytes, their low nibbles then their high nibbles
    return bit_fields(qs.reshape(qs.shape[0], -1, width), (0, 4), 0x0F)


def bit_planes(qh: torch.Tensor, width: int) -> torch.Tensor:
    # [n, b] -> [n, b // width, 8, width]: bit j of each of `width` bytes, j = 0..7
    return bit_fields(qh.reshape(qh.shape[0], -1, width), tuple(range(8)), 0x01)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float32)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of an fp32; widening is a shift, as in gguf-py
    return (blocks.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = half_floats(blocks[:, :2])
    x = blocks[:, 2:].view(torch.int8).to(torch.float32)
    return x.mul_(d)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = half_floats(blocks[:, :2])
    q = nibbles(blocks[:, 2:], 16).reshape(n, 32).to(torch.float32).sub_(8.0)
    return q.mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, m = half_floats(blocks[:, 0:2]), half_floats(blocks[:, 2:4])
    q = nibbles(blocks[:, 4:], 16).reshape(n, 32).to(torch.float32)
    return q.mul_(d).add_(m)


def q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    # qh is a little-endian uint32 whose bit i is the 5th bit of element i;
    # reading it byte by byte keeps us off uint32 ops torch lacks on some devices
    n = qs.shape[0]
    low = nibbles(qs, 16).reshape(n, 32)
    high = bit_planes(qh, 4).transpose(-1, -2).reshape(n, 32)
    return low | (high << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = half_floats(blocks[:, 0:2])
    q = q5_values(blocks[:, 2:6], blocks[:, 6:]).to(torch.float32).sub_(16.0)
    return q.mul_(d)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = half_floats(blocks[:, 0:2]), half_floats(blocks[:, 2:4])
    q = q5_values(blocks[:, 4:8], blocks[:, 8:]).to(torch.float32)
    return q.mul_(d).add_(m)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = half_floats(blocks[:, 80:82]), half_floats(blocks[:, 82:84])
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = bit_fields(qs.reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 16, 16).to(torch.float32)
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = half_floats(blocks[:, 108:110])
    # 16 6-bit scales: low 4 bits from bytes 0..7 (both nibbles), high 2 bits from bytes 8..11
    low = bit_fields(scales[:, :8], (0, 4), 0x0F).reshape(n, 16)
    high = bit_fields(scales[:, 8:], (0, 2, 4, 6), 0x03).reshape(n, 16)
    sc = (low | (high << 4)).to(torch.float32).sub_(32.0)
    dl = (d * sc).reshape(n, 16, 1)
    ql = bit_fields(qs.reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 16, 16)
    # a set hmask bit means "no offset", a clear one means subtract 4
    qh = bit_planes(hmask, 32).reshape(n, 16, 16) ^ 1
    q = ql.to(torch.float32).sub_((qh << 2).to(torch.float32))
    return q.mul_(dl).reshape(n, QK_K)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # eight 6-bit (scale, min) pairs packed into 12 bytes; see Q4_K.get_scale_min in gguf-py
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    # shared tail of Q4_K/Q5_K: q is [n, 8, 32] sub-blocks
    n = blocks.shape[0]
    d, dmin = half_floats(blocks[:, 0:2]), half_floats(blocks[:, 2:4])
    sc, mn = k_scale_min(blocks[:, 4 : 4 + K_SCALE_SIZE])
    d = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    return q.to(torch.float32).mul_(d).sub_(dm).reshape(n, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    q = nibbles(blocks[:, 16:], 32).reshape(n, 8, 32)
    return _k_affine(blocks, q)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qh, qs = blocks[:, 16:48], blocks[:, 48:]
    q = nibbles(qs, 32).reshape(n, 8, 32) | (bit_planes(qh, 32).reshape(n, 8, 32) << 4)
    return _k_affine(blocks, q)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
    d = half_floats(blocks[:, 208:210])
    d = (d * scales.view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    low = nibbles(ql, 64).reshape(n, 8, 32)
    high = bit_fields(qh.reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 8, 32)
    q = (low | (high << 4)).reshape(n, 16, 16).to(torch.float32).sub_(32.0)
    return q.mul_(d).reshape(n, QK_K)


_T = GGMLQuantizationType
_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    _T.F32: _f32,
    _T.F16: half_floats,
    _T.BF16: _bf16,
    _T.Q8_0: _q8_0,
    _T.Q4_0: _q4_0,
    _T.Q4_1: _q4_1,
    _T.Q5_0: _q5_0,
    _T.Q5_1: _q5_1,
    _T.Q2_K: _q2_k,
    _T.Q3_K: _q3_k,
    _T.Q4_K: _q4_k,
    _T.Q5_K: _q5_k,
    _T.Q6_K: _q6_k,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_KERNELS)


def _check_type(qtype: GGMLQuantizationType) -> None:
    if qtype not in _KERNELS:
        supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=lambda t: t.value))
        name = getattr(qtype, "name", str(qtype))
        raise UnsupportedTensorType(f"GGUF tensor type {name} is not supported (supported: {supported})")


def _packed_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    # ggml blocks never straddle rows, so each row must hold whole blocks
    if shape and shape[-1] % block_size != 0:
        raise GGUFError(f"{qtype.name} row length {shape[-1]} is not a multiple of its block size {block_size}")
    return math.prod(shape) // block_size * type_size


def _as_bytes(raw: torch.Tensor) -> torch.Tensor:
    # flat uint8 view of raw's bytes; copies only if raw is strided or misaligned for the
    # dtype views the kernels take (fp32 needs a 4-byte-aligned storage offset)
    if not raw.is_contiguous() or raw.storage_offset() * raw.element_size() % 4 != 0:
        raw = raw.clone(memory_format=torch.contiguous_format)
    return raw.reshape(-1).view(torch.uint8)


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Unpack ggml blocks to a new float32 tensor of `shape` (torch order) on raw's device.

    raw holds the packed bytes in file order; its own shape and dtype are ignored
    (its bytes are reinterpreted, so a typed F32/F16 array works as well as uint8).
    """
    _check_type(qtype)
    shape = tuple(int(s) for s in shape)
    nbytes = _packed_nbytes(qtype, shape)
    data = _as_bytes(raw)
    if data.numel() != nbytes:
        raise GGUFError(f"{qtype.name} tensor of shape {shape} needs {nbytes} bytes, got {data.numel()}")
    _, type_size = GGML_QUANT_SIZES[qtype]
    out = _KERNELS[qtype](data.reshape(-1, type_size))
    if qtype == _T.F32:
        # the F32 "kernel" is a view of raw, which may be a read-only memory map
        out = out.clone()
    return out.reshape(shape)


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """Zero-copy tensor over a numpy array, read-only ones (memory maps) included.

    torch warns because it cannot honour read-only-ness; dequantize only reads,
    so the warning is noise here. Don't write through the result.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


@dataclass(frozen=True, eq=False)
class PackedTensor:
    """A GGUF tensor still in its packed on-disk form; dequantize where it will be used."""

    raw: torch.Tensor  # packed bytes as stored in the file (may be a zero-copy view of a memory map)
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # logical shape, torch order (reversed GGUF ne)

    def __post_init__(self) -> None:
        _check_type(self.qtype)
        nbytes = _packed_nbytes(self.qtype, self.shape)
        if self.nbytes != nbytes:
            raise ValueError(f"{self.qtype.name} tensor of shape {self.shape} needs {nbytes} bytes, got {self.nbytes}")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.raw, self.qtype, self.shape).to(dtype)

    def to(self, device: torch.device | str) -> PackedTensor:
        return PackedTensor(self.raw.to(device), self.qtype, self.shape)

    @property
    def nbytes(self) -> int:
        return self.raw.numel() * self.raw.element_size()
