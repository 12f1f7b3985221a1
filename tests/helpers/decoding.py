"""One request's prompt and decode steps on a RequestDecoder, in the order the scheduler runs them
(engine.scheduler: Task.start / prefill_chunk / plan / commit, Scheduler._step), for tests that drive a decoder
without an engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from dflash_agent.engine.decode.speculative import RequestDecoder
from dflash_agent.engine.model.gemma import RowGroup


def prefill(decoder: RequestDecoder, prompt_ids: list[int], cached: int = 0, logits: torch.Tensor | None = None,
            on_chunk: Callable[[int, torch.Tensor | None], None] | None = None,
            stop: Callable[[], bool] | None = None) -> bool:
    """The prompt through `prefill_chunks`, one chunk (or one layer of a long chunk) a turn; False when `stop()`
    said to stop before one, as a cancelled request's Task.close closes the chunks then."""
    chunks = decoder.prefill_chunks(prompt_ids, cached, logits, on_chunk)
    while True:
        if stop is not None and stop():
            chunks.close()
            return False
        if next(chunks, None) is None:
            return True


def decode(decoder: RequestDecoder, max_new: int) -> Iterator[int]:
    """Up to max_new tokens after `prefill`: the first from the prompt's logits, then one step after another as a
    request alone in the scheduler takes them (it drafts as its own controller decides): plan the block, run it
    through the target as a group of the step's forward (StepRunner.forward_groups), commit what it verifies.
    The caller may stop between tokens, inside a committed block (RequestDecoder.finish takes what it consumed)."""
    if max_new <= 0:
        return
    anchor = decoder.first_token()
    produced = 1
    yield anchor
    while produced < max_new:
        planned = decoder.plan(anchor, max_new - produced, draft=True)
        group = RowGroup(planned.ids, decoder.cache, planned.logits_at, planned.greedy)
        (out,) = decoder.target.forward_groups([group], decoder.capture)
        new = decoder.commit(planned, out)
        for token in new:
            produced += 1
            yield token
        anchor = new[-1]
