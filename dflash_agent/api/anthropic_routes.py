"""Anthropic-compatible routes: /v1/messages (what Claude Code speaks) and /v1/messages/count_tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Router, post
from litestar.datastructures import State
from litestar.params import JSONBody

from ..chat.anthropic_messages import conversation_from_anthropic
from ..chat.chat_format import ChatOptions
from ..chat.finish import Finish
from ..chat.parser import ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart
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
from .errors import APIError, anthropic_error, anthropic_payload, handlers
from .openai_schema import Timings
from .pipeline import Call, Dialect, Limit, Reply, Sampling, StreamEncoder, frames, run
from .service import EventStream, Generation, ServerState, stop_strings


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


# stop_reason; Anthropic's own when the window, not max_tokens, ended the answer (Claude Code tells them apart)
STOP_REASONS = {Finish.STOP: "end_turn", Finish.STOP_SEQUENCE: "stop_sequence", Finish.LENGTH: "max_tokens",
                Finish.CONTEXT_FULL: "model_context_window_exceeded", Finish.TOOL_CALLS: "tool_use",
                Finish.CANCELLED: "end_turn"}


class Messages(Dialect[MessagesRequest]):
    endpoint, id_prefix, finish_names = "messages", "msg_", STOP_REASONS

    async def parse(self, data: MessagesRequest, server: ServerState) -> Call:
        options = _options(data.tool_choice, data.thinking, _response_format(data))
        conversation = await asyncio.to_thread(conversation_from_anthropic, data.messages, data.system, data.tools)
        stop = stop_strings(data.stop_sequences, "stop_sequences")
        sampling = Sampling(data.temperature, data.top_p, data.top_k)
        return Call(conversation, sampling, Limit(data.max_tokens), data.stream, options, stop, data.cache_prompt)

    def stream(self, data: MessagesRequest, reply: Reply, generation: Generation) -> AsyncIterator[bytes]:
        return _message_events(generation, reply.request_id, reply.model.name, reply.n_prompt, reply.cached,
                               reply.call.stop)

    def whole(self, data: MessagesRequest, reply: Reply, events: list) -> MessageResponse:
        out, final = reply.parser.result(), events[-1]
        content: list = []
        if out.reasoning:
            content.append(ThinkingBlock(out.reasoning))
        if out.content:
            content.append(TextBlock(out.content))
        content += [ToolUseBlock(c.id, c.name, c.arguments) for c in out.tool_calls]
        reason, sequence = _stop_reason(final, bool(out.tool_calls), reply.call.stop)
        return MessageResponse(reply.request_id, reply.model.name, content, reason, sequence, MessageUsage.of(final),
                               timings=Timings.of(final))


def _stop_reason(final: FinalEvent, tool_calls: bool, stop: tuple[str, ...]) -> tuple[str, str | None]:
    """stop_reason, and the stop_sequence that ended the answer."""
    finish = Finish.of(final, tool_calls, stop)
    return Messages.finish_names[finish], final.stop if finish is Finish.STOP_SEQUENCE else None


@post("/v1/messages", status_code=200, summary="Create a message (Anthropic)")
async def messages(data: JSONBody[MessagesRequest], state: State) -> MessageResponse | EventStream:
    return await run(Messages(), data, state.server)


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode({"type": name, **payload}) + b"\n\n"


# Claude Code aborts a stream after 300 s without an event (pings do not count; CLAUDE_STREAM_IDLE_TIMEOUT_MS
# only raises it) and then retries without streaming, prefilling again from the start: a CPU's prefill of its
# first prompt can take longer. While nothing has been written yet, a message_delta that changes nothing (the
# API allows one or more; stop_reason stays null) restarts that timer, this often: each one also adds the usage
# so far to Claude Code's running totals once more, so few of them.
PREFILL_KEEPALIVE_S = 120.0


def _message_events(generation: Generation, message_id: str, model: str, n_prompt: int, cached: list[int],
                    stop: tuple[str, ...], keepalive_s: float = PREFILL_KEEPALIVE_S) -> AsyncIterator[bytes]:
    return frames(generation, _MessageEvents(message_id, model, n_prompt, cached, stop, keepalive_s))


@dataclass
class _MessageEvents(StreamEncoder):
    """A streamed message: a new content block opens whenever the kind of delta changes."""

    message_id: str
    model: str
    n_prompt: int
    cached: list[int]  # what the prefix cache serves, once the engine has told
    stop: tuple[str, ...]
    keepalive_s: float = PREFILL_KEEPALIVE_S  # the no-op message_delta's period before the first block
    started: bool = False
    quiet_since: float = 0.0  # when the last event a client's idle timer counts went out
    called: bool = False
    index: int = -1
    open: Any = None  # the open block: "thinking", "text" or ("tool", call index)

    def begin(self, n_cached: int) -> list[bytes]:
        """message_start waits for the engine to take the request and tell what its cache serves (SSE comments keep
        the connection alive while it is queued); then ping events, as Anthropic sends, while the prompt
        prefills."""
        if self.started:
            return []
        self.started, self.quiet_since = True, time.monotonic()
        # Anthropic's split, as message_delta and the non-streamed usage have it: input_tokens excludes the
        # cache reads, so a client adding the two counts each token once.
        usage = msgspec.to_builtins(MessageUsage(self.n_prompt - n_cached, 0, 0, n_cached))
        return [_event("message_start", {"message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage,
        }}), _event("ping", {})]

    def heartbeat(self) -> list[bytes]:
        if not self.started:
            return self.begin(sum(self.cached)) if self.cached else super().heartbeat()
        out = [_event("ping", {})]
        if self.index < 0 and time.monotonic() - self.quiet_since >= self.keepalive_s:  # still prefilling
            self.quiet_since = time.monotonic()
            out.append(_event("message_delta", {"delta": {"stop_reason": None, "stop_sequence": None},
                                                "usage": {"output_tokens": 0}}))
        return out

    def feed(self, event: object) -> list[bytes]:
        out = self.begin(sum(self.cached))
        if isinstance(event, ReasoningDelta):
            if self.open != "thinking":
                out += self.start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self.delta({"type": "thinking_delta", "thinking": event.text}))
        elif isinstance(event, TextDelta):
            if self.open != "text":
                out += self.start("text", {"type": "text", "text": ""})
            out.append(self.delta({"type": "text_delta", "text": event.text}))
        elif isinstance(event, ToolCallStart):
            self.called = True
            out += self.start(("tool", event.index), {"type": "tool_use", "id": event.id, "name": event.name,
                                                      "input": {}})
        elif isinstance(event, ToolCallArgsDelta):
            out.append(self.delta({"type": "input_json_delta", "partial_json": event.fragment}))
        return out

    def close(self, final: FinalEvent) -> list[bytes]:
        out = self.begin(final.usage.cached_tokens) + self.end_block()
        reason, sequence = _stop_reason(final, self.called, self.stop)
        usage = msgspec.to_builtins(MessageUsage.of(final))
        out.append(_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": usage, "timings": msgspec.to_builtins(Timings.of(final))}))
        out.append(_event("message_stop", {}))
        return out

    def failed(self, error: APIError) -> list[bytes]:
        return [b"event: error\ndata: " + msgspec.json.encode(anthropic_payload(error)) + b"\n\n"]

    def start(self, key: Any, block: dict[str, Any]) -> list[bytes]:
        out = self.end_block()
        self.index += 1
        self.open = key
        out.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def end_block(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(self.delta({"type": "signature_delta", "signature": ""}))
        out.append(_event("content_block_stop", {"index": self.index}))
        self.open = None
        return out


@post("/v1/messages/count_tokens", status_code=200, summary="Count a request's input tokens (Anthropic)")
async def count_tokens(data: JSONBody[CountTokensRequest], state: State) -> TokenCount:
    server: ServerState = state.server
    server.ready()
    # Forcing a call changes the output, not the prompt: no grammar to compile for a count.
    options = _options(None, data.thinking)
    conversation = await asyncio.to_thread(conversation_from_anthropic, data.messages, data.system, data.tools)
    prepared = await server.prepare_chat(conversation, options)
    return TokenCount(len(prepared.prompt_ids))


def anthropic_router() -> Router:
    return Router("/", route_handlers=[messages, count_tokens], exception_handlers=handlers(anthropic_error))
