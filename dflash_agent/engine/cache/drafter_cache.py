"""The drafter's context K/V per slot: the committed tokens' projected target features, per drafter layer."""

from __future__ import annotations

import torch

from ..formats.drafter_config import DrafterConfig


class DrafterCache:
    """Context K/V of the committed tokens, per drafter layer: [max_len, kv_heads, head_dim]."""

    def __init__(self, config: DrafterConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (max_len, config.num_kv_heads, config.head_dim)
        self.max_len = max_len
        self.length = 0
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a drafter cache of {self.length} tokens to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0

    def state(self) -> list[torch.Tensor]:
        """Every layer's context K and V tensors themselves (all positions): what `restore` writes, or reads from
        another drafter cache."""
        return [*self.k, *self.v]

    def snapshot(self, length: int, device: torch.device | str) -> list[torch.Tensor]:
        """Copies of every layer's context K/V for positions [:length] (the prefix cache keeps them, since
        the target features they came from cannot be recomputed without running the target again)."""
        return [t[:length].to(device, copy=True) for t in self.state()]

    def restore(self, length: int, state: list[torch.Tensor] | None) -> None:
        """Set the cache to `length` tokens, from `state` or (None) from what it holds already."""
        if state is None:
            self.rollback(length)
            return
        for dst, src in zip(self.state(), state, strict=True):
            dst[:length].copy_(src[:length])
        self.length = length
