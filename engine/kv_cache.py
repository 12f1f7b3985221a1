"""KV cache for one sequence: full-attention layers grow, sliding-window layers keep a ring."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig

# A forward of up to this many tokens may be rolled back (a speculative block plus its bonus token).
DEFAULT_SLACK = 16


@dataclass
class LayerKV:
    k: torch.Tensor  # [slots, num_kv_heads, head_dim]; full layers: slot == position
    v: torch.Tensor
    sliding: bool


class KVCache:
    """Keys and values of the tokens committed so far, for a single sequence.

    A sliding ring holds `window + slack` slots, so after a forward of up to `slack + 1` tokens the cache can be
    rolled back to any position inside that forward and still hold the window every later query needs.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        slack: int = DEFAULT_SLACK,
    ) -> None:
        self.max_len = max_len
        self.slack = slack
        self.length = 0
        self.ring_slots = min(max_len, config.sliding_window + slack)
        # Every sliding layer writes the same positions to the same slots, so they share one position map.
        self.ring_pos = torch.full((self.ring_slots,), -1, device=device, dtype=torch.long)
        self.layers: list[LayerKV] = []
        for spec in config.layers:
            shape = (self.ring_slots if spec.sliding else max_len, spec.num_kv_heads, spec.head_dim)
            self.layers.append(
                LayerKV(
                    torch.zeros(shape, device=device, dtype=dtype),
                    torch.zeros(shape, device=device, dtype=dtype),
                    spec.sliding,
                )
            )

    def rollback(self, length: int) -> None:
        """Forget every token at position >= length (rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0
        self.ring_pos.fill_(-1)
