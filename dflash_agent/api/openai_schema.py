"""OpenAI wire format: request bodies and responses as msgspec Structs. Messages and tools stay
plain JSON here: the chat layer's converters validate them and name the exact offending field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from ..engine import FinalEvent

# Sampling fields are checked as the body is decoded, before any work: finite and within the range where they
# mean something. (A tiny positive temperature or top_p is greedy decoding; above MAX_TEMPERATURE every
# token is about as likely as any other.) Shared by all three APIs.
MAX_TEMPERATURE = 100.0
SAMPLING_RANGES = {"temperature": f"in [0, {MAX_TEMPERATURE:g}]", "top_p": "in (0, 1]", "top_k": "an integer >= 0",
                   "min_p": "in [0, 1]"}  # what a 400 says: "top_p must be in (0, 1]"
Temperature = Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct):
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_prompt: bool = True  # llama.cpp's field: reuse the KV of a cached prefix
    logprobs: bool | int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = []
    model: str = ""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[Any] = ""  # text, token ids, or a batch of one of either
    model: str = ""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# --- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, final: FinalEvent) -> Usage:
        u = final.usage
        return cls(u.prompt_tokens, u.completion_tokens, u.prompt_tokens + u.completion_tokens,
                   PromptTokensDetails(u.cached_tokens))


class Timings(msgspec.Struct):
    """llama.cpp's `timings` object, field for field; draft_* only when something was drafted."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int | UnsetType = UNSET
    draft_n_accepted: int | UnsetType = UNSET

    @classmethod
    def of(cls, final: FinalEvent) -> Timings:
        t = final.timings
        drafted = t.draft_n > 0
        return cls(
            t.cache_n, t.prompt_n, t.prompt_ms, t.prompt_ms / t.prompt_n if t.prompt_n else 0.0, t.prompt_per_second,
            t.predicted_n, t.predicted_ms, t.predicted_ms / t.predicted_n if t.predicted_n else 0.0,
            t.predicted_per_second,
            t.draft_n if drafted else UNSET, t.draft_n_accepted if drafted else UNSET,
        )


class Function(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    id: str
    function: Function
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct):
    content: str | None
    role: Literal["assistant"] = "assistant"
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str = "dflash-agent"


class FunctionDelta(msgspec.Struct):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ToolCallDelta(msgspec.Struct):
    index: int
    function: FunctionDelta
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET


class ChoiceDelta(msgspec.Struct):
    role: Literal["assistant"] | UnsetType = UNSET
    content: str | None | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChunkChoice(msgspec.Struct):
    index: int
    delta: ChoiceDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str = "dflash-agent"
    usage: Usage | None | UnsetType = UNSET
    timings: Timings | UnsetType = UNSET


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str = "dflash-agent"
    usage: Usage | None | UnsetType = UNSET
    timings: Timings | UnsetType = UNSET


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    meta: dict[str, Any]
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"
