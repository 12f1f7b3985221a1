"""One explore/exploit rule for the engine's measured choices: what a request drafts and whether a batch drafts
(decode.draft_policy), and how many threads a CPU step runs on (backends.thread_count).

Each arm keeps an EWMA of its score per step (higher is better) and of its step seconds. Every arm is measured
`min_samples` times (with `near_best`, only those scoring at least that fraction of the best get more than one look);
then the best arm is played, and the others are re-measured from an exploration budget: each step adds `budget` of
its seconds to a credit, and re-measuring the arm played longest ago spends its price, by default what it is expected
to lose against the best (its step seconds times its score deficit). So an arm as good as the best is re-checked
every few steps, a far worse one rarely, and exploring never costs more than `budget` of the time: a choice that
stops paying is left, and one that starts to pay is found again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

A = TypeVar("A", bound=Hashable)


@dataclass
class Estimate:
    score: float  # EWMA of the arm's score per step
    seconds: float  # EWMA of its step time
    samples: int = 1
    last_played: int = 0  # the bandit's choice count when the arm was last recorded


class Bandit(Generic[A]):
    def __init__(self, alpha: float, min_samples: int, budget: float, near_best: float | None = None) -> None:
        self.alpha, self.min_samples, self.budget, self.near_best = alpha, min_samples, budget, near_best
        self.estimates: dict[A, Estimate] = {}
        self.steps = 0  # choices made
        self.credit = 0.0  # seconds of exploration the budget has earned

    def samples(self, arm: A) -> int:
        estimate = self.estimates.get(arm)
        return 0 if estimate is None else estimate.samples

    def score(self, arm: A) -> float:
        return self.estimates[arm].score

    def choose(self, arms: Sequence[A], price: Callable[[A, A], float] | None = None) -> A:
        """The arm to play among `arms` (measured first to last while they need measuring). price(arm, best): the
        seconds re-measuring `arm` spends from the credit (default: `expected_loss`)."""
        self.steps += 1
        known = self.estimates
        best_score = max((known[a].score for a in arms if a in known), default=0.0)
        for arm in arms:
            n = self.samples(arm)
            if n == 0 or (n < self.min_samples and (self.near_best is None
                                                    or known[arm].score >= self.near_best * best_score)):
                return arm
        best = max(arms, key=self.score)
        others = [a for a in arms if a != best]
        if others:
            stalest = min(others, key=lambda a: known[a].last_played)
            spend = (price or self.expected_loss)(stalest, best)
            if self.credit >= spend:
                self.credit -= spend
                return stalest
        return best

    def expected_loss(self, arm: A, best: A) -> float:
        """Seconds a step of `arm` is expected to lose against playing `best` for as long."""
        if not self.score(best):
            return 0.0
        return self.estimates[arm].seconds * max(0.0, 1 - self.score(arm) / self.score(best))

    def record(self, arm: A, score: float, seconds: float) -> None:
        """A step of `arm` scored `score` and took `seconds`."""
        estimate = self.estimates.get(arm)
        if estimate is None:
            self.estimates[arm] = Estimate(score, seconds, 1, self.steps)
        else:
            estimate.score = (1 - self.alpha) * estimate.score + self.alpha * score
            estimate.seconds = (1 - self.alpha) * estimate.seconds + self.alpha * seconds
            estimate.samples += 1
            estimate.last_played = self.steps
        self.credit += self.budget * seconds
