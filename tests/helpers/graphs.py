"""A stand-in for a captured CUDA graph: its replay runs the step again and copies the outputs into the first run's
tensors, which is what a replay amounts to; so the steps engine.backends.cuda captures run eagerly, on the CPU too."""

from __future__ import annotations

import torch


class EagerGraph:
    def __init__(self, step, outputs) -> None:
        self.step, self.outputs = step, outputs

    def replay(self) -> None:
        _copy_into(self.outputs, self.step())


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for key in dst:
            _copy_into(dst[key], src[key])
    else:
        for d, s in zip(dst, src, strict=True):
            _copy_into(d, s)
