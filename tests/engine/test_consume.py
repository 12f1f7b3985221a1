"""The one way to consume a generation: `Engine.complete` for the whole answer, `Engine.stream` for events as they
come. However a consumer stops (done, an early break, an exception, its task cancelled), the request is cancelled
then, not when a suspended generator happens to be collected."""

import asyncio
import threading

import pytest

from dflash_agent.engine import Engine, FinalEvent, GenerateRequest, GenerateResult, TokenEvent

pytestmark = pytest.mark.timeout(300)  # a request left holding the engine shows as a hang


@pytest.fixture(scope="module")
def engine(embedded_engine):
    eng = embedded_engine(256, device="cpu", dtype="float32", weights="exact")
    yield eng
    eng.close()


def request(engine, request_id="", max_tokens=200):
    return GenerateRequest(engine.tokenizer.encode("Once upon a time"), max_tokens=max_tokens, request_id=request_id)


def test_complete_is_the_drained_stream(engine):
    async def drained():
        return [event async for event in engine.generate(request(engine, max_tokens=12))]

    events = asyncio.run(drained())
    seen: list[TokenEvent] = []
    result = asyncio.run(engine.complete(request(engine, max_tokens=12), on_token=seen.append))
    assert isinstance(result, GenerateResult)
    assert result.ids == [t for e in events[:-1] for t in e.ids]
    assert result.text == "".join(e.text_delta for e in events[:-1])
    assert result.final.finish_reason == events[-1].finish_reason == "length"
    assert result.final.usage.completion_tokens == len(result.ids) == 12
    assert [t for e in seen for t in e.ids] == result.ids


def _job(engine, request_id):
    with engine._lock:
        return engine._jobs[request_id]


def test_leaving_the_stream_early_cancels_at_once(engine):
    async def scenario():
        async with engine.stream(request(engine, "early")) as events:
            async for event in events:
                job = _job(engine, "early")
                break
        return job

    job = asyncio.run(scenario())
    assert job.cancelled.is_set()
    # The abandoned request's last event goes to a closed loop; the engine's worker lives on and serves the next.
    assert asyncio.run(engine.complete(request(engine, max_tokens=2))).final.usage.completion_tokens == 2


def test_a_consumer_that_raises_cancels(engine):
    async def scenario():
        jobs = []
        with pytest.raises(RuntimeError, match="the client went away"):
            async with engine.stream(request(engine, "raises")) as events:
                async for event in events:
                    jobs.append(_job(engine, "raises"))
                    raise RuntimeError("the client went away")
        return jobs[0]

    assert asyncio.run(scenario()).cancelled.is_set()


def test_an_on_token_that_raises_cancels_complete(engine):
    jobs = []

    def on_token(event):
        jobs.append(_job(engine, "on-token"))
        raise KeyError("boom")

    with pytest.raises(KeyError):
        asyncio.run(engine.complete(request(engine, "on-token"), on_token))
    assert jobs[0].cancelled.is_set()


def test_cancelling_the_task_cancels_complete(engine):
    async def scenario():
        jobs = []
        first = asyncio.Event()

        def on_token(event):
            if not jobs:
                jobs.append(_job(engine, "task"))
                first.set()

        task = asyncio.create_task(engine.complete(request(engine, "task"), on_token))
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return jobs[0]

    assert asyncio.run(scenario()).cancelled.is_set()


def test_a_finished_stream_leaves_nothing_running(engine):
    async def scenario():
        async with engine.stream(request(engine, "done", max_tokens=4)) as events:
            return [event async for event in events]

    events = asyncio.run(scenario())
    assert isinstance(events[-1], FinalEvent) and events[-1].finish_reason == "length"
    # The engine still serves the next request (nothing was left holding it).
    assert asyncio.run(engine.complete(request(engine, max_tokens=2))).final.usage.completion_tokens == 2


class _Generator:
    """A stand-in for `Engine.generate` that records whether it was closed: the contract `stream` relies on."""

    def __init__(self):
        self.closed = False

    async def generate(self, request):
        try:
            for i in range(100):
                yield TokenEvent([i], "x")
        finally:
            self.closed = True


def test_stream_closes_the_generator_it_opened():
    fake = _Generator()

    async def scenario():
        async with Engine.stream(fake, None) as events:
            async for _ in events:
                break
        return fake.closed

    # Without the context manager, a generator abandoned by `break` stays open until collected.
    assert asyncio.run(scenario()) is True


def test_close_waits_for_the_step_in_flight(embedded_engine, monkeypatch):
    """A worker inside a step cannot be stopped; close says so until the step ends (a process that ended under it
    would abort: options.close_engine)."""
    eng = embedded_engine(256, device="cpu", dtype="float32", weights="exact")
    entered, release = threading.Event(), threading.Event()
    runner = type(eng.runner)
    forward = runner.forward_groups

    def held(self, *args, **kwargs):
        entered.set()
        release.wait(60)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(runner, "forward_groups", held)
    results = []
    worker = threading.Thread(target=lambda: results.append(asyncio.run(eng.complete(request(eng, max_tokens=50)))))
    worker.start()
    assert entered.wait(60)
    assert not eng.close(timeout=0.2)  # still inside the step
    release.set()
    assert eng.close(timeout=60)
    worker.join(60)
    assert results[0].final.finish_reason == "cancelled"
