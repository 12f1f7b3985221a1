"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from litestar import Router, get, post
from litestar.datastructures import State
from litestar.params import JSONBody

from ..chat.chat_format import ChatOptions, stream_chat
from ..chat.openai_messages import conversation_from_openai
from ..chat.parser import ParsedOutput, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart
from ..engine import FinalEvent, GenerateRequest, StopCriteria, TokenEvent
from .errors import APIError, as_api_error, handlers, openai_error, openai_payload
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
from .service import (
    HEARTBEAT,
    EventStream,
    Generation,
    ServerState,
    check_token_ids,
    max_new_tokens,
    sampling_params,
    stop_strings,
)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


def _refuse_unsupported(body: SamplingFields) -> None:
    """Values we cannot honour get a 400 rather than a silently different answer."""
    if body.n not in (None, 1):
        raise APIError(400, f"n={body.n} is not supported: this server returns one choice per request", param="n")
    if body.logprobs:
        raise APIError(400, "logprobs are not supported", param="logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported (only 0)", param=name)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")


def _finish_reason(final: FinalEvent, tool_calls: bool) -> str:
    if final.finish_reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def _sse(payload: msgspec.Struct | dict) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def _sse_error(exc: Exception) -> bytes:
    return _sse(openai_payload(as_api_error(exc)))


# --- chat completions ------------------------------------------------------------------------------


@post("/v1/chat/completions", status_code=200, summary="Chat completion (OpenAI)")
async def chat_completions(data: JSONBody[ChatCompletionRequest], state: State) -> ChatCompletion | EventStream:
    server: ServerState = state.server
    model = server.ready()
    _refuse_unsupported(data)
    if data.top_logprobs:
        raise APIError(400, "top_logprobs is not supported", param="top_logprobs")
    conversation = conversation_from_openai(data.messages, data.tools)
    kwargs = data.chat_template_kwargs or {}
    thinking = bool(kwargs.get("enable_thinking", data.reasoning_effort not in (None, "none", "minimal")))
    options = ChatOptions(
        tool_choice=data.tool_choice if data.tool_choice is not None else "auto",
        parallel_tool_calls=True if data.parallel_tool_calls is None else data.parallel_tool_calls,
        response_format=data.response_format, enable_thinking=thinking,
    )
    stop = stop_strings(data.stop)
    prepared = await server.prepare_chat(conversation, options)
    server.check_context(len(prepared.prompt_ids))
    sampling = sampling_params(model.engine.sampling_defaults, data.temperature, data.top_p, data.top_k, data.min_p,
                               data.seed)
    param = "max_completion_tokens" if data.max_completion_tokens is not None else "max_tokens"
    max_tokens = max_new_tokens(data.max_completion_tokens, data.max_tokens, param=param,
                                default=server.settings.max_tokens)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    parser = prepared.parser()
    source = stream_chat(model.engine, prepared, parser, sampling, max_tokens, stop, request_id,
                         cache_prompt=data.cache_prompt)
    generation = server.start(source, "chat")
    created = int(time.time())
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        # an answer that must be a tool call has no content, as the non-streamed message's null says
        forced = bool(data.tools) and options.tool_choice not in ("auto", "none")
        return EventStream(_chat_chunks(generation, request_id, created, model.name, include_usage,
                                        None if forced else ""))
    events = await generation.collect()
    final = events[-1]
    return _chat_completion(parser.result(), final, request_id, created, model.name)


def _chat_completion(out: ParsedOutput, final: FinalEvent, request_id: str, created: int, model: str) -> ChatCompletion:
    calls = [ToolCall(c.id, Function(c.name, msgspec.json.encode(c.arguments).decode())) for c in out.tool_calls]
    message = ChatMessage(
        content=out.content if out.content or not calls else None,
        reasoning_content=out.reasoning if out.reasoning is not None else msgspec.UNSET,
        tool_calls=calls or msgspec.UNSET,
    )
    choice = ChatChoice(0, message, _finish_reason(final, bool(calls)))
    return ChatCompletion(request_id, created, model, [choice], Usage.of(final), Timings.of(final))


async def _chat_chunks(generation: Generation, request_id: str, created: int, model: str,
                       include_usage: bool, content: str | None = "") -> AsyncIterator[bytes]:
    def chunk(delta: ChoiceDelta, finish: str | None = None, **extra) -> bytes:
        usage = None if include_usage else msgspec.UNSET
        return _sse(ChatCompletionChunk(request_id, created, model, [ChunkChoice(0, delta, finish)], usage=usage,
                                        **extra))

    yield chunk(ChoiceDelta(role="assistant", content=content))
    called = False
    try:
        async for event in generation.events():
            if event is HEARTBEAT:
                yield b": ping\n\n"
            elif isinstance(event, TextDelta):
                yield chunk(ChoiceDelta(content=event.text))
            elif isinstance(event, ReasoningDelta):
                yield chunk(ChoiceDelta(reasoning_content=event.text))
            elif isinstance(event, ToolCallStart):
                called = True
                call = ToolCallDelta(event.index, FunctionDelta(event.name, ""), id=event.id, type="function")
                yield chunk(ChoiceDelta(tool_calls=[call]))
            elif isinstance(event, ToolCallArgsDelta):
                call = ToolCallDelta(event.index, FunctionDelta(arguments=event.fragment))
                yield chunk(ChoiceDelta(tool_calls=[call]))
            elif isinstance(event, FinalEvent):
                yield chunk(ChoiceDelta(), _finish_reason(event, called), timings=Timings.of(event))
                if include_usage:
                    yield _sse(ChatCompletionChunk(request_id, created, model, [], usage=Usage.of(event)))
    except Exception as exc:  # the status line is gone: report in the stream, as OpenAI does
        yield _sse_error(exc)
    yield b"data: [DONE]\n\n"


# --- completions -----------------------------------------------------------------------------------


@post("/v1/completions", status_code=200, summary="Text completion (OpenAI legacy)")
async def completions(data: JSONBody[CompletionRequest], state: State) -> Completion | EventStream:
    server: ServerState = state.server
    model = server.ready()
    _refuse_unsupported(data)
    if data.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if data.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    if data.best_of not in (None, 1):
        raise APIError(400, "best_of is not supported", param="best_of")
    stop = stop_strings(data.stop)
    prompt_ids = await _prompt_ids(data.prompt, server)
    server.check_context(len(prompt_ids))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    sampling = sampling_params(model.engine.sampling_defaults, data.temperature, data.top_p, data.top_k, data.min_p,
                               data.seed)
    request = GenerateRequest(
        prompt_ids, sampling,
        StopCriteria(strings=stop),
        max_new_tokens(data.max_tokens, default=_completion_default(server.settings.max_tokens)),
        request_id=request_id,
        cache_prompt=data.cache_prompt,
    )
    generation = server.start(model.engine.generate(request), "completions")
    created = int(time.time())
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return EventStream(_completion_chunks(generation, request_id, created, model.name, include_usage))
    events = await generation.collect()
    final = events[-1]
    text = "".join(e.text_delta for e in events if isinstance(e, TokenEvent))
    choice = CompletionChoice(0, text, _finish_reason(final, False))
    return Completion(request_id, created, model.name, [choice], usage=Usage.of(final), timings=Timings.of(final))


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


async def _completion_chunks(generation: Generation, request_id: str, created: int, model: str,
                             include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(text: str, finish: str | None = None, **extra) -> bytes:
        usage = None if include_usage else msgspec.UNSET
        return _sse(Completion(request_id, created, model, [CompletionChoice(0, text, finish)], usage=usage, **extra))

    try:
        async for event in generation.events():
            if event is HEARTBEAT:
                yield b": ping\n\n"
            elif isinstance(event, TokenEvent):
                if event.text_delta:
                    yield chunk(event.text_delta)
            elif isinstance(event, FinalEvent):
                yield chunk("", _finish_reason(event, False), timings=Timings.of(event))
                if include_usage:
                    yield _sse(Completion(request_id, created, model, [], usage=Usage.of(event)))
    except Exception as exc:
        yield _sse_error(exc)
    yield b"data: [DONE]\n\n"


# --- models ----------------------------------------------------------------------------------------


@get("/v1/models", summary="The served model")
async def models(state: State) -> ModelList:
    server: ServerState = state.server
    model = server.ready()
    cfg = model.engine.model.config
    meta = {"n_ctx": model.engine.n_ctx, "n_ctx_train": cfg.max_position_embeddings, "n_vocab": cfg.vocab_size,
            "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "family": cfg.family,
            "draft": model.engine.drafter is not None,
            # What a request that leaves them out gets from the model (remote agents default to the same).
            "sampling_defaults": model.engine.sampling_defaults.fields()}
    return ModelList([ModelCard(model.name, int(time.time()), "dflash-agent", meta)])


def openai_router() -> Router:
    return Router("/", route_handlers=[chat_completions, completions, models],
                  exception_handlers=handlers(openai_error))
