"""GGUF weights that stay packed, so a 4-bit checkpoint costs about 4 bits a weight in memory and per token.

A `PackedWeight` stands where the model expects a [out, in] weight matrix of the compute dtype
(Linear.weight, the tied embedding / LM head) and supports exactly what the model does with one:
- `F.linear(x, w)`: kernels.quant_matmul's Triton kernel on CUDA; on the CPU, torch's own packed kernels
  when the weight was repacked for them at load (`repack_for_cpu`, see CpuInt4 / CpuInt8), else the
  reference (dequantize to the compute dtype, then F.linear), which is bit-identical to dequantizing at load;
- `w[ids]`: the embedding rows of `ids`, dequantized from the GGUF blocks, exactly (blocks never straddle rows).
Anything else that would need the data (`.float()`, `.to()`, arithmetic) raises a TypeError instead of
silently expanding gigabytes.

CPU repacking (the fast default on the CPU). torch ships two weight-only CPU kernels, both fast only with
bfloat16 activations (float32 ones take a slow path), so activations are cast to bf16 for the matmul and back:
- `_weight_int4pack_mm_for_cpu` (tinygemm's layout): 4-bit quants q in groups of 32 along the input, each
  with a bf16 scale and zero, w = (q - 8) * scale + zero. Q4_0 (w = d (q - 8)) and Q4_K (w = d sc q - dmin m)
  map onto it exactly, up to rounding scale and zero to bf16.
- `_weight_int8pack_mm`: int8 rows with one scale per output row. Formats with more than 4 bits (Q5_0, Q5_K,
  Q6_K, Q8_0) are requantized onto it from their exact dequantization: 255 levels per row keep them close to
  the original, where requantizing them to 4 bits would lose a bit or more of each weight.
- The LM head is the exception: it is the largest matrix by far (262144 x 640 for Gemma 3), so it takes the
  int4 kernel whatever its format (its own min/max fit per group of 32), which halves the bytes read per
  token again. 4 bits alone would cost the head's fidelity (top-1 agreement with the exact path fell to 91%
  on code), so the int4 logits only pick candidates: the RESCORE best of each row are recomputed exactly in
  float32 from the GGUF blocks (a few dozen rows, not 262144), which is what greedy decoding and sampling
  read. Its rows for the embedding are read exactly from the GGUF blocks too.
`bench --fidelity` (engine.fidelity) measures what this costs against the exact path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..kernels.dispatch import PACKED_TYPES, triton_runs
from .quant import PackedTensor, _bits, _f16, _k_scale_min, _nibbles, _q5, dequantize

RESCORE = 64  # LM-head candidates per position recomputed exactly after the int4 pass
GROUP = 32  # tinygemm's quant group along the input, the block of Q4_0 and the sub-block of Q4_K
_ROWS_PER_CHUNK = 8192  # repack big matrices in row slices, so loading never expands one to float32 whole


def keeps_packed(source: PackedTensor) -> bool:
    """Whether a checkpoint tensor can stay packed: a matrix of a type the kernel reads."""
    return source.qtype in PACKED_TYPES and len(source.shape) == 2


class PackedWeight(torch.Tensor):
    """A [out, in] weight of dtype `dtype` whose data is `packed`'s GGUF blocks (see the module doc)."""

    packed: PackedTensor
    cpu: CpuInt4 | CpuInt8 | None  # set by repack_for_cpu
    rescore: int  # the LM head: candidates per row recomputed exactly after the int4 pass (0: none)

    @staticmethod
    def __new__(cls, packed: PackedTensor, dtype: torch.dtype) -> PackedWeight:
        if not keeps_packed(packed):
            raise ValueError(f"a packed weight needs a matrix of {sorted(t.name for t in PACKED_TYPES)}, "
                             f"got {packed.qtype.name} {packed.shape}")
        raw = packed.raw.reshape(-1).view(torch.uint8)
        if not raw.is_contiguous():
            raw = raw.contiguous()
        self = torch.Tensor._make_wrapper_subclass(cls, packed.shape, dtype=dtype, device=raw.device)
        self.packed = PackedTensor(raw, packed.qtype, packed.shape)
        self.cpu = None
        self.rescore = 0
        return self

    def __repr__(self) -> str:  # the default would try to print the values
        kernel = f", cpu={type(self.cpu).__name__}" if self.cpu is not None else ""
        return (f"PackedWeight({self.packed.qtype.name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}{kernel})")

    def repack_for_cpu(self, head: bool = False) -> None:
        """Repack once for torch's CPU kernels (see the module doc); head: the LM head (int4 whatever the
        format, the best RESCORE logits of each row recomputed exactly). The GGUF blocks stay for `rows`."""
        if self.device.type != "cpu":
            raise ValueError("repack_for_cpu needs a weight on the CPU")
        self.cpu = CpuInt4.from_packed(self.packed) if self.packed.qtype in PLANE_TYPES or head \
            else CpuInt8.from_packed(self.packed)
        self.rescore = min(RESCORE, self.shape[0]) if head else 0

    def _cpu_linear(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cpu(x)
        if self.rescore:
            flat, out = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
            top = out.topk(self.rescore, dim=-1).indices  # [rows, RESCORE]
            exact = torch.einsum("rk,rck->rc", flat.float(), self.rows(top).float())
            out.scatter_(-1, top, exact.to(out.dtype))
        return y

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu is not None and x.device.type == "cpu":
            return self._cpu_linear(x)
        if triton_runs(x):
            from ..kernels.quant_matmul import quant_matmul

            return quant_matmul(x, self.packed.raw, self.packed.qtype, self.shape[0])
        return F.linear(x, self.packed.dequantize(self.dtype))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[*ids.shape, in] in the weight's dtype."""
        block, type_size = GGML_QUANT_SIZES[self.packed.qtype]
        n, k = self.shape
        raw = self.packed.raw.view(n, k // block * type_size)[ids.reshape(-1)]
        return dequantize(raw, self.packed.qtype, (raw.shape[0], k)).to(self.dtype).reshape(*ids.shape, k)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], PackedWeight):
            if (len(args) > 2 and args[2] is not None) or kwargs.get("bias") is not None:
                raise TypeError("a packed GGUF weight has no bias")
            return args[1].linear(args[0])
        if func is torch.Tensor.__getitem__ and isinstance(args[0], PackedWeight):
            if not isinstance(args[1], torch.Tensor) or args[1].dtype not in (torch.long, torch.int):
                raise TypeError("a packed GGUF weight is indexed by a tensor of row ids only")
            return args[0].rows(args[1])
        # metadata (shape, dtype, device, ...) is answered by the wrapper; data access reaches
        # __torch_dispatch__ and fails there
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None) -> Any:
        raise TypeError(f"{func} on a packed GGUF weight: only F.linear(x, w) and w[ids] are supported")


def _row_slices(packed: PackedTensor, dequantized: bool = True):
    """(blocks, float32 [rows, in] exact dequantization or None) slices of a packed matrix."""
    block, type_size = GGML_QUANT_SIZES[packed.qtype]
    n, k = packed.shape
    raw = packed.raw.view(n, k // block * type_size)
    for start in range(0, n, _ROWS_PER_CHUNK):
        part = raw[start:start + _ROWS_PER_CHUNK]
        yield part, dequantize(part, packed.qtype, (part.shape[0], k)) if dequantized else None


PLANE_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0,
                         GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K})


def _planes(blocks: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int) -> list[tuple]:
    """Blocks of n rows of a format on groups of 32 -> int4 planes [(q [n, k] int32 in 0..15, scale, zero
    [n, k / 32] float32)] whose sum of (q - 8) * scale + zero is the weight exactly (up to rounding scale and
    zero to bf16). A 4-bit format is one plane; a 5- or 8-bit one splits its quants u = low + 16 high into
    two, the second with 16 times the scale. Each zero is 0, 8 scale, or (K formats) 8 scale - dmin m, so
    bf16 rounding moves it by a fraction of a step at most."""
    T = GGMLQuantizationType
    blocks = blocks.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    if qtype in (T.Q4_0, T.Q5_0, T.Q8_0):  # w = d (u - bias), u unsigned
        scale = _f16(blocks[:, :2])
        if qtype == T.Q4_0:
            u = _nibbles(blocks[:, 2:], 16).reshape(-1, 32)
        elif qtype == T.Q5_0:
            u = _q5(blocks[:, 2:6], blocks[:, 6:])
        else:
            u = (blocks[:, 2:].view(torch.int8).to(torch.int32) + 128)
        u, zero = u.to(torch.int32), torch.zeros_like(scale)
        low, high = u & 15, u >> 4
        if qtype == T.Q4_0:  # d (u - 8)
            planes = [(low, scale, zero)]
        else:  # d low + 16 d (high - bias / 16): Q5_0 high - 1 (q = high + 7), Q8_0 high - 8 (q = high)
            planes = [(low, scale, 8 * scale), (high + (7 if qtype == T.Q5_0 else 0), 16 * scale, zero)]
    elif qtype in (T.Q4_K, T.Q5_K):  # w = (d sc) u - dmin m per sub-block of 32
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        scale = (d * sc.to(torch.float32)).reshape(-1, 1)
        low_zero = 8 * scale - (dmin * mn.to(torch.float32)).reshape(-1, 1)
        if qtype == T.Q4_K:
            planes = [(_nibbles(blocks[:, 16:], 32).reshape(-1, 32).to(torch.int32), scale, low_zero)]
        else:
            low = _nibbles(blocks[:, 48:], 32).reshape(-1, 32).to(torch.int32)
            high = _bits(blocks[:, 16:48], 32).reshape(-1, 8, 32).reshape(-1, 32).to(torch.int32)
            planes = [(low, scale, low_zero), (high + 8, 16 * scale, torch.zeros_like(scale))]
    else:
        raise ValueError(f"{qtype.name} has no exact int4 planes")
    return [(q.reshape(n, k), sc.reshape(n, k // GROUP), z.reshape(n, k // GROUP)) for q, sc, z in planes]


def _fit_int4(w: torch.Tensor):
    """float32 [n, k] -> (q, scale, zero) of the same form, fitted to each group's min and max (scale and
    zero rounded to bf16 first, so the quants are chosen against the grid the kernel will use)."""
    n, k = w.shape
    groups = w.view(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15).to(torch.int32).view(n, k)
    return q, scale, zero


class CpuInt4:
    """tinygemm int4: y = sum over planes of x @ ((q - 8) * scale + zero)^T per group of 32 inputs, bf16
    activations (one plane, or two for 5- and 8-bit formats: see _planes)."""

    def __init__(self, planes: list[tuple[torch.Tensor, torch.Tensor]], out_features: int) -> None:
        self.planes, self.out_features = planes, out_features  # [(packed weight, [k / 32, n, 2] bf16)]

    @classmethod
    def from_packed(cls, packed: PackedTensor) -> CpuInt4:
        """Exact planes for PLANE_TYPES; any other format is fitted to one plane by each group's min and max."""
        n, k = packed.shape
        if k % GROUP:
            raise ValueError(f"int4 repacking needs rows of a multiple of {GROUP} values, got {k}")
        parts: list[list] = []
        for blocks, w in _row_slices(packed, dequantized=packed.qtype not in PLANE_TYPES):
            planes = _planes(blocks, packed.qtype, blocks.shape[0], k) if w is None else [_fit_int4(w)]
            parts.append([(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1),
                           torch.stack((scale, zero), dim=-1).to(torch.bfloat16)) for q, scale, zero in planes])
        planes = [(torch.cat([p[i][0] for p in parts]),
                   torch.cat([p[i][1] for p in parts]).transpose(0, 1).contiguous()) for i in range(len(parts[0]))]
        return cls(planes, n)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes + sz.nbytes for w, sz in self.planes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = None
        for weight, scale_zeros in self.planes:
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, weight, GROUP, scale_zeros).float()
            y = part if y is None else y.add_(part)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class CpuInt8:
    """int8 rows with one bf16 scale each: y = (x @ q^T) * scale, bf16 activations."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        self.weight, self.scale = weight, scale

    @classmethod
    def from_packed(cls, packed: PackedTensor) -> CpuInt8:
        weights, scales = [], []
        for _, w in _row_slices(packed):
            scale = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).to(torch.bfloat16)
            weights.append(torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8))
            scales.append(scale)
        return cls(torch.cat(weights), torch.cat(scales))

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scale)
        return y.to(x.dtype).view(*x.shape[:-1], self.weight.shape[0])
