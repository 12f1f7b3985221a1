"""The official openai SDK's Responses client (what Codex CLI and the Agents SDK speak) against a live server
with the embedded model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

BASH = {"type": "function", "name": "bash", "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"],
                       "additionalProperties": False}}
READ = {"type": "function", "name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
INSTRUCTIONS = "You are a coding agent. Use the tools."


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_text_response_streamed_equals_non_streamed(client):
    args = dict(model="m", instructions=INSTRUCTIONS, input="Say hello.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**args)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete")
    assert [item.type for item in whole.output] == ["message"]
    assert whole.output_text and whole.output[0].content[0].type == "output_text"
    assert whole.usage.output_tokens <= 12 and whole.usage.input_tokens > 10
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"

    with client.responses.stream(**args) as stream:
        kinds = [event.type for event in stream]
        if whole.status == "completed":
            final = stream.get_final_response()
            assert final.output_text == whole.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    lifecycle = [k for k in kinds if k != "response.output_text.delta"]
    assert lifecycle[2:-1] == ["response.output_item.added", "response.content_part.added",
                               "response.output_text.done", "response.content_part.done",
                               "response.output_item.done"]
    # The cached prompt: the second request reuses the first one's KV.
    second = client.responses.create(**args)
    assert second.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_round_trip(client, stream):
    """A forced call, its output sent back as a function_call_output item, then a text answer."""
    args = dict(model="m", instructions=INSTRUCTIONS, tools=[BASH, READ], temperature=0, max_output_tokens=64,
                tool_choice={"type": "function", "name": "bash"})
    first_input = [{"role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]
    if stream:
        with client.responses.stream(input=first_input, **args) as s:
            kinds = [e.type for e in s]
            first = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    else:
        first = client.responses.create(input=first_input, **args)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "bash" and isinstance(json.loads(call.arguments)["command"], str)
    assert call.call_id and call.id and call.status == "completed"

    items = [*first_input, *[item.model_dump(exclude_none=True) for item in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "a.py\nb.py"}]
    answer = client.responses.create(model="m", instructions=INSTRUCTIONS, tools=[BASH, READ], input=items,
                                     tool_choice="none", temperature=0, max_output_tokens=8)
    assert [item.type for item in answer.output] == ["message"]
    assert answer.usage.input_tokens_details.cached_tokens > 0  # the first request's prompt was reused

    # The same continuation through previous_response_id, from the server's memory.
    chained = client.responses.create(model="m", instructions=INSTRUCTIONS, tools=[BASH, READ],
                                      previous_response_id=first.id, tool_choice="none", temperature=0,
                                      max_output_tokens=8,
                                      input=[{"type": "function_call_output", "call_id": call.call_id,
                                              "output": "a.py\nb.py"}])
    assert chained.output_text == answer.output_text
    assert chained.previous_response_id == first.id
    assert client.responses.retrieve(chained.id).output_text == chained.output_text


def test_errors_in_openai_shape(client, server_url):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="x", previous_response_id="resp_unknown")
    assert info.value.body["code"] == "previous_response_not_found"
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input=[{"type": "function_call_output", "call_id": "nope", "output": ""}])
    assert info.value.body["param"] == "input[0].call_id"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="x", tools=[{"type": "custom", "name": "apply_patch"}])
    assert info.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:,"}]}])
    assert "images are not supported" in info.value.body["message"]
    r = httpx.post(f"{server_url}/v1/responses", json={"model": "m", "input": "x", "max_output_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")


def test_prompt_too_long_names_the_option(strict_url):
    from tests.api.conftest import API_KEY

    r = httpx.post(f"{strict_url}/v1/responses", json={"model": "m", "input": "word " * 400},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "--ctx-size" in error["message"]


def test_output_items_and_events_without_a_server():
    """The item machine alone: kinds change open new items; an empty output is an empty message."""
    from dflash_agent.api.responses_routes import _Output
    from dflash_agent.chat.parser import ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart
    from dflash_agent.engine import FinalEvent, Timings, Usage

    empty = _Output({})
    empty.close(FinalEvent("stop", Usage(1, 0), Timings()))
    assert [(i["type"], i["content"][0]["text"]) for i in empty.items] == [("message", "")]
    out = _Output({"close_agent": "multi_agent_v1"})
    for delta in [ReasoningDelta("r"), TextDelta("a"), TextDelta("b"), ToolCallStart(0, "call_1", "close_agent"),
                  ToolCallArgsDelta(0, '{"target":'), ToolCallArgsDelta(0, '"x"}')]:
        out.feed(delta)
    out.close(FinalEvent("length", Usage(1, 9), Timings()))
    assert [i["type"] for i in out.items] == ["reasoning", "message", "function_call"]
    call = out.items[-1]
    assert (call["arguments"], call["namespace"], call["status"]) == ('{"target":"x"}', "multi_agent_v1", "incomplete")
    added = [e["output_index"] for e in out.events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in out.events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2]
