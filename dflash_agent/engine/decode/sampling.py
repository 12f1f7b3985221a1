"""Token selection (greedy, temperature, top-k, top-p, min-p, seed) and stop conditions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..types import SamplingParams

_FLOAT32 = torch.finfo(torch.float32)


def torch_argmax(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


class Sampler:
    """Draws tokens for one request; its own generator makes a seeded request reproducible. `argmax` is greedy
    decoding's pick (the model's, which may be a faster kernel than torch's)."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu",
                 argmax: Callable[[torch.Tensor], int] = torch_argmax) -> None:
        if 0 < params.temperature < _FLOAT32.tiny:
            # Below float32's smallest normal the temperature rounds to 0 (or dividing by it overflows): the
            # limit of sampling as the temperature goes to 0 is greedy decoding, so decode greedily.
            params = replace(params, temperature=0.0)
        self.params, self.argmax = params, argmax
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution actually sampled from, after temperature and truncation; logits [..., V] float32."""
        p = self.params
        logits = logits.float()
        # Scaled relative to the best token, so a tiny temperature sends the others to -inf rather than the best
        # to +inf (inf - inf is nan); one that float32 cannot hold is clamped to its range.
        temperature = min(max(p.temperature, _FLOAT32.tiny), _FLOAT32.max)
        logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
            drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            drop_sorted[..., 0] = False  # a top_p that rounds to 0 in float32 would drop the top token too
            probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)

    def __call__(self, logits: torch.Tensor) -> int:
        """One token from logits [V]."""
        if self.params.greedy:
            return self.argmax(logits)
        return self.draw(self.probs(logits))

    def draw(self, probs: torch.Tensor) -> int:
        """One token from a distribution [V]."""
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        """A draw from U[0, 1) on this request's generator (speculative acceptance tests)."""
        return float(torch.rand((), generator=self.generator, device=self.generator.device))


@dataclass
class StopStringFilter:
    """Streams text while holding back any tail that could still become a stop string."""

    strings: tuple[str, ...]
    _pending: str = field(default="", init=False)

    def push(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, the stop string if one completed). Text after a stop string is dropped."""
        self._pending += text
        hits = [(at, stop) for stop in self.strings if (at := self._pending.find(stop)) >= 0]
        if hits:
            at, stop = min(hits)
            emitted, self._pending = self._pending[:at], ""
            return emitted, stop
        hold = max((_overlap(self._pending, s) for s in self.strings), default=0)
        emitted = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(emitted):]
        return emitted, None

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return rest


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
