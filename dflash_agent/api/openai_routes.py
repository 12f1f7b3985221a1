"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions and /v1/models, with the two dialects behind
the first two (pipeline.Dialect)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from litestar import Router, get, post
from litestar.datastructures import State
from litestar.params import JSONBody

from ..chat.chat_format import ChatOptions
from ..chat.finish import Finish
from ..chat.openai_messages import conversation_from_openai
from ..chat.parser import ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart
from ..engine import FinalEvent, TokenEvent
from .errors import APIError, handlers, openai_error, openai_payload
from .openai_schema import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceDelta,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Function,
    FunctionDelta,
    ModelCard,
    ModelList,
    SamplingFields,
    Timings,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from .pipeline import Call, Dialect, Limit, Reply, Sampling, StreamEncoder, frames, run
from .service import EventStream, Generation, ServerState, check_token_ids, stop_strings

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for the legacy completions endpoint

# finish_reason, for chat and text completions alike
FINISH_REASONS = {Finish.STOP: "stop", Finish.STOP_SEQUENCE: "stop", Finish.LENGTH: "length",
                  Finish.CONTEXT_FULL: "length", Finish.TOOL_CALLS: "tool_calls", Finish.CANCELLED: "stop"}


def _refuse_unsupported(body: SamplingFields, **fields: str) -> None:
    """Values we cannot honour get a 400 rather than a silently different answer; `fields`: the endpoint's own,
    each with what a request that sets it is told."""
    if body.n not in (None, 1):
        raise APIError(400, f"n={body.n} is not supported: this server returns one choice per request", param="n")
    if body.logprobs:
        raise APIError(400, "logprobs are not supported", param="logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported (only 0)", param=name)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    for name, message in fields.items():
        if getattr(body, name):
            raise APIError(400, message, param=name)


def _sampling(body: SamplingFields) -> Sampling:
    return Sampling(body.temperature, body.top_p, body.top_k, body.min_p, body.seed)


def _sse(payload: msgspec.Struct | dict) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


@dataclass
class _OpenAIStream(StreamEncoder):
    """What both endpoints' streams share: an error as a data line, as OpenAI sends it, and [DONE] last."""

    request_id: str
    created: int
    model: str
    include_usage: bool
    stop: tuple[str, ...]

    def failed(self, error: APIError) -> list[bytes]:
        return [_sse(openai_payload(error))]

    def trailer(self) -> list[bytes]:
        return [b"data: [DONE]\n\n"]


# --- chat completions ------------------------------------------------------------------------------


class ChatCompletions(Dialect[ChatCompletionRequest]):
    endpoint, id_prefix, finish_names = "chat", "chatcmpl-", FINISH_REASONS

    async def parse(self, data: ChatCompletionRequest, server: ServerState) -> Call:
        _refuse_unsupported(data, top_logprobs="top_logprobs is not supported")
        # off the event loop, as every conversion: 300,000 messages took seconds, /health waiting behind them
        conversation = await asyncio.to_thread(conversation_from_openai, data.messages, data.tools)
        kwargs = data.chat_template_kwargs or {}
        thinking = bool(kwargs.get("enable_thinking", data.reasoning_effort not in (None, "none", "minimal")))
        options = ChatOptions(
            tool_choice=data.tool_choice if data.tool_choice is not None else "auto",
            parallel_tool_calls=True if data.parallel_tool_calls is None else data.parallel_tool_calls,
            response_format=data.response_format, enable_thinking=thinking,
        )
        if data.max_completion_tokens is not None:
            limit = Limit(data.max_completion_tokens, "max_completion_tokens", server.settings.max_tokens)
        else:
            limit = Limit(data.max_tokens, "max_tokens", server.settings.max_tokens)
        return Call(conversation, _sampling(data), limit, data.stream, options, stop_strings(data.stop),
                    data.cache_prompt)

    def stream(self, data: ChatCompletionRequest, reply: Reply, generation: Generation) -> AsyncIterator[bytes]:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        # an answer that must be a tool call has no content, as the non-streamed message's null says
        forced = bool(data.tools) and reply.call.options.tool_choice not in ("auto", "none")
        return _chat_chunks(generation, reply.request_id, reply.created, reply.model.name, include_usage,
                            None if forced else "", reply.call.stop)

    def whole(self, data: ChatCompletionRequest, reply: Reply, events: list) -> ChatCompletion:
        out, final = reply.parser.result(), events[-1]
        calls = [ToolCall(c.id, Function(c.name, msgspec.json.encode(c.arguments).decode())) for c in out.tool_calls]
        message = ChatMessage(
            content=out.content if out.content or not calls else None,
            reasoning_content=out.reasoning if out.reasoning is not None else msgspec.UNSET,
            tool_calls=calls or msgspec.UNSET,
        )
        choice = ChatChoice(0, message, self.finish_name(final, bool(calls), reply.call.stop))
        return ChatCompletion(reply.request_id, reply.created, reply.model.name, [choice], Usage.of(final),
                              Timings.of(final))


def _chat_chunks(generation: Generation, request_id: str, created: int, model: str, include_usage: bool,
                 content: str | None = "", stop: tuple[str, ...] = ()) -> AsyncIterator[bytes]:
    return frames(generation, _ChatChunks(request_id, created, model, include_usage, stop, content))


@dataclass
class _ChatChunks(_OpenAIStream):
    content: str | None = ""  # the first chunk's: None when the answer must be a tool call
    called: bool = False

    def chunk(self, delta: ChoiceDelta, finish: str | None = None, **extra) -> bytes:
        usage = None if self.include_usage else msgspec.UNSET
        return _sse(ChatCompletionChunk(self.request_id, self.created, self.model, [ChunkChoice(0, delta, finish)],
                                        usage=usage, **extra))

    def opening(self) -> list[bytes]:
        return [self.chunk(ChoiceDelta(role="assistant", content=self.content))]

    def feed(self, event: object) -> list[bytes]:
        if isinstance(event, TextDelta):
            return [self.chunk(ChoiceDelta(content=event.text))]
        if isinstance(event, ReasoningDelta):
            return [self.chunk(ChoiceDelta(reasoning_content=event.text))]
        if isinstance(event, ToolCallStart):
            self.called = True
            call = ToolCallDelta(event.index, FunctionDelta(event.name, ""), id=event.id, type="function")
            return [self.chunk(ChoiceDelta(tool_calls=[call]))]
        if isinstance(event, ToolCallArgsDelta):
            return [self.chunk(ChoiceDelta(tool_calls=[ToolCallDelta(event.index, FunctionDelta(
                arguments=event.fragment))]))]
        return []

    def close(self, final: FinalEvent) -> list[bytes]:
        out = [self.chunk(ChoiceDelta(), ChatCompletions.finish_name(final, self.called, self.stop),
                          timings=Timings.of(final))]
        if self.include_usage:
            out.append(_sse(ChatCompletionChunk(self.request_id, self.created, self.model, [],
                                                usage=Usage.of(final))))
        return out


# --- completions -----------------------------------------------------------------------------------


class Completions(Dialect[CompletionRequest]):
    endpoint, id_prefix, finish_names = "completions", "cmpl-", FINISH_REASONS

    async def parse(self, data: CompletionRequest, server: ServerState) -> Call:
        _refuse_unsupported(data, echo="echo is not supported", suffix="suffix (fill-in-the-middle) is not supported")
        if data.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", param="best_of")
        stop = stop_strings(data.stop)
        prompt_ids = await _prompt_ids(data.prompt, server)
        limit = Limit(data.max_tokens, default=_completion_default(server.settings.max_tokens))
        return Call(prompt_ids, _sampling(data), limit, data.stream, stop=stop, cache_prompt=data.cache_prompt)

    def stream(self, data: CompletionRequest, reply: Reply, generation: Generation) -> AsyncIterator[bytes]:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return frames(generation, _CompletionChunks(reply.request_id, reply.created, reply.model.name,
                                                    include_usage, reply.call.stop))

    def whole(self, data: CompletionRequest, reply: Reply, events: list) -> Completion:
        final = events[-1]
        text = "".join(e.text_delta for e in events if isinstance(e, TokenEvent))
        choice = CompletionChoice(0, text, self.finish_name(final, False, reply.call.stop))
        return Completion(reply.request_id, reply.created, reply.model.name, [choice], usage=Usage.of(final),
                          timings=Timings.of(final))


def _completion_default(server_max_tokens: int | None) -> int:
    """OpenAI's default for this endpoint, unless the server's own is lower."""
    return min(DEFAULT_COMPLETION_TOKENS, server_max_tokens or DEFAULT_COMPLETION_TOKENS)


async def _prompt_ids(prompt: str | list, server: ServerState) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        return await server.encode(prompt)
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if any(isinstance(t, (str, list)) for t in prompt):
        raise APIError(400, "a batch of several prompts is not supported: send one prompt per request",
                       param="prompt")
    if not all(type(t) is int for t in prompt):  # JSON true / false decode as ints otherwise
        raise APIError(400, "prompt must be a string or a list of integer token ids", param="prompt")
    check_token_ids(prompt, server.ready().engine.model.config.vocab_size, "prompt")
    return list(prompt)


@dataclass
class _CompletionChunks(_OpenAIStream):
    def chunk(self, text: str, finish: str | None = None, **extra) -> bytes:
        usage = None if self.include_usage else msgspec.UNSET
        return _sse(Completion(self.request_id, self.created, self.model, [CompletionChoice(0, text, finish)],
                               usage=usage, **extra))

    def feed(self, event: object) -> list[bytes]:
        return [self.chunk(event.text_delta)] if isinstance(event, TokenEvent) and event.text_delta else []

    def close(self, final: FinalEvent) -> list[bytes]:
        out = [self.chunk("", Completions.finish_name(final, False, self.stop), timings=Timings.of(final))]
        if self.include_usage:
            out.append(_sse(Completion(self.request_id, self.created, self.model, [], usage=Usage.of(final))))
        return out


# --- routes ----------------------------------------------------------------------------------------


@post("/v1/chat/completions", status_code=200, summary="Chat completion (OpenAI)")
async def chat_completions(data: JSONBody[ChatCompletionRequest], state: State) -> ChatCompletion | EventStream:
    return await run(ChatCompletions(), data, state.server)


@post("/v1/completions", status_code=200, summary="Text completion (OpenAI legacy)")
async def completions(data: JSONBody[CompletionRequest], state: State) -> Completion | EventStream:
    return await run(Completions(), data, state.server)


@get("/v1/models", summary="The served model")
async def models(state: State) -> ModelList:
    server: ServerState = state.server
    model = server.ready()
    cfg = model.engine.model.config
    # llama-server's names, and vLLM's max_model_len: what clients size their prompts by; max_output_tokens the
    # server's cap on an answer that sets none (None: until the context is full)
    meta = {"n_ctx": model.engine.n_ctx, "max_model_len": model.engine.n_ctx,
            "max_output_tokens": server.settings.max_tokens,
            "n_ctx_train": cfg.max_position_embeddings, "n_vocab": cfg.vocab_size,
            "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "family": cfg.family,
            "draft": model.engine.drafter is not None,
            # What a request that leaves them out gets from the model (remote agents default to the same).
            "sampling_defaults": model.engine.sampling_defaults.fields()}
    return ModelList([ModelCard(model.name, int(time.time()), "dflash-agent", meta)])


def openai_router() -> Router:
    return Router("/", route_handlers=[chat_completions, completions, models],
                  exception_handlers=handlers(openai_error))
