"""The official openai SDK against a live server with the embedded model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from dflash_agent.api.service import DEFAULT_MAX_TOKENS

# Bounded arguments (an enum and an integer) so a forced call finishes within a few tokens.
TOOLS = [
    {"type": "function", "function": {
        "name": "set_mode", "description": "Switch the editor mode.",
        "parameters": {"type": "object", "properties": {"mode": {"type": "string", "enum": ["insert", "normal"]}},
                       "required": ["mode"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "goto_line", "description": "Move the cursor to a line.",
        "parameters": {"type": "object", "properties": {"line": {"type": "integer", "minimum": 1, "maximum": 99}},
                       "required": ["line"], "additionalProperties": False}}},
]
MESSAGES = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Go to line 12."}]
GREEDY = {"temperature": 0, "max_tokens": 48}


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models(client):
    (model,) = client.models.list().data
    assert model.id == "gemma-3-270m-q4_k_m.gguf" and model.owned_by == "dflash-agent"
    # what clients size their prompts and answers by: the context (llama-server's and vLLM's names), the cap
    meta = model.model_extra["meta"]
    assert meta["n_ctx"] == meta["max_model_len"] > 1000 and meta["max_output_tokens"] == DEFAULT_MAX_TOKENS


def test_props_says_what_llama_servers_does(server_url):
    """llama-server's GET /props: the context and the cap a request that sets none gets, slots, the template."""
    props = httpx.get(f"{server_url}/props", timeout=60).json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] > 1000 and settings["params"]["n_predict"] == DEFAULT_MAX_TOKENS
    assert props["total_slots"] == 1 and props["model_alias"] == "gemma-3-270m-q4_k_m.gguf"
    assert props["model_path"].endswith(".gguf") and "<start_of_turn>" in props["chat_template"]
    assert props["build_info"].startswith("dflash-agent ") and props["modalities"] == {"vision": False, "audio": False}


def test_plain_chat_streamed_equals_non_streamed(client):
    whole = client.chat.completions.create(model="any", messages=MESSAGES, **{**GREEDY, "max_tokens": 12})
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content and message.tool_calls is None
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 10 and whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    timings = whole.model_extra["timings"]
    assert timings["predicted_n"] == whole.usage.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == whole.usage.prompt_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens == timings["cache_n"]

    chunks = list(client.chat.completions.create(model="any", messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True},
                                                 **{**GREEDY, "max_tokens": 12}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].model_extra["timings"]["predicted_n"] == whole.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def _streamed_calls(stream) -> tuple[dict[int, dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for frag in choice.delta.tool_calls or []:
            call = calls.setdefault(frag.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = frag.id or call["id"]
            if frag.function.name:
                call["name"] = frag.function.name
            call["arguments"] += frag.function.arguments or ""
    return calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "goto_line"}}])
def test_forced_tool_call_streamed_and_not(client, tool_choice):
    args = dict(model="any", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                **GREEDY)
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    if isinstance(tool_choice, dict):
        assert call.function.name == "goto_line"
    arguments = json.loads(call.function.arguments)
    assert call.function.name in ("set_mode", "goto_line") and isinstance(arguments, dict)

    calls, finish = _streamed_calls(client.chat.completions.create(stream=True, **args))
    assert finish == "tool_calls" and list(calls) == [0]
    # Fragments concatenate to exactly the JSON the non-streamed call carries.
    assert calls[0]["name"] == call.function.name and calls[0]["arguments"] == call.function.arguments
    # and the SDK's streamed message has no content, as the whole one (not "")
    with client.chat.completions.stream(**args) as stream:
        assert stream.get_final_completion().choices[0].message.content is choice.message.content is None


FREE_TOOLS = [  # free-form arguments, so a sampled call can run long
    {"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]
LIST_FILES = [{"role": "user", "content": "List the files, then read README.md."}]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_tool_choice_is_exactly_one_call(client, seed):
    """OpenAI's meaning of a named tool_choice: one call to that function, streamed or not."""
    args = dict(model="any", messages=LIST_FILES, tools=FREE_TOOLS, temperature=1, seed=seed, max_tokens=96,
                tool_choice={"type": "function", "function": {"name": "bash"}})
    whole = client.chat.completions.create(**args)
    calls = whole.choices[0].message.tool_calls or []
    if whole.choices[0].finish_reason != "length":
        assert [c.function.name for c in calls] == ["bash"] and whole.choices[0].finish_reason == "tool_calls"
    assert len(calls) <= 1 and "```" not in (whole.choices[0].message.content or "")
    fragments: dict[int, str] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            fragments[call.index] = fragments.get(call.index, "") + (call.function.arguments or "")
    assert list(fragments) in ([], [0])
    if fragments and calls:
        assert json.loads(fragments[0]) == json.loads(calls[0].function.arguments)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_cut_by_the_token_limit_leaves_no_tool_syntax_in_content(client, seed):
    whole = client.chat.completions.create(model="any", messages=LIST_FILES, tools=FREE_TOOLS, temperature=1,
                                           seed=seed, max_tokens=64, tool_choice="required")
    choice = whole.choices[0]
    assert "tool_call" not in (choice.message.content or "") and "```" not in (choice.message.content or "")
    for call in choice.message.tool_calls or []:
        assert call.function.name in ("bash", "read_file") and isinstance(json.loads(call.function.arguments), dict)
    assert choice.finish_reason in ("length", "tool_calls")


def test_multi_turn_with_tool_results(client):
    first = client.chat.completions.create(model="any", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, **GREEDY)
    call = first.choices[0].message.tool_calls[0]
    history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Cursor at line 12."}]
    second = client.chat.completions.create(model="any", messages=history, tools=TOOLS, **{**GREEDY, "max_tokens": 8})
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # The rendered second prompt holds the call and its result.
    prompt = httpx.post(f"{client.base_url}".replace("/v1/", "/apply-template"),
                        json={"messages": history, "tools": TOOLS}).json()["prompt"]
    assert "Cursor at line 12." in prompt and call.function.name in prompt


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = client.chat.completions.create(
        model="any", messages=MESSAGES, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        **GREEDY)
    assert isinstance(json.loads(out.choices[0].message.content)["ok"], bool)


def test_completions_text_and_token_ids(client):
    text = client.completions.create(model="any", prompt="def fibonacci(n):", max_tokens=8, temperature=0)
    assert text.object == "text_completion" and text.usage.completion_tokens <= 8
    ids = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                     json={"content": "def fibonacci(n):", "add_special": True}).json()["tokens"]
    same = client.completions.create(model="any", prompt=ids, max_tokens=8, temperature=0)
    assert same.choices[0].text == text.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="any", prompt="def fibonacci(n):", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == text.choices[0].text


def test_seeded_sampling_is_reproducible(client):
    args = dict(model="any", messages=MESSAGES, temperature=1.0, top_p=0.9, seed=7, max_tokens=8)
    a = client.chat.completions.create(**args).choices[0].message.content
    b = client.chat.completions.create(**args).choices[0].message.content
    assert a == b


def test_unknown_fields_are_ignored(server_url):
    r = httpx.post(f"{server_url}/v1/chat/completions", timeout=120, json={
        "messages": MESSAGES, "max_tokens": 2, "temperature": 0, "user": "me", "store": False, "foo": {"bar": 1}})
    assert r.status_code == 200, r.text


def test_tokenize_detokenize_round_trip(server_url):
    ids = httpx.post(f"{server_url}/tokenize", json={"content": "print('hi')"}).json()["tokens"]
    assert httpx.post(f"{server_url}/detokenize", json={"tokens": ids}).json()["content"] == "print('hi')"
    pieces = httpx.post(f"{server_url}/tokenize", json={"content": "print('hi')", "with_pieces": True}).json()
    assert [p["id"] for p in pieces["tokens"]] == ids


def test_metrics_count_requests_and_tokens(client, server_url):
    def value(name: str) -> float:
        for line in httpx.get(f"{server_url}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} missing")

    before = value("dflash_generated_tokens_total")
    out = client.chat.completions.create(model="any", messages=MESSAGES, **{**GREEDY, "max_tokens": 3})
    assert value("dflash_generated_tokens_total") == before + out.usage.completion_tokens
    text = httpx.get(f"{server_url}/metrics").text
    for name in ("dflash_requests_total", "dflash_prompt_tokens_total", "dflash_spec_draft_tokens_total",
                 "dflash_spec_accepted_tokens_total", "dflash_requests_queued", "dflash_decode_tokens_per_second",
                 "dflash_prompt_cache_hits_total"):
        assert name in text


def test_openapi_schema(server_url):
    schema = httpx.get(f"{server_url}/schema/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/messages", "/v1/completions", "/v1/models"} <= set(schema["paths"])
