"""The embedded Gemma 3 270M GGUF: our greedy decoding against transformers' on the same file (float32)."""

import asyncio
import logging

import pytest
import torch

from dflash_agent.engine import SamplingParams, StopCriteria
from dflash_agent.engine.engine import FinalEvent, GenerateRequest, TokenEvent
from dflash_agent.engine.model.gemma import ContextOverflowError

PROMPTS = [
    "def fibonacci(n):",
    "import numpy as np\n\nclass Matrix:\n    def __init__(self",
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def engine(embedded_engine):
    eng = embedded_engine(512, device="cpu", dtype="float32", weights="exact")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(embedded_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        embedded_gguf.parent, gguf_file=embedded_gguf.name, dtype=torch.float32
    ).eval()


def run(engine, request):
    async def collect():
        return [event async for event in engine.generate(request)]

    return asyncio.run(collect())


def test_greedy_matches_transformers(engine, reference):
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        events = run(engine, GenerateRequest(ids, max_tokens=NEW_TOKENS))
        ours = [t for e in events if isinstance(e, TokenEvent) for t in e.ids]
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=len(ours) or 1, do_sample=False, top_k=None, top_p=None
            )
        theirs = out[0, len(ids):].tolist()
        final = events[-1]
        if final.finish_reason == "stop":  # we stopped on an end token that transformers also emits
            assert theirs[: len(ours) + 1] == ours + [final.stop], prompt
        else:
            assert theirs == ours, prompt
            assert final.finish_reason == "length"


def test_text_stream_and_timings(engine):
    ids = engine.tokenizer.encode("def add(a, b):")
    events = run(engine, GenerateRequest(ids, max_tokens=16))
    final = events[-1]
    assert isinstance(final, FinalEvent)
    generated = [t for e in events[:-1] for t in e.ids]
    assert "".join(e.text_delta for e in events[:-1]) == engine.tokenizer.decode(generated)
    # llama.cpp's semantics: prompt_n counts the prefilled tokens, cache_n those reused from the prefix cache.
    assert final.usage.prompt_tokens == len(ids) == final.timings.prompt_n + final.timings.cache_n
    assert final.usage.completion_tokens == len(generated) == final.timings.predicted_n
    assert final.timings.predicted_per_second > 0


def test_seeded_sampling_reproducible(engine):
    ids = engine.tokenizer.encode("Write a haiku about rust:")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    first = run(engine, GenerateRequest(ids, sampling=params, max_tokens=12))
    second = run(engine, GenerateRequest(ids, sampling=params, max_tokens=12))
    assert [e.ids for e in first[:-1]] == [e.ids for e in second[:-1]]


def test_stop_string(engine):
    ids = engine.tokenizer.encode("def fibonacci(n):")
    plain = run(engine, GenerateRequest(ids, max_tokens=24))
    text = "".join(e.text_delta for e in plain[:-1])
    stop = text[8:11]
    events = run(engine, GenerateRequest(ids, max_tokens=24, stop=StopCriteria(strings=(stop,))))
    assert events[-1].finish_reason == "stop" and events[-1].stop == stop
    assert "".join(e.text_delta for e in events[:-1]) == text[: text.index(stop)]


def test_stop_token_id(engine):
    ids = engine.tokenizer.encode("def fibonacci(n):")
    plain = run(engine, GenerateRequest(ids, max_tokens=8))
    generated = [t for e in plain[:-1] for t in e.ids]
    events = run(engine, GenerateRequest(ids, max_tokens=8, stop=StopCriteria(token_ids=frozenset({generated[3]}))))
    assert [t for e in events[:-1] for t in e.ids] == generated[: generated.index(generated[3])]
    assert events[-1].stop == generated[3]


def test_prompt_too_long(engine):
    with pytest.raises(ContextOverflowError, match="context holds 512"):
        run(engine, GenerateRequest([2] * 600, max_tokens=4))


def test_max_tokens_capped_by_context(engine):
    ids = engine.tokenizer.encode("x" * 10)
    events = run(engine, GenerateRequest(ids + [236743] * (510 - len(ids)), max_tokens=100))
    assert events[-1].finish_reason == "length"
    assert events[-1].usage.completion_tokens == 2


def test_cancel_stops_generation(engine):
    async def scenario():
        ids = engine.tokenizer.encode("Once upon a time")
        seen = 0
        async for event in engine.generate(GenerateRequest(ids, max_tokens=400, request_id="c1")):
            if isinstance(event, FinalEvent):
                return seen, event
            seen += 1
            if seen == 3:
                assert engine.cancel("c1")

    seen, final = asyncio.run(scenario())
    assert final.finish_reason == "cancelled"
    assert seen < 50


def test_concurrent_requests_do_not_mix(engine):
    prompts = ["def fibonacci(n):", "The capital of France is"]
    solo = [[t for e in run(engine, GenerateRequest(engine.tokenizer.encode(p), max_tokens=10))[:-1] for t in e.ids]
            for p in prompts]

    async def both():
        async def one(p):
            return [t async for e in engine.generate(GenerateRequest(engine.tokenizer.encode(p), max_tokens=10))
                    if isinstance(e, TokenEvent) for t in e.ids]
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(both()) == solo


def test_a_request_cancelled_during_prefill_stops_at_the_next_chunk(engine, monkeypatch):
    """A long prompt is minutes of prefill on a CPU: cancelled, the request stops at the next chunk with no
    tokens, and the next request (reusing what was computed) decodes what a fresh one does."""
    from dflash_agent.engine.decode import speculative

    monkeypatch.setattr(speculative, "PREFILL_CHUNK", 16)
    prefix = engine._scheduler.slots[0].prefix
    chunks: list[int] = []
    prefilled = prefix.prefilled

    def on_chunk(position, logits):
        chunks.append(position)
        prefilled(position, logits)
        if len(chunks) == 1:
            assert engine.cancel("long-prompt")

    monkeypatch.setattr(prefix, "prefilled", on_chunk)
    ids = engine.tokenizer.encode("Once upon a time, in a small village by the sea, " * 10)[:100]
    final = run(engine, GenerateRequest(ids, max_tokens=50, request_id="long-prompt"))[-1]
    assert final.finish_reason == "cancelled" and final.usage.completion_tokens == 0
    assert chunks == [16]
    monkeypatch.undo()
    again = run(engine, GenerateRequest(ids, max_tokens=6))
    fresh = run(engine, GenerateRequest(ids, max_tokens=6, cache_prompt=False))
    assert [t for e in again[:-1] for t in e.ids] == [t for e in fresh[:-1] for t in e.ids]


def test_a_long_request_logs_its_progress(engine, monkeypatch, caplog):
    """A 70 s prefill and 240 s of decoding logged nothing until the request ended: progress lines come every
    `progress_every_s` (here: at every chunk and token) with the request id and the counts."""
    from dflash_agent.engine.progress import progress_log

    monkeypatch.setattr(engine, "progress_every_s", 0.0)
    ids = engine.tokenizer.encode("Once upon a time")
    with caplog.at_level(logging.INFO, logger=progress_log.name):
        final = run(engine, GenerateRequest(ids, max_tokens=3, request_id="long-1", cache_prompt=False))[-1]
    lines = [r.getMessage() for r in caplog.records if r.name == progress_log.name]
    assert lines[0].startswith(f"long-1: prefill {len(ids)} / {len(ids)} tokens, ")
    generated = [line for line in lines[1:] if line.startswith("long-1: generated ")]
    assert len(generated) == final.usage.completion_tokens and "(at most 3)" in generated[-1]
