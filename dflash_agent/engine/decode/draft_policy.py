"""What to draft, by measured throughput: a request's proposal source and draft length (`DraftPolicy`), and whether a
step of several requests drafts at all (`BatchDrafting`). Both are policies over the engine's one Bandit."""

from __future__ import annotations

import enum
from typing import NamedTuple

from ..bandit import Bandit


class Source(enum.Enum):
    """Where a step's drafts come from; the values name them in SpecStats.by_source."""

    AR = "ar"  # none: a plain decode step
    DFLASH = "dflash"
    MTP = "mtp"  # a Gemma 4 assistant
    NGRAM = "ngram"  # prompt lookup: the continuation of a short match
    COPY = "copy"  # the continuation of a long match, as far as it goes


class Arm(NamedTuple):
    source: Source
    k: int  # the most drafts


PLAIN = Arm(Source.AR, 0)


class DraftPolicy:
    """Picks each step's proposal source and draft length by measured throughput.

    Arms are plain decoding, the drafter (DFlash, or a Gemma 4 assistant's MTP) for a few k, prompt lookup (n-gram)
    and copies; each is scored by committed tokens per second of step time. Arms within half of the best rate are
    measured MIN_SAMPLES times, the others once; then the Bandit's exploration budget re-measures them, so
    speculation turns itself off when drafting does not pay (verifying a block costs several decode steps on a CPU)
    and back on when it starts to (as beellama's profit controller does).
    """

    ALPHA = 0.15
    MIN_SAMPLES = 3
    # at twice this, re-checking the bundled drafter on code it cannot draft left the default below plain decoding
    EXPLORE_BUDGET = 0.01

    def __init__(self, max_draft: int, drafter: bool, ngram: bool, fixed: int | None,
                 max_lookup: int | None = None, copy: bool = False, drafter_source: Source = Source.DFLASH) -> None:
        self.fixed = fixed
        self.drafter = drafter
        self.drafter_source = drafter_source  # DFLASH, or MTP for a Gemma 4 assistant
        self.max_draft = max_draft
        lengths = sorted({k for k in (2, 4, 8, max_draft) if 0 < k <= max_draft})
        longest = max_draft if max_lookup is None else max_lookup
        self.arms: list[Arm] = [PLAIN]
        if ngram and copy:  # a long match: the copy likely goes on, and a long block is one step for many tokens
            self.arms += [Arm(Source.COPY, k) for k in sorted({min(32, longest), longest}) if k > 0]
        if drafter:
            self.arms += [Arm(drafter_source, k) for k in lengths]
        if ngram:  # a short match is often wrong, and verifying a long block costs several steps on a CPU
            self.arms += [Arm(Source.NGRAM, k) for k in sorted({min(k, longest) for k in (4, 8, 16)}) if k > 0]
        self.bandit: Bandit[Arm] = Bandit(self.ALPHA, self.MIN_SAMPLES, self.EXPLORE_BUDGET, near_best=0.5)

    @property
    def longest_copy(self) -> int:
        """The longest copy arm's draft (0: no copy arms)."""
        return max((a.k for a in self.arms if a.source is Source.COPY), default=0)

    def choose(self, ngram_available: bool, copy_available: int = 0) -> Arm:
        """copy_available: how long a copy the sequence's match supports (0: none)."""
        copies = [a for a in self.arms if a.source is Source.COPY]
        if self.fixed is not None:
            if self.drafter:
                return Arm(self.drafter_source, self.fixed)
            if copy_available and copies:
                return Arm(Source.COPY, self.fixed)
            return Arm(Source.NGRAM, self.fixed) if ngram_available else PLAIN
        if copy_available and copies:
            # where a copy is under way it is measured against plain decoding only: the other sources' rates,
            # learnt mostly where nothing is copied, say little here, and they would draft what the copy drafts.
            # A match at least as long as the short arm's draft plays the long arm, a shorter one the short arm:
            # records that share a layout match a little past copy_n and often go wrong, where a long match is a
            # copy under way, and each is learnt apart.
            arm = copies[-1] if copy_available >= copies[0].k else copies[0]
            return self.bandit.choose([PLAIN, arm])
        return self.bandit.choose([a for a in self.arms if a.source is not Source.COPY
                                   and (a.source is not Source.NGRAM or ngram_available)])

    def record(self, arm: Arm, committed: int, seconds: float) -> None:
        if arm not in self.arms or seconds <= 0:  # a fixed block's arm is not learnt
            return
        self.bandit.record(arm, committed / seconds, seconds)


class BatchArm(NamedTuple):
    requests: int  # in the step
    drafting: bool


class BatchDrafting:
    """Whether a step of several requests drafts (each request's own DraftPolicy then picks its source and length)
    or decodes plainly, by the tokens per second each gives the whole batch, measured per batch size: on a CPU a
    verified row costs about half a decode step, and a draft that pays for its own request can cost the others
    more (the aim: batched speculation never below plain batched decoding)."""

    ALPHA = 0.15
    MIN_SAMPLES = 3
    EXPLORE_BUDGET = 0.01

    def __init__(self) -> None:
        self.bandit: Bandit[BatchArm] = Bandit(self.ALPHA, self.MIN_SAMPLES, self.EXPLORE_BUDGET)

    def choose(self, n: int) -> bool:
        return self.bandit.choose([BatchArm(n, False), BatchArm(n, True)]).drafting

    def record(self, n: int, drafting: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        self.bandit.record(BatchArm(n, drafting), tokens / seconds, seconds)
