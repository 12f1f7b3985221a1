"""The remote backend (`--server URL`): the openai SDK against a scripted OpenAI-compatible stream."""

import asyncio
import json
import socket

import pytest

from dflash_agent.agent.backend import BackendError, ContextFull, TurnOptions
from dflash_agent.agent.loop import Agent, AgentConfig
from dflash_agent.agent.prompt import system_prompt
from dflash_agent.agent.remote import RemoteBackend, openai_messages
from dflash_agent.chat.openai_messages import conversation_from_openai
from dflash_agent.chat.parser import ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart
from dflash_agent.chat.types import Conversation, Message, TextPart, Tool, ToolCall
from dflash_agent.tools.registry import workspace_tools
from dflash_agent.tools.workspace import Workspace
from tests.agent.fake_openai import Failure, Reply, fake_server

TOOLS = [Tool("read_file", "Read a file.", {"type": "object", "properties": {"path": {"type": "string"}}})]
CONVERSATION = Conversation([
    Message("system", [TextPart("You are an agent.")]),
    Message("user", [TextPart("Fix it.")]),
    Message("assistant", [TextPart("Looking.")], reasoning="first the code",
            tool_calls=[ToolCall("call_a", "read_file", {"path": "calc.py"})]),
    Message("tool", [TextPart("def add(a, b): ...")], tool_call_id="call_a", name="read_file"),
], TOOLS)


def one_turn(url, conversation=CONVERSATION, options=TurnOptions(), model=None):
    deltas = []

    async def go():
        backend = RemoteBackend(url, model)
        try:
            return await backend.turn(conversation, options, deltas.append)
        finally:
            await backend.close()

    return asyncio.run(go()), deltas


def test_openai_messages_round_trip_through_the_chat_layer():
    assert conversation_from_openai(openai_messages(CONVERSATION)).messages == CONVERSATION.messages


def test_a_streamed_turn_with_reasoning_text_and_calls():
    reply = Reply("I will read it.", [("read_file", '{"path": "calc.py"}'), ("read_file", '{"path": "t.py"}')],
                  reasoning="need the code", usage=(120, 30, 100))
    with fake_server([reply]) as fake:
        turn, deltas = one_turn(fake.url, options=TurnOptions("required", False, 64))
    assert turn.content == "I will read it." and turn.reasoning == "need the code"
    assert turn.tool_calls == [ToolCall("call_0", "read_file", {"path": "calc.py"}),
                               ToolCall("call_1", "read_file", {"path": "t.py"})]
    assert turn.finish_reason == "tool_calls" and not turn.bad_arguments
    assert (turn.usage.prompt_tokens, turn.usage.completion_tokens, turn.usage.cached_tokens) == (120, 30, 100)
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == "I will read it."
    assert [d.text for d in deltas if isinstance(d, ReasoningDelta)] == ["need the code"]
    assert [(d.index, d.name) for d in deltas if isinstance(d, ToolCallStart)] == [(0, "read_file"), (1, "read_file")]
    fragments = [d.fragment for d in deltas if isinstance(d, ToolCallArgsDelta) and d.index == 1]
    assert "".join(fragments) == '{"path": "t.py"}'

    request = fake.requests[0]
    assert request["model"] == "fake-model"  # the first one the server lists
    assert request["stream"] is True and request["stream_options"] == {"include_usage": True}
    assert request["tool_choice"] == "required" and request["parallel_tool_calls"] is False
    assert request["max_tokens"] == 64 and "chat_template_kwargs" not in request
    assert request["tools"] == [{"type": "function", "function": {
        "name": "read_file", "description": "Read a file.", "parameters": TOOLS[0].parameters}}]
    assistant = request["messages"][2]
    assert assistant["tool_calls"][0]["function"]["arguments"] == '{"path": "calc.py"}'
    assert request["messages"][3] == {"role": "tool", "content": "def add(a, b): ...", "tool_call_id": "call_a"}


def test_the_model_named_is_the_model_asked_for_and_v1_is_implied():
    with fake_server([Reply("hi")]) as fake:
        one_turn(fake.url.removesuffix("/v1"), model="gemma-4-31b", options=TurnOptions(enable_thinking=True))
    assert fake.requests[0]["model"] == "gemma-4-31b"
    assert fake.requests[0]["chat_template_kwargs"] == {"enable_thinking": True}


def test_arguments_that_are_not_json_become_an_error_result(tmp_path):
    with fake_server([Reply(calls=[("list_dir", '{"path": ')]), Reply("sorry")]) as fake:
        async def go():
            backend = RemoteBackend(fake.url)
            workspace = Workspace(tmp_path)
            agent = Agent(backend, workspace_tools(workspace), system_prompt(workspace), AgentConfig())
            try:
                return agent, await agent.run("list")
            finally:
                await backend.close()

        agent, result = asyncio.run(go())
    assert result.outcome == "answered"
    result_message = agent.messages[3]
    assert result_message.role == "tool"
    assert result_message.text.startswith("Error: the arguments are not a JSON object")
    # What the server gets back is still a well-formed conversation.
    conversation_from_openai(fake.requests[1]["messages"], fake.requests[1]["tools"])


def test_server_errors_are_one_line_backend_errors():
    with fake_server([Failure(500, {"message": "the model crashed", "type": "server_error"})]) as fake:
        with pytest.raises(BackendError, match="answered 500: the model crashed"):
            one_turn(fake.url)


def test_context_overflow_is_context_full():
    error = {"message": "the request needs 9000 tokens but the context holds 8192", "type": "invalid_request_error",
             "param": "messages", "code": "context_length_exceeded"}
    with fake_server([Failure(400, error)]) as fake:
        with pytest.raises(ContextFull, match="9000 tokens"):
            one_turn(fake.url)


def test_an_unreachable_server_is_a_backend_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(BackendError, match=f"cannot reach the server at http://127.0.0.1:{port}/v1"):
        one_turn(f"http://127.0.0.1:{port}/v1")


def test_request_bodies_are_json_all_the_way(tmp_path):
    """Tool results with any characters survive the wire."""
    odd = Conversation([*CONVERSATION.messages[:3], Message("tool", [TextPart('quote " backslash \\ nul \x00 é')],
                                                            tool_call_id="call_a", name="read_file")], TOOLS)
    with fake_server([Reply("ok")]) as fake:
        one_turn(fake.url, conversation=odd)
    assert fake.requests[0]["messages"][3]["content"] == 'quote " backslash \\ nul \x00 é'
    json.dumps(fake.requests[0])


def turn_with(url, conversation=CONVERSATION, temperature=0.0):
    deltas = []

    async def go():
        backend = RemoteBackend(url, None, temperature)
        try:
            return await backend.turn(conversation, TurnOptions(), deltas.append)
        finally:
            await backend.close()

    return asyncio.run(go()), deltas


@pytest.mark.parametrize("error", [
    # vLLM 0.3x: a 400 whose code is the status and whose param names the input
    {"message": "This model's maximum context length is 2048 tokens. However, your request has 3100 input tokens. "
                "Please reduce the length of the input messages.", "type": "BadRequestError", "param": "input_tokens",
     "code": 400},
    # SGLang
    {"message": "The input (3100 tokens) is longer than the model's context length (2048 tokens).",
     "type": "BadRequestError", "code": 400},
    # llama.cpp's server
    {"message": "the request exceeds the available context size, try increasing it", "type":
     "exceed_context_size_error", "code": 400, "n_prompt_tokens": 3100, "n_ctx": 2048},
], ids=["vllm", "sglang", "llama.cpp"])
def test_every_servers_context_overflow_is_context_full(error):
    with fake_server([Failure(400, error)]) as fake:
        with pytest.raises(ContextFull):
            one_turn(fake.url)


def test_a_busy_server_is_retried_after_its_retry_after_then_answers():
    busy = Failure(429, {"message": "rate limited", "type": "rate_limit_error"}, {"Retry-After": "0"})
    loading = Failure(503, {"message": "loading", "type": "server_error"}, {"Retry-After": "0"})
    with fake_server([busy, loading, Reply("done.")]) as fake:
        turn, _ = one_turn(fake.url)
    assert turn.content == "done." and len(fake.requests) == 3


def test_a_server_busy_past_the_retries_is_one_line():
    busy = Failure(503, {"message": "overloaded", "type": "server_error"}, {"Retry-After": "0"})
    with fake_server([busy] * 5) as fake:
        with pytest.raises(BackendError, match=r"answered 503 \(after 4 retries\): overloaded"):
            one_turn(fake.url)
    assert len(fake.requests) == 5


def test_with_no_temperature_and_no_listed_defaults_the_server_s_own_apply():
    """vLLM lists no sampling defaults and applies the model's generation_config (Gemma's top_k 64, top_p 0.95)
    to a request that sends none; greedy would override them."""
    with fake_server([Reply("a"), Reply("b")]) as fake:
        turn_with(fake.url, temperature=None)
        turn_with(fake.url, temperature=0.7)
    assert not {"temperature", "top_p", "top_k", "min_p"} & set(fake.requests[0])
    assert fake.requests[1]["temperature"] == 0.7


VLLM_GEMMA3 = {"id": "gemma3-270m", "object": "model", "created": 0, "owned_by": "vllm",
               "root": "/models/gemma-3-270m-it", "max_model_len": 2048}
VLLM_GEMMA4 = {"id": "google/gemma-4-E2B-it", "object": "model", "created": 0, "owned_by": "vllm",
               "root": "google/gemma-4-E2B-it", "max_model_len": 8192}


def test_gemma3_behind_another_server_gets_its_tools_as_text_and_its_calls_read_back():
    """No server but ours has a tool syntax for Gemma 3 (its template has none): the client writes the tools, the
    earlier calls and the results as text, as our engine does, and reads the fenced call back."""
    answer = 'Reading it.\n\n```tool_call\n{"name": "read_file", "arguments": {"path": "b.py"}}\n```'
    with fake_server([Reply(answer)], card=VLLM_GEMMA3) as fake:
        turn, deltas = one_turn(fake.url)
    sent = fake.requests[0]
    assert "tools" not in sent and "tool_choice" not in sent
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "user"]
    assert "# Tools" in sent["messages"][0]["content"] and "read_file" in sent["messages"][0]["content"]
    assert "```tool_result" in sent["messages"][3]["content"]
    assert '"path": "calc.py"' in sent["messages"][2]["content"]
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("read_file", {"path": "b.py"})]
    assert turn.content.strip() == "Reading it." and turn.finish_reason == "tool_calls"
    assert any(isinstance(d, ToolCallStart) and d.name == "read_file" for d in deltas)
    assert "```" not in "".join(d.text for d in deltas if isinstance(d, TextDelta))


def test_gemma4_calls_left_in_the_text_are_read_and_its_markers_kept():
    """vLLM without --tool-call-parser gemma4 leaves the call in the text, and drops its markers (special tokens)
    unless asked to keep them."""
    answer = 'Let me look.<|tool_call>call:read_file{path:<|"|>b.py<|"|>}<tool_call|>'
    with fake_server([Reply(answer)], card=VLLM_GEMMA4) as fake:
        turn, _ = one_turn(fake.url)
    sent = fake.requests[0]
    assert sent["skip_special_tokens"] is False and sent["tools"][0]["function"]["name"] == "read_file"
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("read_file", {"path": "b.py"})]
    assert turn.content == "Let me look." and turn.finish_reason == "tool_calls"


def test_calls_the_server_parsed_stay_as_they_came_beside_text_without_markup():
    with fake_server([Reply("Reading.", calls=[("read_file", '{"path": "c.py"}')])], card=VLLM_GEMMA4) as fake:
        turn, _ = one_turn(fake.url)
    assert [(c.id, c.name, c.arguments) for c in turn.tool_calls] == [("call_0", "read_file", {"path": "c.py"})]
    assert turn.content == "Reading."


def test_our_own_server_parses_its_calls_itself():
    ours = {**VLLM_GEMMA3, "owned_by": "dflash-agent", "meta": {"family": "gemma3", "n_ctx": 2048}}
    with fake_server([Reply("plain")], card=ours) as fake:
        one_turn(fake.url)
    assert fake.requests[0]["tools"] and len(fake.requests[0]["messages"]) == 4


def test_a_vllm_without_a_tool_parser_is_asked_again_with_tool_choice_none():
    """vLLM started without --tool-call-parser refuses tool_choice auto (its words below); for Gemma 4 the client
    asks again with "none", the tools still in the prompt, reads the call from the text, and asks so from then on."""
    refusal = Failure(400, {"message": '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                       "to be set", "type": "BadRequestError", "param": None, "code": 400})
    call = '<|tool_call>call:read_file{path:<|"|>b.py<|"|>}<tool_call|>'

    async def two_turns(url):
        backend = RemoteBackend(url)
        try:
            first = await backend.turn(CONVERSATION, TurnOptions(), lambda d: None)
            second = await backend.turn(CONVERSATION, TurnOptions(), lambda d: None)
            return first, second
        finally:
            await backend.close()

    with fake_server([refusal, Reply(call), Reply("done.")], card=VLLM_GEMMA4) as fake:
        first, second = asyncio.run(two_turns(fake.url))
    asked = [(r.get("tool_choice"), "parallel_tool_calls" in r, bool(r.get("tools"))) for r in fake.requests]
    assert asked == [("auto", True, True), ("none", False, True), ("none", False, True)]
    assert [c.name for c in first.tool_calls] == ["read_file"] and second.content == "done."


def test_max_tokens_past_the_servers_context_is_shortened_to_it():
    """vLLM refuses max_tokens=4096 against max_model_len=2048 (400) and itself shortens one that only passes what
    the prompt leaves: the agent's turn cap is cut to the context the server lists."""
    with fake_server([Reply("a"), Reply("b")], card=VLLM_GEMMA3) as fake:
        one_turn(fake.url, options=TurnOptions(max_tokens=4096))
        one_turn(fake.url, options=TurnOptions(max_tokens=100))
    assert [r["max_tokens"] for r in fake.requests] == [2048, 100]


def test_a_refused_key_says_where_the_key_comes_from():
    # vLLM's 401 body is {"error": "Unauthorized"}
    with fake_server([Failure(401, "Unauthorized")]) as fake:
        with pytest.raises(BackendError, match=r"answered 401: Unauthorized \(the key is read from DFLASH_AGENT_API"):
            one_turn(fake.url)
