"""Anthropic Messages wire format as msgspec Structs. Messages, system and tools stay plain JSON:
the chat layer's converter validates them and names the offending field."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from ..engine import FinalEvent
from .openai_schema import Temperature, Timings, TopK, TopP


class MessagesRequest(msgspec.Struct):
    max_tokens: int
    messages: list[dict[str, Any]]
    model: str = ""
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # Structured outputs: `output_config.format` (what Claude Code sends for its session titles) or the beta's
    # top-level `output_format`, {"type": "json_schema", "schema": {...}}. `output_config.effort` is accepted.
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    cache_prompt: bool = True  # llama.cpp's field, accepted here too


class CountTokensRequest(msgspec.Struct):
    messages: list[dict[str, Any]]
    model: str = ""
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class TokenCount(msgspec.Struct):
    input_tokens: int


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # we cannot sign; clients send it back unchanged and we ignore it


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class MessageUsage(msgspec.Struct):
    """Anthropic counts cached prompt tokens apart: input = input_tokens + cache_read_input_tokens."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, final: FinalEvent) -> MessageUsage:
        u = final.usage
        return cls(u.prompt_tokens - u.cached_tokens, u.completion_tokens, 0, u.cached_tokens)


class MessageResponse(msgspec.Struct):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    timings: Timings | UnsetType = UNSET
