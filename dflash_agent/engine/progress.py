"""Progress lines for long requests. A long prompt's prefill or a long answer on a CPU takes minutes, and the
request's own log line only comes at its end: these say, every so often, how far it has got."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

progress_log = logging.getLogger("dflash_agent.engine.progress")

PROGRESS_EVERY_S = 10.0


class ProgressLog:
    """One request's progress at INFO, at most once every `every_s` seconds and never before `every_s` have
    passed: a request that ends sooner logs nothing here. Calls are cheap (a clock read) so the decode loop can
    make one per token."""

    def __init__(self, request_id: str, every_s: float = PROGRESS_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.request_id = request_id
        self.every_s = every_s
        self._clock = clock
        self._phase_started = self._last = clock()

    def prefilled(self, done: int, total: int) -> None:
        """`done` of the `total` prompt tokens that need a prefill (the prefix cache serves the rest)."""
        if (elapsed := self._due()) is not None:
            progress_log.info("%s: prefill %d / %d tokens, %.1f tok/s, %.0f s", self.request_id, done, total,
                              done / elapsed if elapsed > 0 else 0.0, elapsed)

    def decoding(self) -> None:
        """The prefill is over: rates from here on count generated tokens."""
        self._phase_started = self._clock()

    def generated(self, done: int, limit: int) -> None:
        """`done` tokens generated of at most `limit` (the request's max_tokens or what the context leaves)."""
        if (elapsed := self._due()) is not None:
            progress_log.info("%s: generated %d tokens (at most %d), %.1f tok/s, %.0f s", self.request_id, done,
                              limit, done / elapsed if elapsed > 0 else 0.0, elapsed)

    def _due(self) -> float | None:
        """Seconds since the phase started, when a line is due."""
        now = self._clock()
        if now - self._last < self.every_s:
            return None
        self._last = now
        return now - self._phase_started
