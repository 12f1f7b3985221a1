"""Whether a tool leaves the event loop free: a ticker task counts turns of the loop while it runs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def ticking(work: Awaitable[T], period: float = 0.01) -> tuple[T, float, int]:
    """`work`'s result, the seconds it took, and how often a `period` sleep came back meanwhile (a
    loop blocked by the work barely ticks)."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(period)
            ticks += 1

    clock = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # the ticker starts before the work
    started = time.monotonic()
    try:
        result = await work
    finally:
        clock.cancel()
    return result, time.monotonic() - started, ticks
