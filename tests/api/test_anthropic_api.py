"""The official anthropic SDK against a live server with the embedded model (what Claude Code speaks)."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest

from .conftest import API_KEY

TOOLS = [
    {"name": "set_mode", "description": "Switch the editor mode.",
     "input_schema": {"type": "object", "properties": {"mode": {"type": "string", "enum": ["insert", "normal"]}},
                      "required": ["mode"], "additionalProperties": False}},
    {"name": "goto_line", "description": "Move the cursor to a line.",
     "input_schema": {"type": "object", "properties": {"line": {"type": "integer", "minimum": 1, "maximum": 99}},
                      "required": ["line"], "additionalProperties": False}},
]
# Claude Code's shape: system as text blocks with cache_control.
SYSTEM = [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Go to line 12."}]}]
# SDK 2.x no longer takes sampling arguments (the API picks them); ours are still read from the body.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server_url):
    return anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0, timeout=300)


def test_plain_message_streamed_equals_non_streamed(client):
    whole = client.messages.create(model="claude-opus-4-7", max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                   messages=MESSAGES)
    assert whole.type == "message" and whole.role == "assistant"
    assert [b.type for b in whole.content] == ["text"]
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.output_tokens <= 12
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 10

    with client.messages.stream(model="claude-opus-4-7", max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                messages=MESSAGES) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    raw = [e for e in events if e in ("message_start", "content_block_start", "content_block_stop",
                                      "message_delta", "message_stop")]
    assert raw == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]


def test_raw_event_sequence_has_ping_and_matching_types(server_url):
    body = {"model": "m", "max_tokens": 4, "temperature": 0, "messages": MESSAGES, "stream": True}
    names, lines = [], []
    with httpx.stream("POST", f"{server_url}/v1/messages?beta=true", json=body, timeout=120,
                      headers={"anthropic-version": "2023-06-01"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    import json
    for event, data in zip(lines[::2], lines[1::2], strict=True):
        assert event.startswith("event: ") and data.startswith("data: ")
        name = event.removeprefix("event: ")
        assert json.loads(data.removeprefix("data: "))["type"] == name
        names.append(name)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "goto_line"}])
def test_forced_tool_use_streamed_and_not(client, tool_choice):
    args = dict(model="m", max_tokens=48, extra_body=GREEDY, system=SYSTEM, messages=MESSAGES, tools=TOOLS,
                tool_choice={**tool_choice, "disable_parallel_tool_use": True})
    whole = client.messages.create(**args)
    assert whole.stop_reason == "tool_use"
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert use.name in ("set_mode", "goto_line") and isinstance(use.input, dict) and use.id
    if tool_choice["type"] == "tool":
        assert use.name == "goto_line" and 1 <= use.input["line"] <= 99

    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    # The SDK joined the input_json_delta fragments and parsed them: the same input.
    assert (streamed.name, streamed.input) == (use.name, use.input)
    assert final.stop_reason == "tool_use"


def test_a_tool_call_cut_by_max_tokens_says_max_tokens(client):
    """As Anthropic's API and the other two routes (finish_reason length, incomplete) say: not tool_use, whose
    input would be cut."""
    whole = client.messages.create(model="m", max_tokens=48, extra_body=GREEDY, system=SYSTEM, messages=MESSAGES,
                                   tools=TOOLS, tool_choice={"type": "tool", "name": "goto_line"})
    limit = whole.usage.output_tokens - 2  # the call's input is whole, its end is not
    cut = client.messages.create(model="m", max_tokens=limit, extra_body=GREEDY, system=SYSTEM, messages=MESSAGES,
                                 tools=TOOLS, tool_choice={"type": "tool", "name": "goto_line"})
    assert [b.type for b in cut.content] == ["tool_use"]
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", limit)


def test_multi_turn_with_tool_result(client):
    first = client.messages.create(model="m", max_tokens=48, extra_body=GREEDY, system=SYSTEM, messages=MESSAGES,
                                   tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    use = next(b for b in first.content if b.type == "tool_use")
    history = [*MESSAGES, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "Cursor at line 12."}]}]
    second = client.messages.create(model="m", max_tokens=8, extra_body=GREEDY, system=SYSTEM, messages=history,
                                    tools=TOOLS)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    count = client.messages.count_tokens(model="m", system=SYSTEM, messages=history, tools=TOOLS)
    assert count.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert count.input_tokens > first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_stop_sequence(client):
    whole = client.messages.create(model="m", max_tokens=12, extra_body=GREEDY, messages=MESSAGES)
    text = whole.content[0].text
    cut = text.strip().split()[0] if text.strip() else None
    if cut is None:
        pytest.skip("the model wrote only whitespace")
    stopped = client.messages.create(model="m", max_tokens=12, extra_body=GREEDY, messages=MESSAGES, stop_sequences=[cut])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == cut
    assert cut not in (stopped.content[0].text if stopped.content else "")


# What Claude Code sends (shape, not content): JSON-schema draft-07 tool schemas, cache_control on blocks,
# system reminders, metadata, beta headers and ?beta=true, always streaming.
CLAUDE_CODE_TOOLS = [
    {"name": "Bash", "description": "Executes a bash command.", "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
        "properties": {"command": {"type": "string", "description": "The command to execute"},
                       "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
                       "description": {"type": "string"}, "run_in_background": {"type": "boolean"}},
        "required": ["command"]}},
    {"name": "Read", "description": "Reads a file.", "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
        "properties": {"file_path": {"type": "string"}, "offset": {"type": "number"}, "limit": {"type": "number"}},
        "required": ["file_path"]}},
]


def test_claude_code_shaped_request(client):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nAs you answer, use the tools.\n</system-reminder>"},
        {"type": "text", "text": "What is in README.md?", "cache_control": {"type": "ephemeral"}}]}]
    system = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
              {"type": "text", "text": "You are an interactive CLI tool.", "cache_control": {"type": "ephemeral"}}]
    with client.messages.stream(
        model="claude-opus-4-7", max_tokens=32000, system=system, messages=messages, tools=CLAUDE_CODE_TOOLS,
        metadata={"user_id": "user_abc_account_def_session_ghi"},
        extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"},
        extra_query={"beta": "true"}, extra_body={"temperature": 0, "max_tokens": 6},
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and final.usage.output_tokens <= 6
    count = client.messages.count_tokens(model="claude-opus-4-7", system=system, messages=messages,
                                         tools=CLAUDE_CODE_TOOLS, extra_query={"beta": "true"})
    assert count.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens


def test_mid_conversation_system_messages_as_claude_code_sends_them(client, server_url):
    """Claude Code 2.1: the mid-conversation-system beta, system entries inside `messages`, list-form system."""
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
              {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>context</system-reminder>"},
                                     {"type": "text", "text": "list the files here"}]},
        {"role": "system", "content": "Available agent types for the Agent tool: general-purpose."},
    ]
    args = dict(model="claude-opus-4-8", max_tokens=8, system=system, messages=messages, extra_body=GREEDY,
                betas=["mid-conversation-system-2026-04-07"])
    whole = client.beta.messages.create(**args)
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[0].type == "text"
    with client.beta.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    # count_tokens takes the same shape and counts the prompt the request used.
    prompt = httpx.post(f"{server_url}/v1/messages/count_tokens",
                        json={"model": "m", "system": system, "messages": messages}).json()["input_tokens"]
    assert prompt == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_structured_output_as_claude_code_asks_for_a_session_title(client):
    """Claude Code asks for its session title with `output_config.format`; the grammar forces the schema, so the
    turn ends with the JSON object instead of running to max_tokens."""
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40}}, "required": ["title"],
              "additionalProperties": False}
    out = client.messages.create(
        model="claude-opus-4-8", max_tokens=16000,
        messages=[{"role": "user", "content": "<session>\nlist the files here\n</session>\n\nWrite the title."}],
        extra_body={"temperature": 0,
                    "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": schema}}})
    assert out.stop_reason == "end_turn", out
    assert isinstance(json.loads(out.content[0].text)["title"], str)


@pytest.mark.parametrize("extra", [{"output_config": {"format": {"type": "yaml"}}}, {"output_format": {"type": "json"}}])
def test_a_bad_structured_output_format_is_a_400(client, extra):
    with pytest.raises(anthropic.BadRequestError, match="json_schema"):
        client.messages.create(model="any", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                               extra_body=extra)


# The pattern Claude Code 2.1 reads a prompt-too-long error with, to compact the conversation by the excess.
CLAUDE_CODE_PTL = r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)"


def test_the_context_limits_read_as_anthropic_words_them(strict_url):
    """A prompt past the context is Anthropic's "prompt is too long: N tokens > M maximum"; an answer the context
    cut short stops with model_context_window_exceeded, one max_tokens cut with max_tokens."""
    client = anthropic.Anthropic(base_url=strict_url, api_key=API_KEY, max_retries=0, timeout=300)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", max_tokens=64000, messages=[{"role": "user", "content": "word " * 400}])
    found = re.search(CLAUDE_CODE_PTL, info.value.message, re.IGNORECASE)
    assert found and int(found[1]) > int(found[2]) == 256, info.value.message
    assert "--ctx-size" in info.value.message
    counting = [{"role": "user", "content": "Count on: " + " ".join(map(str, range(1, 60)))}]
    full = client.messages.create(model="m", max_tokens=64000, messages=counting, extra_body=GREEDY)
    assert full.stop_reason == "model_context_window_exceeded", full
    # Anthropic's input_tokens leave out the prompt read from the cache (an earlier test's prefix, in a run of both)
    assert full.usage.input_tokens + full.usage.cache_read_input_tokens + full.usage.output_tokens == 256
    with client.messages.stream(model="m", max_tokens=64000, messages=counting, extra_body=GREEDY) as stream:
        assert stream.get_final_message().stop_reason == "model_context_window_exceeded"
    cut = client.messages.create(model="m", max_tokens=3, messages=counting, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
