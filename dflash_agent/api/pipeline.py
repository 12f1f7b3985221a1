"""The one path of every generating route: a `Dialect` (one per wire format) parses its body into a `Call`, `run`
checks, admits and starts it, and the dialect writes the events back as one body or as a stream of SSE frames
(`frames`). What the wire formats share (the order of the checks, admission, heartbeats, cancellation when the
client goes away, an error once the stream has begun) is written here once."""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from ..chat.chat_format import ChatOptions, LoadedModel, stream_chat
from ..chat.finish import Finish
from ..chat.parser import OutputParser
from ..chat.types import Conversation
from ..engine import FinalEvent, GenerateRequest, SamplingParams, StopCriteria
from .errors import APIError, as_api_error
from .service import HEARTBEAT, EventStream, Generation, ServerState, max_new_tokens, sampling_params

PING = b": ping\n\n"  # an SSE comment: it keeps an idle connection open, and clients skip it


class Sampling(NamedTuple):
    """The sampling values a request sets; None takes the checkpoint's default, else the API's."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None


class Limit(NamedTuple):
    """A request's output limit, the field a refusal names, and what a request that sets none gets."""

    value: int | None
    param: str = "max_tokens"
    default: int | None = None


@dataclass(frozen=True)
class Call:
    """A request in the engine's terms, as its dialect parsed it: checked, but nothing rendered or run yet."""

    prompt: Conversation | list[int]  # a chat to render, or a text completion's token ids
    sampling: Sampling
    limit: Limit
    stream: bool
    options: ChatOptions = ChatOptions()
    stop: tuple[str, ...] = ()
    cache_prompt: bool = True


@dataclass(frozen=True)
class Reply:
    """What a dialect's encoders know of the request they answer."""

    request_id: str
    created: int  # when it started, in seconds
    model: LoadedModel
    call: Call
    sampling: SamplingParams  # what the request got, defaults filled in
    n_prompt: int
    parser: OutputParser | None  # what parses a chat's output; None for a text completion
    cached: list[int]  # the prompt tokens the prefix cache serves, told before the first token


class StreamEncoder(ABC):
    """One streamed response: the SSE frames each event of its generation becomes (`frames` drives it)."""

    def opening(self) -> list[bytes]:
        return []

    def heartbeat(self) -> list[bytes]:
        return [PING]

    @abstractmethod
    def feed(self, event: Any) -> list[bytes]: ...  # a parsed delta, or a text completion's TokenEvent

    @abstractmethod
    def close(self, final: FinalEvent) -> list[bytes]: ...

    @abstractmethod
    def failed(self, error: APIError) -> list[bytes]: ...

    def trailer(self) -> list[bytes]:
        return []


async def frames(generation: Generation, encoder: StreamEncoder) -> AsyncIterator[bytes]:
    """A generation's events as `encoder`'s frames. Closing this (the client went away) closes the events, which
    stops the engine's work at its next step."""
    for frame in encoder.opening():
        yield frame
    try:
        async with aclosing(generation.events()) as events:
            async for event in events:
                if event is HEARTBEAT:
                    batch = encoder.heartbeat()
                elif isinstance(event, FinalEvent):
                    batch = encoder.close(event)
                else:
                    batch = encoder.feed(event)
                for frame in batch:
                    yield frame
    except Exception as exc:  # the status line is gone: the error goes in the stream, in the dialect's shape
        for frame in encoder.failed(as_api_error(exc)):
            yield frame
    for frame in encoder.trailer():
        yield frame


Body = TypeVar("Body")


class Dialect(ABC, Generic[Body]):
    """One wire format: its request body as a Call, and the engine's events as its responses."""

    endpoint: ClassVar[str]  # the name metrics and logs give its requests
    id_prefix: ClassVar[str]
    finish_names: ClassVar[Mapping[Finish, str]]  # the wire's word for each way a generation ends

    @classmethod
    def finish_name(cls, final: FinalEvent, tool_calls: bool, stop: tuple[str, ...]) -> str:
        return cls.finish_names[Finish.of(final, tool_calls, stop)]

    @abstractmethod
    async def parse(self, body: Body, server: ServerState) -> Call: ...  # APIError for what it cannot honour

    @abstractmethod
    def stream(self, body: Body, reply: Reply, generation: Generation) -> AsyncIterator[bytes]: ...

    @abstractmethod
    def whole(self, body: Body, reply: Reply, events: list[Any]) -> Any: ...  # the FinalEvent last


async def run(dialect: Dialect[Body], body: Body, server: ServerState) -> Any:
    """Answer one generating request in `dialect`'s wire format: a whole body, or an EventStream."""
    model = server.ready()
    call = await dialect.parse(body, server)
    if isinstance(call.prompt, Conversation):
        prepared = await server.prepare_chat(call.prompt, call.options)
        prompt_ids, parser = prepared.prompt_ids, prepared.parser()
    else:
        prepared, prompt_ids, parser = None, call.prompt, None
    server.check_context(len(prompt_ids))
    sampling = sampling_params(model.engine.sampling_defaults, *call.sampling)
    max_tokens = max_new_tokens(call.limit.value, param=call.limit.param, default=call.limit.default)
    request_id = f"{dialect.id_prefix}{uuid.uuid4().hex}"
    cached: list[int] = []
    if prepared is None:
        request = GenerateRequest(prompt_ids, sampling, StopCriteria(strings=call.stop), max_tokens,
                                  request_id=request_id, cache_prompt=call.cache_prompt)
        source = model.engine.generate(request)
    else:
        source = stream_chat(model.engine, prepared, parser, sampling, max_tokens, call.stop, request_id,
                             cache_prompt=call.cache_prompt, on_prefix=cached.append)
    generation = server.start(source, dialect.endpoint)
    reply = Reply(request_id, int(time.time()), model, call, sampling, len(prompt_ids), parser, cached)
    if call.stream:
        return EventStream(dialect.stream(body, reply, generation))
    return dialect.whole(body, reply, await generation.collect())
