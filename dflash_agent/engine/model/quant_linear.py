"""Weight-only quantization at load time (8-bit per row, 4-bit per group of 32), for modules whose
bf16 weights would not fit beside the target, such as the 31B model's 3 GB DFlash drafter.

Resident memory drops to about 1/2 (8-bit) or 1/4 (4-bit) of bf16. 4-bit weights are GGUF Q4_0 blocks (a float16
scale and 32 4-bit values a group), so on CUDA the packed Triton matmul reads them as it reads a GGUF target's
(expanding them in forward cost the 31B drafter 16 ms a step on an H200); elsewhere, and for 8-bit weights, a
matrix is expanded to the activation dtype inside forward, one at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from ...kernels.dispatch import triton_runs
from ..errors import OptionError
from ..formats.quant import dequantize

GROUP = 32
MODES = ("q8", "q4")


class QuantLinear(nn.Module):
    """y = x @ W^T with W stored as symmetric int8 rows plus their scales, or as Q4_0 blocks."""

    def __init__(self, weight: torch.Tensor, mode: str) -> None:
        super().__init__()
        if mode not in MODES:
            raise OptionError(f"unknown quantization {mode!r} (one of {', '.join(MODES)})")
        self.mode, self.dtype = mode, weight.dtype
        self.out_features, self.in_features = weight.shape
        w = weight.float()
        if mode == "q8":
            scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            self.register_buffer("qweight", torch.round(w / scale).to(torch.int8))
            self.register_buffer("scale", scale.to(weight.dtype))
            return
        # Rows are zero-padded to whole groups; dequantize drops the padding again.
        w = F.pad(w, (0, -self.in_features % GROUP))
        groups = w.view(self.out_features, -1, GROUP)
        d = (groups.abs().amax(dim=2) / 7).to(torch.float16)
        step = d.float().clamp_min(2.0**-24)[..., None]  # the scale as stored; never 0
        q = (torch.round(groups / step).clamp(-8, 7) + 8).to(torch.uint8)
        nibbles = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)  # Q4_0: value j low, j + 16 high
        blocks = torch.cat((d.view(torch.uint8).view(*d.shape, 2), nibbles), dim=-1)
        self.register_buffer("qweight", blocks.reshape(self.out_features, -1))

    def dequantize(self) -> torch.Tensor:
        if self.mode == "q8":
            return self.qweight.to(self.dtype) * self.scale
        padded = self.qweight.shape[1] // (GROUP // 2 + 2) * GROUP
        w = dequantize(self.qweight, GGMLQuantizationType.Q4_0, (self.out_features, padded))
        return w[:, : self.in_features].to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "q4" and self.in_features % GROUP == 0 and triton_runs(x):
            from ...kernels.triton.quant_matmul import quant_matmul

            return quant_matmul(x, self.qweight.view(-1), GGMLQuantizationType.Q4_0, self.out_features)
        return F.linear(x, self.dequantize())


def quantize_linear_weights(module: nn.Module, mode: str) -> None:
    """Replace every nn.Linear under `module` by a QuantLinear of its weight, in place."""
    if mode not in MODES:
        raise OptionError(f"unknown quantization {mode!r} (one of {', '.join(MODES)})")
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            if child.bias is not None:
                raise ValueError(f"{name}: quantizing a linear layer with a bias is not supported")
            setattr(module, name, QuantLinear(child.weight.data, mode))
        else:
            quantize_linear_weights(child, mode)
