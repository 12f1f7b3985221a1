"""How many threads a CPU step runs on, chosen by the engine's one Bandit from the seconds per row each gives."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from ...kernels.cpu.cpu_dot import CpuDot
from ..bandit import Bandit


class ThreadArm(NamedTuple):
    size: int  # the step's size bucket: one row, up to 16, more
    threads: int


def _bucket(rows: int) -> int:
    return 0 if rows == 1 else 1 if rows <= 16 else 2


class ThreadCount:
    """How many threads a step runs on: all the engine was given, or half of them, by the seconds per row each gives,
    measured per size of step (one row, up to 16, more). A coding agent runs its tools (tests, builds) on the same
    cores: with one of two cores busy, a step's parallel regions wait for the thread that is not running, and two
    threads decode far slower than one. Each count is measured MIN_SAMPLES times, then the faster one plays and the
    other is re-measured from the Bandit's exploration budget, so a core that gets busy is left at once (the count
    in play slows down) and one that gets free is taken back soon. The count covers the CPU kernels and, where
    `torch_follows`, torch's own ops (a prompt chunk's attention, norms and activations; the count is the worker
    thread's, which alone runs torch in the engine): torch's at two threads beside a busy core slowed a long prompt
    several times over against one thread. Results do not depend on the count: the kernels compute each output on one
    thread (CpuDot.using); torch follows only where every product runs in the kernels (products_in_c), its other ops
    giving the same bits at either count (tests/engine/test_scheduler.py checks it), while torch's GEMMs may split a
    sum by the count, so where torch multiplies it keeps all the threads."""

    ALPHA = 0.2
    MIN_SAMPLES = 2
    EXPLORE_BUDGET = 0.01

    def __init__(self, kernels: CpuDot, most: int, torch_follows: bool) -> None:
        self.kernels, self.most, self.torch_follows = kernels, most, torch_follows
        self.counts = sorted({most, max(1, most // 2)}, reverse=True)
        # scored by minus the seconds per row: the fastest count scores highest
        self.bandit: Bandit[ThreadArm] = Bandit(self.ALPHA, self.MIN_SAMPLES, self.EXPLORE_BUDGET)

    def seconds_per_row(self, arm: ThreadArm) -> float:
        return -self.bandit.score(arm)

    def choose(self, rows: int) -> int:
        size = _bucket(rows)
        # a re-measure spends the step's whole expected time from the budget, not only what it may lose
        arm = self.bandit.choose([ThreadArm(size, n) for n in self.counts],
                                 price=lambda other, _best: rows * self.seconds_per_row(other))
        return arm.threads

    def record(self, rows: int, threads: int, seconds: float) -> None:
        if seconds <= 0 or rows < 1:
            return
        self.bandit.record(ThreadArm(_bucket(rows), threads), -(seconds / rows), seconds)

    def run(self, rows: int, step: Callable[[], object]) -> None:
        """Run a step of `rows` rows with the kernels on the count chosen for it, and learn from its time."""
        threads = self.choose(rows)
        started = time.perf_counter()
        self.on(threads, step)
        self.record(rows, threads, time.perf_counter() - started)

    def preferred(self) -> int:
        """The count the steps measured most favour: a prompt chunk's (not measured itself: it may be one layer of
        a chunk, and a busy core is as busy for it); all the threads before both counts are measured."""
        measured = [size for size in (0, 1, 2) if all(self.bandit.samples(ThreadArm(size, n)) for n in self.counts)]
        if not measured:
            return self.counts[0]
        size = max(measured, key=lambda s: sum(self.bandit.samples(ThreadArm(s, n)) for n in self.counts))
        return min(self.counts, key=lambda n: self.seconds_per_row(ThreadArm(size, n)))

    def on(self, threads: int, work: Callable[[], object]) -> None:
        torch_threads = threads if self.torch_follows else self.most
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        with self.kernels.using(threads):
            work()
