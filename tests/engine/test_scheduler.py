"""engine.scheduler: several requests at once on the embedded model (the C layers), each one's greedy output what it
is alone, whatever runs beside it: mixed prompt and output lengths, a prompt past the sliding window, prefix-cache
hits, cancellations and a grammar-constrained request, with speculation and without."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from dflash_agent.engine import FinalEvent, GenerateRequest, SamplingParams, SpecConfig, TokenEvent
from dflash_agent.engine.decode.grammar import GrammarCompiler
from dflash_agent.engine.engine import Engine
from dflash_agent.engine.model.gemma import GemmaModel
from dflash_agent.engine.model.packed import cpu_dot
from dflash_agent.engine.runner import StepRunner

GREEDY = SamplingParams(temperature=0.0)
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
          "required": ["path", "limit"], "additionalProperties": False}
CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"


def _requests(engine: Engine) -> list[tuple[GenerateRequest, int | None]]:
    """(request, tokens after which its consumer leaves: a cancellation), eight of mixed lengths."""
    encode = engine.tokenizer.encode
    story = "Once upon a time, in a small village by the sea, there lived an old fisherman. " * 40
    grammar = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size).json_schema(SCHEMA)
    specs = [
        (encode(CODE * 3 + "def factorial(n):"), 48, None, None),  # copies its prompt: long lookup drafts
        (encode("The capital of France is"), 12, None, None),
        (encode(story)[:700], 24, None, None),  # past the 512-token sliding window
        (encode(CODE * 3 + "def factorial(n):"), 40, None, None),  # the same prompt: a prefix-cache hit
        (encode("import numpy as np\n\nclass Matrix:\n    def __init__(self"), 64, None, 5),  # cancelled
        (encode('Arguments as JSON: {"path": "src/main.py", "limit": 20}\nArguments as JSON:'), 40, grammar, None),
        (encode(story)[:300] + encode(" The end."), 16, None, 2),  # cancelled early, shares the story's start
        (encode("1, 2, 3, 4, 5,"), 30, None, None),
    ]
    return [(GenerateRequest(ids, GREEDY, max_tokens=n, grammar=g, request_id=f"r{i}"), leave)
            for i, (ids, n, g, leave) in enumerate(specs)]


async def _collect(engine: Engine, request: GenerateRequest, leave: int | None) -> list[int]:
    ids: list[int] = []
    async with engine.stream(request) as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                ids.extend(event.ids)
                if leave is not None and len(ids) >= leave:
                    break
    return ids


@pytest.fixture(scope="module", params=["spec", "no-spec"])
def engines(request, embedded_engine):
    spec = SpecConfig(enabled=request.param == "spec")
    alone = embedded_engine(1024, spec=spec)
    slots = embedded_engine(1024, spec=spec, parallel=4)
    yield alone, slots
    alone.close()
    slots.close()


@pytest.mark.skipif(cpu_dot() is None, reason="no C compiler: the CPU kernels cannot be built")
def test_eight_concurrent_requests_each_give_what_they_give_alone(engines, monkeypatch):
    alone, slots = engines
    expected = []
    for request, leave in _requests(alone):
        expected.append(asyncio.run(_collect(alone, request, leave)))
    assert all(expected) and len(expected[5]) > 3

    steps: list[int] = []
    forward_groups = StepRunner.forward_groups
    monkeypatch.setattr(StepRunner, "forward_groups",
                        lambda self, groups, capture=(): steps.append(len(groups)) or forward_groups(self, groups,
                                                                                                     capture))

    async def together():
        return await asyncio.gather(*(_collect(slots, r, leave) for r, leave in _requests(slots)))

    got = asyncio.run(together())
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"request {i}"
    assert max(steps) == 4  # four requests' rows went through single forwards
    assert slots.prefix_stats.hits >= 1
    deadline = time.monotonic() + 5  # a consumer that left is ended at the scheduler's next turn
    while any(s.state != "idle" for s in slots.slots) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(s.state == "idle" for s in slots.slots) and slots.queued == 0
    # a second round, now from the prefix cache of whichever slot holds each conversation
    got = asyncio.run(together())
    assert got == expected
    assert slots.prefix_stats.cached_tokens > alone.prefix_stats.cached_tokens // 2


RULES = "Rules for the agent: read a file before editing it, run the tests after each change, keep diffs small. "


async def _final(engine: Engine, request: GenerateRequest) -> tuple[list[int], FinalEvent]:
    ids: list[int] = []
    async with engine.stream(request) as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                ids.extend(event.ids)
            else:
                return ids, event
    raise AssertionError("no final event")


@pytest.mark.skipif(cpu_dot() is None, reason="no C compiler: the CPU kernels cannot be built")
def test_requests_that_start_alike_prefill_the_start_once(engines):
    """Two sub-agents with one long system prompt, sent together: the second waits for the first's chunks over
    their common start and restores them from its caches (with the drafter's context, speculating), so the start is
    prefilled once; each output is what it is alone."""
    alone, slots = engines
    system = slots.tokenizer.encode(RULES * 60)[:700]  # a chunk ends at 512 inside it
    prompts = [system + slots.tokenizer.encode(f" Task {i}: list the files you would read first.") for i in (1, 2)]

    def request(ids, rid):
        return GenerateRequest(ids, GREEDY, max_tokens=12, request_id=rid)

    expected = [asyncio.run(_final(alone, request(ids, f"alone{i}")))[0] for i, ids in enumerate(prompts)]
    lent = slots.prefix_stats.lent

    async def together():
        return await asyncio.gather(*(_final(slots, request(ids, f"agent{i}")) for i, ids in enumerate(prompts)))

    got = asyncio.run(together())
    assert [ids for ids, _ in got] == expected
    prefilled = [final.timings.prompt_n for _, final in got]
    assert sum(prefilled) <= sum(map(len, prompts)) - 512  # the common start's chunk once, not twice
    assert max(final.timings.cache_n for _, final in got) >= 512 and slots.prefix_stats.lent == lent + 1


def test_a_request_waiting_for_another_s_chunks_outlives_its_cancellation(embedded_engine, monkeypatch):
    """The request whose chunks two others wait for is cancelled before they get there: one of them prefills its
    prompt itself, and its output is what it is alone; the other, cancelled while it waits, just ends."""
    engine = embedded_engine(2048, spec=SpecConfig(enabled=False), parallel=3)
    try:
        system = engine.tokenizer.encode(RULES * 60)[:1100]
        prompts = [system + engine.tokenizer.encode(f" Task {i}: say which tests you would run.") for i in (1, 2, 3)]

        def request(ids, rid, cache=True):
            return GenerateRequest(ids, GREEDY, max_tokens=10, request_id=rid, cache_prompt=cache)

        expected = asyncio.run(_final(engine, request(prompts[1], "alone", cache=False)))[0]
        # held inside the first request's first chunk (the others arrive then), and inside its second (before the
        # chunk end the others wait for)
        events = [(threading.Event(), threading.Event()) for _ in range(2)]
        for start, (reached, go) in zip((0, 512), events, strict=True):
            _pause_in_chunk(monkeypatch, engine.model, start, reached, go)

        async def scenario():
            first = asyncio.create_task(_final(engine, request(prompts[0], "first")))
            assert await asyncio.to_thread(events[0][0].wait, 60)
            others = [asyncio.create_task(_final(engine, request(ids, rid)))
                      for ids, rid in ((prompts[1], "second"), (prompts[2], "third"))]
            while engine.queued < 2:
                await asyncio.sleep(0.002)
            events[0][1].set()
            assert await asyncio.to_thread(events[1][0].wait, 60)
            assert [s.state for s in engine.slots] == ["prefilling"] * 3  # admitted, and waiting
            assert sorted(s.prefilled_tokens for s in engine.slots) == [0, 0, 512]
            assert engine.cancel("first") and engine.cancel("third")
            events[1][1].set()
            assert (await first)[1].finish_reason == (await others[1])[1].finish_reason == "cancelled"
            return await others[0]

        ids, final = asyncio.run(scenario())
        assert ids == expected and final.finish_reason == "length"
        assert final.timings.prompt_n + final.timings.cache_n == len(prompts[1])
        assert all(s.state == "idle" for s in engine.slots)
    finally:
        engine.close()


def test_a_cancelled_waiting_request_never_takes_a_slot_and_slots_are_reported(embedded_engine):
    engine = embedded_engine(512, spec=SpecConfig(enabled=False), parallel=2)
    try:
        prompt = engine.tokenizer.encode("1, 2, 3, 4, 5,")

        async def scenario():
            long = [asyncio.create_task(_collect(engine, GenerateRequest(prompt, GREEDY, max_tokens=60,
                                                                          request_id=f"long{i}"), None))
                    for i in range(2)]
            while sum(s.state == "decoding" for s in engine.slots) < 2:
                await asyncio.sleep(0.01)
            info = engine.slots
            assert {s.request_id for s in info} == {"long0", "long1"}
            assert all(s.prompt_tokens == len(prompt) and s.generated_tokens >= 1 for s in info)
            waiting = asyncio.create_task(_collect(engine, GenerateRequest(prompt, GREEDY, max_tokens=5,
                                                                            request_id="waiting"), None))
            while engine.queued == 0:
                await asyncio.sleep(0.005)
            assert engine.cancel("waiting")
            started = time.perf_counter()
            assert await waiting == []
            assert time.perf_counter() - started < 5  # ended while both slots were still busy
            assert all(len(ids) == 60 for ids in await asyncio.gather(*long))

        asyncio.run(scenario())
        assert [s.state for s in engine.slots] == ["idle", "idle"]
    finally:
        engine.close()


def test_parallel_none_is_four_slots_on_the_cpu_and_zero_is_refused():
    from dflash_agent.engine import OptionError

    engine = Engine.load(ctx_size=256, progress=False, parallel=None)  # what serve passes without --parallel
    try:
        assert engine.parallel == 4 and len(engine.slots) == 4
    finally:
        engine.close()
    with pytest.raises(OptionError, match="parallel must be >= 1"):
        Engine.load(ctx_size=256, progress=False, parallel=0)


def _pause_in_chunk(monkeypatch, model: GemmaModel, start: int, reached: threading.Event, go: threading.Event) -> None:
    """Hold the worker after the first layer of the prompt chunk at position `start` (one that runs a layer at a
    time) until `go`: a test then knows that what it does meanwhile happens in the middle of that chunk."""
    layer_steps = model.layer_steps
    paused = []

    def held(x, plan, kv, capture=(), per_layer=None):
        steps = layer_steps(x, plan, kv, capture, per_layer)
        if paused or x.shape[-2] == 1 or int(plan.positions[0]) != start:
            return (yield from steps)
        paused.append(True)
        done = next(steps)
        reached.set()
        assert go.wait(60)
        yield done
        return (yield from steps)

    monkeypatch.setattr(model, "layer_steps", held)  # the model is the session's: the test's end restores it


@pytest.mark.parametrize("cancel", [False, True], ids=["arrival", "cancelled-inside-a-chunk"])
def test_a_request_arriving_inside_a_long_chunk_goes_first_and_nothing_changes(cancel, embedded_engine, monkeypatch):
    """A short request that arrives while a long prompt chunk runs gets its first token before that chunk ends (the
    chunk runs a layer at a time and the scheduler admits it between two layers); the long request's output is
    what it is alone. A request cancelled inside a chunk ends when that chunk does: the prefix cache keeps the
    chunks done, and the next request from them is right too."""
    engine = embedded_engine(2048, spec=SpecConfig(enabled=False), parallel=2)
    try:
        story = "Once upon a time, in a small village by the sea, there lived an old fisherman. " * 40
        long_ids = engine.tokenizer.encode(story * 2)[:1100]
        assert len(long_ids) == 1100  # chunks of 512, 512 and 76 tokens; the first two run a layer at a time
        short_ids = engine.tokenizer.encode("The capital of France is")

        def request(ids, n, rid, cache=False):
            return GenerateRequest(ids, GREEDY, max_tokens=n, request_id=rid, cache_prompt=cache)

        alone_long = asyncio.run(_collect(engine, request(long_ids, 12, "alone-long"), None))
        alone_short = asyncio.run(_collect(engine, request(short_ids, 6, "alone-short"), None))
        reached, go = threading.Event(), threading.Event()
        # cancelled: inside the second chunk, whose keys take ring slots the first one's window held
        _pause_in_chunk(monkeypatch, engine.model, 512 if cancel else 0, reached, go)

        async def scenario():
            long = asyncio.create_task(_collect(engine, request(long_ids, 12, "long", cache=cancel), None))
            assert await asyncio.to_thread(reached.wait, 60)
            if cancel:
                assert engine.cancel("long")
                go.set()
                assert await long == []
                reused: list[int] = []
                again = request(long_ids, 12, "again", cache=True)
                again.on_prefix = reused.append
                ids = await _collect(engine, again, None)
                assert reused == [1024]  # the chunk it was cancelled inside included
                return ids
            first: list[int] = []

            async def short():
                async with engine.stream(request(short_ids, 6, "short")) as events:
                    ids = []
                    async for event in events:
                        if isinstance(event, TokenEvent) and event.ids:
                            if not ids:  # the long prompt's first chunk is not in yet
                                first.extend(s.prefilled_tokens for s in engine.slots if s.request_id == "long")
                            ids.extend(event.ids)
                    return ids

            arriving = asyncio.create_task(short())
            while engine.queued == 0 and not arriving.done():
                await asyncio.sleep(0.002)
            go.set()
            assert await arriving == alone_short
            assert first == [0]
            return await long

        assert asyncio.run(scenario()) == alone_long
    finally:
        engine.close()


def test_the_loading_thread_and_an_idle_worker_give_back_their_openmp_threads(monkeypatch):
    """Only the thread running the kernels keeps OpenMP threads: with more than the cores, libgomp stops spinning
    and every parallel region of a step pays a wake-up. The thread that built the engine gives its threads back
    before the worker starts, and the worker gives back its own whenever it waits for work."""
    from dflash_agent.engine import engine as engine_module
    from dflash_agent.engine import scheduler as scheduler_module

    calls: list[str] = []

    def record(device):
        assert device.type == "cpu"
        calls.append(threading.current_thread().name)

    monkeypatch.setattr(engine_module, "release_cpu_threads", record)
    monkeypatch.setattr(scheduler_module, "release_cpu_threads", record)
    engine = Engine.load(ctx_size=256, progress=False, spec=SpecConfig(enabled=False))
    try:
        def idle_calls(n: int) -> list[str]:  # the worker waits for work after the request's last event
            deadline = time.monotonic() + 5
            while len(calls) < n and time.monotonic() < deadline:
                time.sleep(0.01)
            return calls

        assert idle_calls(2) == [threading.current_thread().name, "dflash-engine"]
        prompt = engine.tokenizer.encode("1, 2, 3,")
        for n in (3, 4):
            asyncio.run(_collect(engine, GenerateRequest(prompt, GREEDY, max_tokens=4), None))
            assert idle_calls(n)[2:] == ["dflash-engine"] * (n - 2)
    finally:
        engine.close()


def test_the_thread_count_leaves_a_count_that_slows_down_and_takes_it_back_when_it_pays():
    """Quiet, two threads decode faster; with a core taken by another process, one thread does; the count follows
    within a few steps when its own count slows down, and by exploring when the other would pay again."""
    from dflash_agent.engine.backends.thread_count import ThreadArm, ThreadCount

    counts = ThreadCount(None, 2, torch_follows=True)  # choose / record only: no kernels called
    seconds = {2: 0.010, 1: 0.016}

    def play(steps: int) -> list[int]:
        picks = []
        for _ in range(steps):
            n = counts.choose(1)
            counts.record(1, n, seconds[n])
            picks.append(n)
        return picks

    quiet = play(300)
    assert quiet[:4] == [2, 2, 1, 1] and quiet[10:].count(2) / len(quiet[10:]) > 0.97
    seconds[2] = 0.040  # a core gets busy: two threads wait on each other
    busy = play(300)
    assert busy[10:].count(1) / len(busy[10:]) > 0.97
    seconds[2] = 0.010  # free again: found by exploring, then kept
    back = play(1000)
    assert back[-100:].count(2) > 95
    # verification blocks are learnt apart from decode steps
    assert counts.choose(65) == 2 and counts.bandit.samples(ThreadArm(2, 2)) == 0
    # a prompt chunk takes the count the steps measured most favour: all the threads until both are measured
    assert ThreadCount(None, 2, torch_follows=True).preferred() == 2
    seconds[2] = 0.040
    play(20)
    assert counts.preferred() == 1


@pytest.mark.skipif(cpu_dot() is None, reason="no C compiler: the CPU kernels cannot be built")
def test_torch_runs_on_the_count_chosen_only_where_the_kernels_do_every_product():
    from dflash_agent.engine.backends.thread_count import ThreadCount

    seen, threads = [], torch.get_num_threads()
    try:
        for follows in (True, False):
            ThreadCount(cpu_dot(), 2, torch_follows=follows).on(
                1, lambda: seen.append((torch.get_num_threads(), cpu_dot().threads())))
    finally:
        torch.set_num_threads(threads)
    assert seen == [(1, 1), (2, 1)]


@pytest.mark.skipif(cpu_dot() is None, reason="no C compiler: the CPU kernels cannot be built")
def test_a_prompt_gives_the_same_bits_on_the_counts_a_step_may_take(embedded_engine):
    """ThreadCount runs a prompt chunk's kernels, and where they do every product its torch ops (attention, norms),
    on the count it picks: a request's output must not depend on how busy the cores were. Machines differ in which
    dtype the prompt GEMMs take (prefill_dtype), so this checks the engine's own choice."""
    from dflash_agent.engine.backends.thread_count import ThreadCount
    from dflash_agent.engine.model.packed import products_in_c

    engine = embedded_engine(1024, device="cpu")
    engine.close()
    model = engine.model
    ids = torch.tensor(engine.tokenizer.encode(CODE * 12)[:600])
    threads, logits = torch.get_num_threads(), {}
    thread_count = ThreadCount(cpu_dot(), max(2, threads), products_in_c(model.matmul_weights(experts=True)))

    def prompt(n: int) -> None:
        cache = model.new_cache(1024, "model")
        with torch.inference_mode():
            logits[n] = torch.cat([model.forward(ids[a:a + 512], cache,
                                                 logits_at=torch.arange(min(512, len(ids) - a))).logits
                                   for a in range(0, len(ids), 512)])

    try:
        for n in thread_count.counts:
            thread_count.on(n, lambda n=n: prompt(n))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*logits.values())
