"""One canonical Finish, named by each dialect's table: every value has a name in every dialect, the names are the
wire's, and the whole and the streamed response of each dialect both say it (no model needed)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import msgspec
import pytest

from dflash_agent.api.anthropic_routes import Messages
from dflash_agent.api.anthropic_schema import MessagesRequest
from dflash_agent.api.metrics import ServerMetrics
from dflash_agent.api.openai_routes import ChatCompletions, Completions
from dflash_agent.api.openai_schema import ChatCompletionRequest, CompletionRequest
from dflash_agent.api.pipeline import Call, Dialect, Limit, Reply, Sampling
from dflash_agent.api.responses_routes import Responses, ResponseStore
from dflash_agent.api.responses_schema import ResponsesRequest
from dflash_agent.api.service import Generation
from dflash_agent.chat.chat_format import ChatOptions
from dflash_agent.chat.finish import Finish
from dflash_agent.chat.parser import ParsedOutput, TextDelta, ToolCallArgsDelta, ToolCallStart
from dflash_agent.chat.types import Conversation, Message, TextPart, ToolCall
from dflash_agent.engine import FinalEvent, SamplingParams, Timings, TokenEvent, Usage

F = Finish
WIRE = {  # dialect -> Finish -> what its wire says
    ChatCompletions: {F.STOP: "stop", F.STOP_SEQUENCE: "stop", F.LENGTH: "length", F.CONTEXT_FULL: "length",
                      F.TOOL_CALLS: "tool_calls", F.CANCELLED: "stop"},
    Completions: {F.STOP: "stop", F.STOP_SEQUENCE: "stop", F.LENGTH: "length", F.CONTEXT_FULL: "length",
                  F.TOOL_CALLS: "tool_calls", F.CANCELLED: "stop"},
    Messages: {F.STOP: "end_turn", F.STOP_SEQUENCE: "stop_sequence", F.LENGTH: "max_tokens",
               F.CONTEXT_FULL: "model_context_window_exceeded", F.TOOL_CALLS: "tool_use", F.CANCELLED: "end_turn"},
    Responses: {F.STOP: "completed", F.STOP_SEQUENCE: "completed", F.LENGTH: "incomplete",
                F.CONTEXT_FULL: "incomplete", F.TOOL_CALLS: "completed", F.CANCELLED: "completed"},
}


def test_every_dialect_names_every_finish():
    """A new Finish value, or a new dialect, without its names fails here."""
    dialects = set()
    todo = list(Dialect.__subclasses__())
    while todo:
        dialects.add(cls := todo.pop())
        todo += cls.__subclasses__()
    assert dialects == set(WIRE)
    for dialect in dialects:
        assert set(dialect.finish_names) == set(Finish), dialect.__name__


@pytest.mark.parametrize("dialect", list(WIRE), ids=lambda d: d.__name__)
def test_each_finish_has_the_wire_name(dialect):
    assert dict(dialect.finish_names) == WIRE[dialect]


U = Usage(20, 12, cached_tokens=15)
CASES = [  # (final event, whether the answer holds a tool call) -> the canonical Finish
    (FinalEvent("stop", U, Timings(), stop=1), False, F.STOP),
    (FinalEvent("stop", U, Timings(), stop="END"), False, F.STOP_SEQUENCE),
    (FinalEvent("stop", U, Timings(), stop="END"), True, F.TOOL_CALLS),
    (FinalEvent("length", U, Timings()), False, F.LENGTH),
    (FinalEvent("length", U, Timings()), True, F.LENGTH),  # a call cut by the limit is not one to run
    (FinalEvent("length", U, Timings(), context_full=True), True, F.CONTEXT_FULL),
    (FinalEvent("cancelled", U, Timings()), False, F.CANCELLED),
    (FinalEvent("stop", U, Timings(), stop=1), True, F.TOOL_CALLS),
]
STOP = ("END",)


@pytest.mark.parametrize("final, called, finish", CASES)
def test_canonical_finish(final, called, finish):
    assert Finish.of(final, called, STOP) is finish


def test_a_stop_string_the_request_did_not_send_is_no_stop_sequence():
    assert Finish.of(FinalEvent("stop", U, Timings(), stop="END"), False, ()) is F.STOP


def _reply(called: bool, stream: bool) -> Reply:
    out = ParsedOutput("Hi", None, [ToolCall("call_1", "f", {})] if called else [])
    model = SimpleNamespace(name="m", engine=SimpleNamespace(tokenizer=SimpleNamespace(encode=list)))
    call = Call(Conversation([Message(role="user", content=[TextPart("x")])]), Sampling(), Limit(None), stream,
                ChatOptions(), STOP)
    return Reply("id", 0, model, call, SamplingParams(), 20, SimpleNamespace(result=lambda: out), [])


def _events(called: bool, final: FinalEvent) -> list:
    calls = [ToolCallStart(0, "call_1", "f"), ToolCallArgsDelta(0, "{}")] if called else []
    return [TextDelta("Hi"), *calls, final]


def _streamed(dialect: Dialect, body, reply: Reply, events: list) -> list[dict]:
    async def source():
        for event in events:
            yield event

    async def run() -> list[bytes]:
        generation = Generation(source(), lambda: None, "test", ServerMetrics(), heartbeat_s=10)
        return [frame async for frame in dialect.stream(body, reply, generation)]

    datas = [line[6:] for frame in asyncio.run(run()) for line in frame.decode().split("\n")
             if line.startswith("data: ") and line != "data: [DONE]"]
    return [json.loads(d) for d in datas]


BODIES = {
    ChatCompletions: msgspec.convert({"messages": []}, ChatCompletionRequest),
    Completions: msgspec.convert({"prompt": "x"}, CompletionRequest),
    Messages: msgspec.convert({"max_tokens": 5, "messages": []}, MessagesRequest),
    Responses: msgspec.convert({"input": "x", "store": False}, ResponsesRequest),
}


def _said(dialect: type[Dialect], whole: dict, streamed: list[dict]) -> tuple[str, str]:
    """The finish each form of the response says."""
    if dialect is Messages:
        return whole["stop_reason"], next(e for e in streamed if e["type"] == "message_delta")["delta"]["stop_reason"]
    if dialect is Responses:
        return whole["status"], streamed[-1]["response"]["status"]
    return whole["choices"][0]["finish_reason"], next(
        c["choices"][0]["finish_reason"] for c in streamed if c["choices"] and c["choices"][0]["finish_reason"])


@pytest.mark.parametrize("dialect, final, called, finish", [
    pytest.param(d, *case, id=f"{d.__name__}-{k}") for d in WIRE for k, case in enumerate(CASES)
    if not (d is Completions and case[1])])  # a text completion has no tool calls
def test_whole_and_streamed_responses_say_the_wire_name(dialect, final, called, finish):
    events = [TokenEvent([1], "Hi"), final] if dialect is Completions else _events(called, final)
    instance = Responses(ResponseStore()) if dialect is Responses else dialect()
    body = BODIES[dialect]
    whole = msgspec.to_builtins(instance.whole(body, _reply(called, False), events))
    streamed = _streamed(instance, body, _reply(called, True), events)
    assert _said(dialect, whole, streamed) == (WIRE[dialect][finish],) * 2
