"""Progress lines of a long request: throttled by time, nothing for a request that ends sooner."""

from __future__ import annotations

import logging

from dflash_agent.engine.progress import ProgressLog, progress_log


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_come_every_so_often_with_counts_and_rates(caplog):
    clock = Clock()
    progress = ProgressLog("chatcmpl-1", every_s=10, clock=clock)
    with caplog.at_level(logging.INFO, logger=progress_log.name):
        for done in range(512, 4097, 512):  # prefill chunks, 3 s each: a line at 12 s and 24 s
            clock.now += 3
            progress.prefilled(done, 4096)
        progress.decoding()
        for done in range(1, 101):  # 100 tokens at 4 tok/s: 25 s of decoding
            clock.now += 0.25
            progress.generated(done, 8192)
    assert [r.getMessage() for r in caplog.records] == [
        "chatcmpl-1: prefill 2048 / 4096 tokens, 170.7 tok/s, 12 s",
        "chatcmpl-1: prefill 4096 / 4096 tokens, 170.7 tok/s, 24 s",
        "chatcmpl-1: generated 40 tokens (at most 8192), 4.0 tok/s, 10 s",
        "chatcmpl-1: generated 80 tokens (at most 8192), 4.0 tok/s, 20 s",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_a_short_request_logs_nothing(caplog):
    clock = Clock()
    progress = ProgressLog("req-0", every_s=10, clock=clock)
    with caplog.at_level(logging.INFO, logger=progress_log.name):
        progress.prefilled(20, 20)
        progress.decoding()
        for done in range(1, 200):
            clock.now += 0.04
            progress.generated(done, 200)
    assert caplog.records == []
