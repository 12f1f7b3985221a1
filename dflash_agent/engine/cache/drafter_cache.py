"""The drafter's context K/V per slot: the committed tokens' projected target features, per drafter layer.

Full-attention layers keep every position; sliding-window layers keep a ring of window + slack slots (as the
target's, engine.cache.kv_cache), their one slot -> position map shared, since all of them write the same
positions to the same slots. z-lab's drafters for Gemma 4 are four sliding layers of 2048 and one full layer, so
the rings bound four fifths of what the context costs.
"""

from __future__ import annotations

import torch

from ..formats.drafter_config import DrafterConfig
from ..limits import LOOKUP_SLACK
from .kv_cache import RingSnapshot, Snapshots


class DrafterCache(Snapshots):
    """Context K/V of the committed tokens, per drafter layer: [max_len, kv_heads, head_dim] for a full layer,
    [ring_slots, kv_heads, head_dim] for a sliding one (slot = position % ring_slots, `ring_pos` the map).

    The ring's slack past the window covers a rollback of the committed tokens by up to `slack` (what a verified
    block leaves past the tokens a request takes) and a draft block's keys written past the context (a captured
    draft, engine.backends.cuda) while the block's queries still need the window before it."""

    def __init__(self, config: DrafterConfig, max_len: int, device: torch.device, dtype: torch.dtype,
                 slack: int | None = None) -> None:
        self.max_len = max_len
        self.length = 0
        self.sliding = [window is not None for window in config.window]
        self.window = max((w for w in config.window if w is not None), default=0)
        slack = max(LOOKUP_SLACK, config.block_size) if slack is None else slack
        self.ring_slots = min(max_len, self.window + slack) if any(self.sliding) else max_len
        self.ring_pos = torch.full((self.ring_slots if any(self.sliding) else 0,), -1, device=device,
                                   dtype=torch.long)

        def shape(sliding: bool) -> tuple[int, int, int]:
            return (self.ring_slots if sliding else max_len, config.num_kv_heads, config.head_dim)

        self.k = [torch.zeros(shape(s), device=device, dtype=dtype) for s in self.sliding]
        self.v = [torch.zeros(shape(s), device=device, dtype=dtype) for s in self.sliding]

    @property
    def has_rings(self) -> bool:
        return any(self.sliding) and self.ring_slots < self.max_len

    def slots(self, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """Where `layer` keeps positions [T]."""
        return positions % self.ring_slots if self.sliding[layer] else positions

    def key_positions(self, layer: int) -> torch.Tensor | None:
        """The position each of `layer`'s slots holds (-1: none yet), or None where slot = position."""
        return self.ring_pos if self.sliding[layer] else None

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values [C, kv_heads, d] of positions start.. into `layer` (a ring keeps the last ring_slots of
        them); the ring's map is advanced by `advance`, once for all layers."""
        if self.sliding[layer] and k.shape[0] > self.ring_slots:
            start, k, v = start + k.shape[0] - self.ring_slots, k[-self.ring_slots:], v[-self.ring_slots:]
        slots = self.slots(torch.arange(start, start + k.shape[0], device=k.device), layer)
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def advance(self, start: int, end: int) -> None:
        """The rings now hold positions start..end-1 (written by `write` to every layer)."""
        if any(self.sliding):
            written = torch.arange(max(start, end - self.ring_slots), end, device=self.ring_pos.device)
            self.ring_pos[written % self.ring_slots] = written

    def rings_hold(self, length: int) -> bool:
        """Whether the rings still hold the window before `length`, so a rollback to it is exact."""
        if not self.has_rings or length == 0:
            return True
        wanted = torch.arange(max(0, length - self.window), length, device=self.ring_pos.device)
        return bool((self.ring_pos[wanted % self.ring_slots] == wanted).all())

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a drafter cache of {self.length} tokens to {length}")
        if not self.rings_hold(length):
            raise ValueError(f"the drafter's sliding rings no longer hold the window before position {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0
        self.ring_pos.fill_(-1)

    # --- snapshots (the prefix cache) -------------------------------------------------------------

    def full_state(self) -> list[torch.Tensor]:
        """The full layers' context K and V tensors themselves (all positions): what `restore` writes, or reads
        from another drafter cache."""
        return [t for i, s in enumerate(self.sliding) if not s for t in (self.k[i], self.v[i])]

    def ring_state(self) -> RingSnapshot:
        """The rings and their position map themselves, not copies (as KVCache.ring_state)."""
        return RingSnapshot(self.ring_pos, [t for i, s in enumerate(self.sliding) if s for t in (self.k[i], self.v[i])])
