"""Weight-only quantization at load time (8-bit per row, 4-bit per group of 32), for modules whose
bf16 weights would not fit beside the target, such as the 31B model's 3 GB DFlash drafter.

Weights are kept quantized and expanded one matrix at a time inside forward, so resident memory
drops to about 1/2 (8-bit) or 1/4 (4-bit) of bf16 while each matmul runs in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import OptionError

GROUP = 32
MODES = ("q8", "q4")


class QuantLinear(nn.Module):
    """y = x @ W^T with W stored as symmetric int8 rows or packed int4 groups plus scales."""

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
        else:
            # Rows are zero-padded to whole groups; dequantize drops the padding again.
            w = F.pad(w, (0, -self.in_features % GROUP))
            groups = w.view(self.out_features, -1, GROUP)
            scale = groups.abs().amax(dim=2, keepdim=True).clamp_min(1e-12) / 7
            q = (torch.round(groups / scale).clamp(-8, 7) + 8).to(torch.uint8).view(self.out_features, -1)
            self.register_buffer("qweight", q[:, 0::2] | (q[:, 1::2] << 4))
        self.register_buffer("scale", scale.to(weight.dtype))

    def dequantize(self) -> torch.Tensor:
        if self.mode == "q8":
            return self.qweight.to(self.dtype) * self.scale
        low, high = self.qweight & 0xF, self.qweight >> 4
        q = torch.stack((low, high), dim=-1).view(self.out_features, -1, GROUP).to(self.dtype) - 8
        return (q * self.scale).view(self.out_features, -1)[:, : self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
