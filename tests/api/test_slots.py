"""serve --parallel: two requests at once through the official openai SDK, each answered as when alone, while GET
/slots and /metrics show both slots busy."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from dflash_agent.api.background import live_server
from dflash_agent.engine import SpecConfig

PROMPTS = ["1, 2, 3, 4, 5,", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def two_slots(embedded_engine):
    with live_server(lambda: embedded_engine(512, parallel=2, spec=SpecConfig(enabled=False))) as url:
        yield url


def _complete(client: openai.OpenAI, prompt: str, n: int) -> str:
    return client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0).choices[0].text


def test_two_streams_overlap_and_each_gets_its_own_answer(two_slots):
    client = openai.OpenAI(base_url=f"{two_slots}/v1", api_key="unused")
    alone = [_complete(client, p, 40) for p in PROMPTS]
    idle = httpx.get(f"{two_slots}/slots").json()
    assert [s["state"] for s in idle] == ["idle", "idle"] and idle[0]["n_ctx"] == 512

    seen: list[list[dict]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(httpx.get(f"{two_slots}/slots", params={"prompt": "true"}).json())

    async def both() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{two_slots}/v1", api_key="unused")
        answers = []
        for prompt in PROMPTS:
            answers.append(aclient.completions.create(model="m", prompt=prompt, max_tokens=40, temperature=0))
        return [r.choices[0].text for r in await asyncio.gather(*answers)]

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        together = asyncio.run(both())
    finally:
        done.set()
        watcher.join()
    assert together == alone
    busy = [snapshot for snapshot in seen if all(s["is_processing"] for s in snapshot)]
    assert busy, "the two requests never ran at the same time"
    assert all(s["id_task"] and s["prompt_ids"] and s["n_prompt_tokens"] == len(s["prompt_ids"]) for s in busy[-1])
    metrics = httpx.get(f"{two_slots}/metrics").text
    assert "dflash_slots 2.0" in metrics and "dflash_slots_busy 0.0" in metrics
    assert 'dflash_slot_tokens_per_second{slot="1"}' in metrics


def test_slots_hides_prompts_unless_asked(two_slots):
    assert all("prompt_ids" not in s or s["prompt_ids"] is None for s in httpx.get(f"{two_slots}/slots").json())


def test_claude_codes_title_request_is_answered_while_its_main_turn_runs(two_slots):
    """Claude Code sends its session-title request (a grammar-forced JSON object) beside the main turn: with two
    slots it is answered while the main turn is still prefilling or decoding, not after it."""
    import anthropic

    client = anthropic.Anthropic(base_url=two_slots, api_key="unused", max_retries=0, timeout=300)
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40}}, "required": ["title"],
              "additionalProperties": False}
    main_prompt = "Here is the repository layout:\n" + "".join(f"src/module_{i}.py\n" for i in range(30))
    spans: dict[str, tuple[float, float]] = {}

    def main_turn() -> None:
        started = time.monotonic()
        with client.messages.stream(model="m", max_tokens=60, messages=[{"role": "user", "content": main_prompt}],
                                    system="You are a coding agent.", extra_body={"temperature": 0}) as stream:
            stream.get_final_message()
        spans["main"] = (started, time.monotonic())

    runner = threading.Thread(target=main_turn)
    runner.start()
    while runner.is_alive() and not any(s["is_processing"] for s in httpx.get(f"{two_slots}/slots").json()):
        time.sleep(0.01)
    started = time.monotonic()
    title = client.messages.create(
        model="m", max_tokens=200, messages=[{"role": "user", "content": "list the files here\n\nWrite the title."}],
        extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    spans["title"] = (started, time.monotonic())
    runner.join()
    assert isinstance(json.loads(title.content[0].text)["title"], str)
    assert spans["main"][0] < spans["title"][0] and spans["title"][1] < spans["main"][1], spans
