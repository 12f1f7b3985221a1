"""How parsed deltas become OpenAI chunks and Anthropic events: reasoning, text, several tool calls and
text after them, fed from a scripted source (the model-facing side is covered by the live-server tests)."""

from __future__ import annotations

import asyncio
import json

from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from openai.types.chat import ChatCompletionChunk
from pydantic import TypeAdapter

from dflash_agent.api.anthropic_routes import _message_events
from dflash_agent.api.metrics import ServerMetrics
from dflash_agent.api.openai_routes import _chat_chunks
from dflash_agent.api.service import Generation
from dflash_agent.chat.parser import ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart
from dflash_agent.engine import FinalEvent, Timings, Usage

SCRIPT = [
    ReasoningDelta("Let me "), ReasoningDelta("look."),
    TextDelta("Reading two files."),
    ToolCallStart(0, "call_a", "read_file"), ToolCallArgsDelta(0, '{"path":'), ToolCallArgsDelta(0, ' "a.py"}'),
    ToolCallStart(1, "call_b", "read_file"), ToolCallArgsDelta(1, '{"path": "b.py"}'),
    TextDelta("Done."),
    FinalEvent("stop", Usage(20, 12, cached_tokens=15), Timings(cache_n=15, prompt_n=5, predicted_n=12,
                                                                 draft_n=6, draft_n_accepted=4)),
]


async def _script():
    for event in SCRIPT:
        yield event


def _collect(make_stream) -> list[bytes]:
    async def run() -> list[bytes]:
        released = []
        generation = Generation(_script(), lambda: released.append(True), "test", ServerMetrics(), heartbeat_s=10)
        out = [chunk async for chunk in make_stream(generation)]
        await asyncio.sleep(0)
        assert released == [True]
        return out

    return asyncio.run(run())


def test_openai_chunks():
    raw = _collect(lambda g: _chat_chunks(g, "chatcmpl-1", 0, "m", include_usage=True))
    assert raw[-1] == b"data: [DONE]\n\n"
    chunks = [ChatCompletionChunk.model_validate(json.loads(line[6:])) for line in raw[:-1]]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Let me look."
    assert "".join(d.content or "" for d in deltas) == "Reading two files.Done."
    calls: dict[int, dict] = {}
    for d in deltas:
        for t in d.tool_calls or []:
            call = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "args": ""})
            call["args"] += t.function.arguments or ""
    assert calls == {0: {"id": "call_a", "name": "read_file", "args": '{"path": "a.py"}'},
                     1: {"id": "call_b", "name": "read_file", "args": '{"path": "b.py"}'}}
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in final] == ["tool_calls"]
    timings = final[0].model_extra["timings"]
    assert (timings["cache_n"], timings["prompt_n"], timings["draft_n"], timings["draft_n_accepted"]) == (15, 5, 6, 4)
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == 15


def test_anthropic_events():
    raw = _collect(lambda g: _message_events(g, "msg_1", "m", 20, [15], ()))  # the engine said: 15 cached
    adapter = TypeAdapter(RawMessageStreamEvent)
    events = []
    for block in b"".join(raw).decode().strip().split("\n\n"):
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        if payload["type"] != "ping":
            adapter.validate_python(payload)  # the SDK's own event types accept every event
        events.append(payload)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use", "tool_use", "text"]
    # Each block opens, takes its deltas and closes before the next opens, with increasing indices.
    open_index = None
    for e in events:
        if e["type"] == "content_block_start":
            assert open_index is None
            open_index = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index
            open_index = None
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1, 2, 3, 4]
    inputs = {}
    for e in events:
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            inputs[e["index"]] = inputs.get(e["index"], "") + e["delta"]["partial_json"]
    assert {i: json.loads(v) for i, v in inputs.items()} == {2: {"path": "a.py"}, 3: {"path": "b.py"}}
    signature = [e for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "signature_delta"]
    assert len(signature) == 1 and signature[0]["index"] == 0
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"] == {"input_tokens": 5, "output_tokens": 12, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 15}
    # message_start splits the prompt the same way, so a client adding the two counts each token once
    start = events[0]["message"]["usage"]
    assert start == {"input_tokens": 5, "output_tokens": 0, "cache_creation_input_tokens": 0,
                     "cache_read_input_tokens": 15}
    assert [e["type"] for e in events][-1] == "message_stop"


# --- keep-alives while the model is busy -------------------------------------------------------------------------

HEARTBEAT_S = 0.02


async def _slow(cached: list[int], queued_s: float, prefill_s: float):
    """The engine's side of a slow request: queued behind others for `queued_s`, then told what its prefix cache
    serves (the on_prefix callback) and prefilling for `prefill_s` before the first token."""
    await asyncio.sleep(queued_s)
    cached.append(15)
    await asyncio.sleep(prefill_s)
    for event in SCRIPT:
        yield event


def _slow_stream(make_stream, cached: list[int], queued_s: float, prefill_s: float) -> list[bytes]:
    async def run() -> list[bytes]:
        generation = Generation(_slow(cached, queued_s, prefill_s), lambda: None, "test", ServerMetrics(),
                                heartbeat_s=HEARTBEAT_S)
        return [chunk async for chunk in make_stream(generation)]

    return asyncio.run(run())


def test_anthropic_stream_pings_while_a_long_prompt_prefills():
    """Anthropic's keep-alive is a ping event, which comes after message_start: message_start goes out as soon as
    the engine has taken the request, so a long prefill shows pings (SSE comments only while it is queued)."""
    cached: list[int] = []
    raw = _slow_stream(lambda g: _message_events(g, "msg_1", "m", 20, cached, ()), cached, 0.2, 0.4)
    blocks = b"".join(raw).decode().strip().split("\n\n")
    comments = [b for b in blocks if b.startswith(":")]
    events = [json.loads(b.split("\n")[1].removeprefix("data: ")) for b in blocks if not b.startswith(":")]
    kinds = [e["type"] for e in events]
    assert comments and all(b == ": ping" for b in comments)
    assert blocks.index(comments[-1]) < blocks.index(next(b for b in blocks if b.startswith("event: message_start")))
    first_block = kinds.index("content_block_start")
    assert kinds[0] == "message_start" and kinds[1:first_block].count("ping") >= 3
    assert set(kinds[1:first_block]) == {"ping"}
    assert events[0]["message"]["usage"]["cache_read_input_tokens"] == 15
    snapshot, buffers = None, {}  # the SDK's own accumulation (it skips pings) refuses events out of order
    for event in (e for e in events if e["type"] != "ping"):
        snapshot = accumulate_event(event=TypeAdapter(RawMessageStreamEvent).validate_python(event),
                                    current_snapshot=snapshot, json_bufs=buffers)
    assert [b.type for b in snapshot.content] == ["thinking", "text", "tool_use", "tool_use", "text"]


def test_a_prefill_longer_than_claude_codes_idle_timer_sends_message_deltas_that_change_nothing():
    """Claude Code restarts its stream idle timer on every event but ping: until the first block a message_delta
    with no stop reason comes every keepalive_s, none after; the SDK's accumulation ends with the same message."""
    cached: list[int] = []
    raw = _slow_stream(lambda g: _message_events(g, "msg_1", "m", 20, cached, (), keepalive_s=0.1), cached, 0.0, 0.5)
    events = [json.loads(b.split("\n")[1].removeprefix("data: "))
              for b in b"".join(raw).decode().strip().split("\n\n") if not b.startswith(":")]
    kinds = [e["type"] for e in events]
    first_block = kinds.index("content_block_start")
    keepalives = [e for e in events[:first_block] if e["type"] == "message_delta"]
    assert 2 <= len(keepalives) <= 6 and kinds[first_block:].count("message_delta") == 1
    assert all(e["delta"] == {"stop_reason": None, "stop_sequence": None} and e["usage"] == {"output_tokens": 0}
               for e in keepalives)
    snapshot, buffers = None, {}
    for event in (e for e in events if e["type"] != "ping"):
        snapshot = accumulate_event(event=TypeAdapter(RawMessageStreamEvent).validate_python(event),
                                    current_snapshot=snapshot, json_bufs=buffers)
    whole, whole_buffers = None, {}
    plain = _collect(lambda g: _message_events(g, "msg_1", "m", 20, [15], ()))
    for block in b"".join(plain).decode().strip().split("\n\n"):
        event = json.loads(block.split("\n")[1].removeprefix("data: "))
        if event["type"] != "ping":
            whole = accumulate_event(event=TypeAdapter(RawMessageStreamEvent).validate_python(event),
                                     current_snapshot=whole, json_bufs=whole_buffers)
    assert snapshot.model_dump() == whole.model_dump() and snapshot.stop_reason == "tool_use"


def test_openai_stream_sends_comments_while_a_long_prompt_prefills():
    cached: list[int] = []
    raw = _slow_stream(lambda g: _chat_chunks(g, "chatcmpl-1", 0, "m", include_usage=False), cached, 0.0, 0.4)
    first_content = next(i for i, chunk in enumerate(raw) if b'"reasoning_content"' in chunk)
    assert raw[0].startswith(b"data: ") and raw[1:first_content].count(b": ping\n\n") >= 3
    assert set(raw[1:first_content]) == {b": ping\n\n"}
