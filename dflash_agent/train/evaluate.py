"""Mean acceptance length of a drafter on cached sequences, without running the target.

Greedy speculative decoding is lossless: its output is the target's greedy continuation, which the
data cache already holds, together with the target's features at every position. So the decode
loop can be replayed exactly with the drafter alone: draft a block after the anchor, accept the
longest prefix that matches the cached continuation, commit it plus the bonus token, append the
committed tokens' features, repeat. It uses the engine's own inference path (`append_context`,
`draft`, `logits`, full-vocabulary argmax), and a test checks it against `RequestDecoder`'s own
statistics on the same prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.cache.drafter_cache import DrafterCache
from ..engine.model.drafter import Drafter
from .data import SequenceSet


@dataclass
class Acceptance:
    steps: int  # speculative steps (each drafts at least one token)
    committed: int  # tokens those steps committed (accepted drafts + one bonus each)
    sequences: int

    @property
    def mean_length(self) -> float:
        """Tokens per verify step: SpecStats.acceptance_length_mean over the same decodes."""
        return self.committed / self.steps if self.steps else 0.0


@dataclass
class _Replay:
    tokens: list[int]
    features: torch.Tensor
    cache: DrafterCache
    pos: int  # the anchor: the last committed token

    def room(self, block: int) -> int:
        """Drafts the next step may make. As the engine does with a budget of len(tokens) - P new
        tokens: only as many as leave room for the bonus token (0: the step is plain decoding)."""
        return min(block - 1, len(self.tokens) - 2 - self.pos)


@torch.inference_mode()
def replay_acceptance(
    drafter: Drafter,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    data: SequenceSet,
    limit: int | None = None,
    block_size: int | None = None,
    lockstep: int = 16,
) -> Acceptance:
    """Replay greedy DFlash decoding with a fixed block over the first `limit` sequences of data.

    Up to `lockstep` sequences advance together, so each round reads the 262k-row LM head once for
    all their draft rows instead of once per sequence (the replay is bound by that read on a CPU)."""
    config = drafter.config
    block = block_size or config.block_size
    scale = config.input_embedding_scale
    steps = committed = 0
    n = len(data) if limit is None else min(limit, len(data))
    for first in range(0, n, lockstep):
        active = []
        for i in range(first, min(first + lockstep, n)):
            seq = data[i]
            replay = _Replay(seq.tokens.tolist(), seq.features.to(device=drafter.device, dtype=drafter.dtype),
                             drafter.new_cache(len(seq.tokens)), seq.prompt_len)
            # The first anchor is the first generated token, committed by the prefill.
            drafter.append_context(replay.features[: replay.pos], replay.cache)
            active.append(replay)
        while active:
            active = [r for r in active if r.room(block) > 0]
            if not active:
                break
            lengths = [r.room(block) for r in active]
            hidden = []
            for r, k in zip(active, lengths):
                ids = torch.tensor([r.tokens[r.pos]] + [config.mask_token_id] * k, device=drafter.device)
                hidden.append(drafter.draft(embed_weight[ids] * scale, r.cache)[1:])
            drafts = drafter.logits(torch.cat(hidden), head_weight).argmax(-1).split(lengths)
            for r, k, draft in zip(active, lengths, drafts):
                truth = torch.tensor(r.tokens[r.pos + 1 : r.pos + 1 + k], device=draft.device)
                # Greedy acceptance keeps the drafts up to the first one the target disagrees with.
                accepted = int((draft == truth).long().cumprod(0).sum())
                steps += 1
                committed += accepted + 1
                drafter.append_context(r.features[r.pos : r.pos + accepted + 1], r.cache)
                r.pos += accepted + 1
    return Acceptance(steps, committed, n)
