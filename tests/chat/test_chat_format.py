"""The chat layer end to end on the embedded model: render, force, generate (with and without
speculation), parse."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from dflash_agent.chat.chat_format import ChatFormat, ChatOptions, stream_chat
from dflash_agent.chat.openai_messages import conversation_from_openai
from dflash_agent.chat.types import ChatError
from dflash_agent.engine.decode.sampling import SamplingParams
from dflash_agent.engine.decode.speculative import SpecConfig
from dflash_agent.engine.engine import Engine
from dflash_agent.engine.model.drafter import init_drafter_checkpoint, load_drafter

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
        "required": ["path"]}}},
    {"type": "function", "function": {"name": "grep", "description": "Search files.", "parameters": {
        "type": "object", "properties": {"pattern": {"type": "string"}, "ignore_case": {"type": "boolean"}},
        "required": ["pattern", "ignore_case"]}}},
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "version": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "version", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(embedded_engine):
    engine = embedded_engine(1024)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def chat(engine):
    return ChatFormat.for_engine(engine)


def complete_chat(engine, prepared, sampling=None, max_tokens=None):
    """The whole answer of a prepared chat: (content / reasoning / tool calls, the engine's FinalEvent)."""
    parser = prepared.parser()

    async def drain():
        return [event async for event in stream_chat(engine, prepared, parser, sampling, max_tokens)][-1]

    final = asyncio.run(drain())
    return parser.result(), final


def _conversation(text, tools=None):
    return conversation_from_openai([{"role": "user", "content": text}], tools)


def test_stop_ids_come_from_the_tokenizer(chat, engine):
    assert engine.tokenizer.token_id("<end_of_turn>") in chat.stop_ids
    assert engine.tokenizer.eos_id in chat.stop_ids


def test_named_tool_choice_gives_a_valid_call(engine, chat):
    prepared = chat.prepare(_conversation("Find TODO comments.", TOOLS),
                            ChatOptions(tool_choice={"type": "function", "function": {"name": "grep"}},
                                        parallel_tool_calls=False))
    parsed, final = complete_chat(engine, prepared, SamplingParams(temperature=1.0, seed=3), 160)
    assert final.finish_reason == "stop"
    assert [c.name for c in parsed.tool_calls] == ["grep"]
    jsonschema.validate(parsed.tool_calls[0].arguments, TOOLS[1]["function"]["parameters"])


def test_grammar_under_speculation_matches_plain_decoding(engine, chat, tmp_path):
    """A json_schema request decoded with prompt lookup and a (random) DFlash drafter gives the same
    greedy output as plain decoding, and that output validates."""
    prepared = chat.prepare(
        _conversation("Describe this package as JSON: name dflash-agent, version 3, tags fast, local."),
        ChatOptions(response_format={"type": "json_schema", "json_schema": {"name": "pkg", "schema": SCHEMA}}),
    )
    cfg = engine.model.config
    drafter = load_drafter(
        init_drafter_checkpoint(tmp_path / "draft", cfg.hidden_size, cfg.num_layers, 4, num_layers=1, block_size=6),
        cfg.hidden_size, cfg.num_layers, cfg.vocab_size, engine.model.device, engine.model.dtype,
    )
    outputs = []
    for draft, spec in ((None, SpecConfig(enabled=False)), (drafter, SpecConfig(block=6))):
        spec_engine = Engine(engine.model, engine.tokenizer, engine.n_ctx, drafter=draft, spec=spec,
                             runner=engine.runner)
        try:
            parsed, final = complete_chat(spec_engine, prepared, max_tokens=96)
        finally:
            spec_engine.close()
        outputs.append((parsed.content, final))
    (plain, _), (speculative, final) = outputs
    assert speculative == plain
    jsonschema.validate(json.loads(plain), SCHEMA)
    assert final.timings.draft_n > 0


def test_tool_choice_none_hides_the_tools(chat):
    prepared = chat.prepare(_conversation("hi", TOOLS), ChatOptions(tool_choice="none"))
    assert "read_file" not in prepared.prompt and prepared.grammar is None


def test_bad_requests(chat):
    with pytest.raises(ChatError, match="nope"):
        chat.prepare(_conversation("x", TOOLS), ChatOptions(tool_choice={"type": "function", "function": {"name": "nope"}}))
    with pytest.raises(ChatError):
        chat.prepare(_conversation("x"), ChatOptions(tool_choice="required"))
    with pytest.raises(ChatError):
        conversation_from_openai([{"role": "tool", "tool_call_id": "c1", "content": "out"}])
