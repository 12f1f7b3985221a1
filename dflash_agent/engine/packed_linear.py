"""GGUF weights that stay in their packed blocks on the GPU, so a 4-bit checkpoint costs 4 bits a weight in memory.

A `PackedWeight` stands where the model expects a [out, in] weight matrix of the compute dtype
(Linear.weight, the tied embedding / LM head) and supports exactly what the model does with one:
- `F.linear(x, w)`: kernels.quant_matmul's Triton kernel on CUDA, the reference (dequantize to the
  compute dtype, then F.linear) elsewhere, which is bit-identical to dequantizing at load;
- `w[ids]`: the embedding rows of `ids`, dequantized (ggml blocks never straddle rows).
Anything else that would need the data (`.float()`, `.to()`, arithmetic) raises a TypeError instead of
silently expanding gigabytes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..kernels.dispatch import triton_runs
from .quant import PackedTensor, dequantize

# The block types kernels.quant_matmul reads (listed here too so this module imports without Triton).
PACKED_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})


def keeps_packed(source: PackedTensor) -> bool:
    """Whether a checkpoint tensor can stay packed: a matrix of a type the kernel reads."""
    return source.qtype in PACKED_TYPES and len(source.shape) == 2


class PackedWeight(torch.Tensor):
    """A [out, in] weight of dtype `dtype` whose data is `packed`'s GGUF blocks (see the module doc)."""

    packed: PackedTensor

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
        return self

    def __repr__(self) -> str:  # the default would try to print the values
        return f"PackedWeight({self.packed.qtype.name}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @property
    def nbytes_packed(self) -> int:
        return self.packed.nbytes

    def linear(self, x: torch.Tensor) -> torch.Tensor:
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
