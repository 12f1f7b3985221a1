"""OpenAI Responses API wire format: the request body as a msgspec Struct (input items and tools stay plain
JSON: the chat layer's converter validates them and names the offending field), and the usage object."""

from __future__ import annotations

from typing import Any

import msgspec

from ..engine import FinalEvent
from .openai_schema import MinP, Temperature, TopK, TopP


class PlainText(msgspec.Struct, tag="text", tag_field="type"):
    pass


class JSONObject(msgspec.Struct, tag="json_object", tag_field="type"):
    pass


class JSONSchema(msgspec.Struct, tag="json_schema", tag_field="type"):
    schema: dict[str, Any]
    name: str = "output"
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct):
    """`text`: the output's format (OpenAI's three shapes; anything else is a 400 naming `text.format`)."""

    format: PlainText | JSONObject | JSONSchema | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct):
    input: str | list[dict[str, Any]] = []
    model: str = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # extensions, as on /v1/chat/completions
    min_p: MinP | None = None
    seed: int | None = None
    stream: bool = False
    store: bool = True
    reasoning: dict[str, Any] | None = None
    text: TextConfig | None = None
    metadata: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    cache_prompt: bool = True  # llama.cpp's field


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class ResponseUsage(msgspec.Struct):
    """Responses counts cached tokens inside input_tokens, as Chat Completions does."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, final: FinalEvent, reasoning_tokens: int) -> ResponseUsage:
        u = final.usage
        return cls(u.prompt_tokens, InputTokensDetails(u.cached_tokens), u.completion_tokens,
                   OutputTokensDetails(reasoning_tokens), u.prompt_tokens + u.completion_tokens)
