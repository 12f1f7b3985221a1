"""Anthropic-compatible routes: /v1/messages (what Claude Code speaks) and /v1/messages/count_tokens."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Router, post
from litestar.datastructures import State
from litestar.params import JSONBody

from ..chat.anthropic_messages import conversation_from_anthropic
from ..chat.chat_format import ChatOptions, stream_chat
from ..chat.parser import ParsedOutput, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart
from ..engine import FinalEvent
from .anthropic_schema import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    MessageUsage,
    TextBlock,
    ThinkingBlock,
    TokenCount,
    ToolUseBlock,
)
from .errors import APIError, anthropic_error, anthropic_payload, as_api_error, handlers
from .openai_schema import Timings
from .service import HEARTBEAT, EventStream, Generation, ServerState, max_new_tokens, sampling_params, stop_strings


def _response_format(data: MessagesRequest) -> Any:
    """Anthropic's structured-output format as Chat Completions' response_format (forced by a grammar)."""
    if data.output_config is not None and not isinstance(data.output_config, dict):
        raise APIError(400, "output_config must be an object", param="output_config")
    fmt, param = (data.output_config or {}).get("format"), "output_config.format"
    if fmt is None:
        fmt, param = data.output_format, "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, f'{param} must be {{"type": "json_schema", "schema": {{...}}}}', param=param)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _options(tool_choice: dict[str, Any] | None, thinking: dict[str, Any] | None,
             response_format: Any = None) -> ChatOptions:
    choice: Any = "auto"
    parallel = True
    if tool_choice is not None:
        kind = tool_choice.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise APIError(400, f"tool_choice.type must be auto, any, tool or none, not {kind!r}",
                           param="tool_choice.type")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind, tool_choice)
        parallel = not tool_choice.get("disable_parallel_tool_use", False)
    enabled = thinking is not None and thinking.get("type") in ("enabled", "adaptive")
    return ChatOptions(tool_choice=choice, parallel_tool_calls=parallel, response_format=response_format,
                       enable_thinking=enabled)


def _stop_reason(final: FinalEvent, tool_calls: bool, stop_sequences: tuple[str, ...]) -> tuple[str, str | None]:
    if final.finish_reason == "length":  # first: a tool call cut by the limit is not one to run (as OpenAI's length)
        # Anthropic's reason when the window, not max_tokens, ended the answer (Claude Code tells them apart).
        return ("model_context_window_exceeded" if final.context_full else "max_tokens"), None
    if tool_calls:
        return "tool_use", None
    if isinstance(final.stop, str) and final.stop in stop_sequences:
        return "stop_sequence", final.stop
    return "end_turn", None


@post("/v1/messages", status_code=200, summary="Create a message (Anthropic)")
async def messages(data: JSONBody[MessagesRequest], state: State) -> MessageResponse | EventStream:
    server: ServerState = state.server
    model = server.ready()
    options = _options(data.tool_choice, data.thinking, _response_format(data))
    conversation = conversation_from_anthropic(data.messages, data.system, data.tools)
    stop = stop_strings(data.stop_sequences, "stop_sequences")
    prepared = await server.prepare_chat(conversation, options)
    server.check_context(len(prepared.prompt_ids))
    sampling = sampling_params(model.engine.sampling_defaults, data.temperature, data.top_p, data.top_k, None, None)
    max_tokens = max_new_tokens(data.max_tokens)
    message_id = f"msg_{uuid.uuid4().hex}"
    parser = prepared.parser()
    cached: list[int] = []  # the prompt tokens the prefix cache serves, told before the first token
    source = stream_chat(model.engine, prepared, parser, sampling, max_tokens, stop, message_id,
                         cache_prompt=data.cache_prompt, on_prefix=cached.append)
    generation = server.start(source, "messages")
    if data.stream:
        events = _message_events(generation, message_id, model.name, len(prepared.prompt_ids), cached, stop)
        return EventStream(events)
    final = (await generation.collect())[-1]
    return _message(parser.result(), final, message_id, model.name, stop)


def _message(out: ParsedOutput, final: FinalEvent, message_id: str, model: str,
             stop: tuple[str, ...]) -> MessageResponse:
    content: list = []
    if out.reasoning:
        content.append(ThinkingBlock(out.reasoning))
    if out.content:
        content.append(TextBlock(out.content))
    content += [ToolUseBlock(c.id, c.name, c.arguments) for c in out.tool_calls]
    reason, sequence = _stop_reason(final, bool(out.tool_calls), stop)
    return MessageResponse(message_id, model, content, reason, sequence, MessageUsage.of(final),
                           timings=Timings.of(final))


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode({"type": name, **payload}) + b"\n\n"


class _Blocks:
    """Content blocks of a streamed message: a new block opens whenever the kind of delta changes."""

    def __init__(self) -> None:
        self.index = -1
        self.open: Any = None  # "thinking", "text" or ("tool", call index)

    def start(self, key: Any, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self.index += 1
        self.open = key
        events.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        return events

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(self.delta({"type": "signature_delta", "signature": ""}))
        events.append(_event("content_block_stop", {"index": self.index}))
        self.open = None
        return events


async def _message_events(generation: Generation, message_id: str, model: str, n_prompt: int,
                          cached: list[int], stop: tuple[str, ...]) -> AsyncIterator[bytes]:
    def message_start(n_cached: int) -> bytes:
        # Anthropic's split, as message_delta and the non-streamed usage have it: input_tokens excludes the
        # cache reads, so a client adding the two counts each token once.
        usage = msgspec.to_builtins(MessageUsage(n_prompt - n_cached, 0, 0, n_cached))
        return _event("message_start", {"message": {
            "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage,
        }})

    started = False
    blocks = _Blocks()
    called = False
    try:
        async for event in generation.events():
            if not started:
                # message_start waits for the engine to take the request and tell what its cache serves (SSE
                # comments keep the connection alive while it is queued); then ping events, as Anthropic sends,
                # while the prompt prefills.
                if event is HEARTBEAT and not cached:
                    yield b": ping\n\n"
                    continue
                yield message_start(event.usage.cached_tokens if isinstance(event, FinalEvent) else sum(cached))
                yield _event("ping", {})
                started = True
                if event is HEARTBEAT:
                    continue
            if event is HEARTBEAT:
                yield _event("ping", {})
            elif isinstance(event, ReasoningDelta):
                if blocks.open != "thinking":
                    for e in blocks.start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield e
                yield blocks.delta({"type": "thinking_delta", "thinking": event.text})
            elif isinstance(event, TextDelta):
                if blocks.open != "text":
                    for e in blocks.start("text", {"type": "text", "text": ""}):
                        yield e
                yield blocks.delta({"type": "text_delta", "text": event.text})
            elif isinstance(event, ToolCallStart):
                called = True
                block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
                for e in blocks.start(("tool", event.index), block):
                    yield e
            elif isinstance(event, ToolCallArgsDelta):
                yield blocks.delta({"type": "input_json_delta", "partial_json": event.fragment})
            elif isinstance(event, FinalEvent):
                for e in blocks.close():
                    yield e
                reason, sequence = _stop_reason(event, called, stop)
                usage = msgspec.to_builtins(MessageUsage.of(event))
                yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                               "usage": usage, "timings": msgspec.to_builtins(Timings.of(event))})
                yield _event("message_stop", {})
    except Exception as exc:  # the status line is gone: an error event, as Anthropic sends
        yield b"event: error\ndata: " + msgspec.json.encode(anthropic_payload(as_api_error(exc))) + b"\n\n"


@post("/v1/messages/count_tokens", status_code=200, summary="Count a request's input tokens (Anthropic)")
async def count_tokens(data: JSONBody[CountTokensRequest], state: State) -> TokenCount:
    server: ServerState = state.server
    server.ready()
    # Forcing a call changes the output, not the prompt: no grammar to compile for a count.
    options = _options(None, data.thinking)
    conversation = conversation_from_anthropic(data.messages, data.system, data.tools)
    prepared = await server.prepare_chat(conversation, options)
    return TokenCount(len(prepared.prompt_ids))


def anthropic_router() -> Router:
    return Router("/", route_handlers=[messages, count_tokens], exception_handlers=handlers(anthropic_error))
