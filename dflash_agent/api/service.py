"""What the HTTP routes share: the engine (loaded in the background), admission to its queue, and
one running generation per request, pumped into a buffer so streams can send heartbeats while
the model is busy and a disconnect cancels the work."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from litestar.response import Stream

from ..chat.chat_format import ChatOptions, LoadedModel, PreparedChat
from ..chat.prompt_size import PromptTooLong, check_prompt_chars, conversation_chars, json_chars, max_prompt_chars
from ..chat.types import Conversation
from ..engine import Engine, FinalEvent, ModelLoadError, SamplingDefaults, SamplingParams
from .errors import APIError, context_overflow
from .metrics import ServerMetrics

log = logging.getLogger(__name__)
# A child of the access log, so `serve` turns both on and --no-access-log both off.
generation_log = logging.getLogger("dflash_agent.api.access.generation")

HEARTBEAT = object()  # yielded by Generation.events() when nothing happened for a while


class EventStream(Stream):
    """A server-sent-events response. (Litestar's Stream lets the handler's default media type,
    JSON, override its own; SSE clients check for text/event-stream.)"""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = self.media_type
        return super().to_asgi_response(*args, **kwargs)


# What a request that sets no output limit gets (`serve --max-tokens`). Codex CLI and aider send none, and a model
# that does not stop would write to the end of the context (minutes per turn on a CPU); 8192 tokens (~30 KB) hold
# a whole-file edit or a long reasoning.
DEFAULT_MAX_TOKENS = 8192


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServerSettings:
    alias: str | None = None  # the model id clients see; default: the engine's model name
    api_key: str | None = None
    max_queue: int = 32  # requests waiting for a free slot before 503s
    heartbeat_s: float = 15.0  # keep-alive on idle streams (long prefills, queueing)
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # for a request that sets no limit; None: until the context is full
    chat_template: str | None = None  # override: gemma4, gemma3 or a file
    # the names a request's Host may give (any port); None: any. What `serve --host` binds decides (answered_hosts)
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_NAMES


def answered_hosts(bound: str, extra: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """The Host names a server bound to `bound` answers (against DNS rebinding: a web page whose name resolves to
    this machine is same-origin with it): this machine's names, the bound name and `extra` (--allowed-hosts;
    "*" is any); bound to every interface with no `extra`, any."""
    if "*" in extra:
        return None
    if bound in ("0.0.0.0", "::", "") and not extra:
        return None
    names = {*LOOPBACK_NAMES, *extra}
    if bound not in ("0.0.0.0", "::", ""):
        names.add(bound.strip("[]").lower())
    return tuple(sorted(name.lower() for name in names))


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8080" -> "::1", "Example.COM:80" -> "example.com"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Admission:
    """Counts requests from admission to their last event: `slots` run at once, `max_queue` more wait, and
    the next is refused (503 with Retry-After, as a server whose slots are all busy)."""

    def __init__(self, max_queue: int, metrics: ServerMetrics, slots: int = 1) -> None:
        self.max_queue = max_queue
        self.metrics = metrics
        self.slots = slots
        self.active = 0
        self._seconds = 5.0  # running mean of a request's duration, for Retry-After

    def admit(self) -> Callable[[], None]:
        """A release callback for an admitted request; raises a 503 when the queue is full."""
        if self.active >= self.slots + self.max_queue:
            self.metrics.rejected.inc()
            waiting = self.active - self.slots
            wait = max(1, math.ceil(self._seconds * (waiting + 1) / self.slots))
            raise APIError(503, f"the server is busy: its {self.slots} slots are in use and {waiting} requests are "
                           "already queued; retry later", code="server_busy", headers={"Retry-After": str(wait)})
        self.active += 1
        self.metrics.set_load(self.active, self.slots)
        started, released = time.perf_counter(), False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active -= 1
                self.metrics.set_load(self.active, self.slots)
                self._seconds = 0.8 * self._seconds + 0.2 * (time.perf_counter() - started)

        return release


class Generation:
    """One admitted request running on the engine. A pump task moves its events into a buffer, so
    `events()` can yield HEARTBEAT while the model is busy elsewhere, and `cancel()` (or closing
    `events()` when a client disconnects) stops the engine's work at its next step."""

    def __init__(self, source: AsyncIterator[Any], release: Callable[[], None], endpoint: str,
                 metrics: ServerMetrics, heartbeat_s: float) -> None:
        self._buffer: asyncio.Queue = asyncio.Queue()
        self._heartbeat_s = heartbeat_s
        self._endpoint, self._metrics = endpoint, metrics
        self._task = asyncio.create_task(self._pump(source, release))
        self.done = self._task  # for ServerState's set of running generations

    async def _pump(self, source: AsyncIterator[Any], release: Callable[[], None]) -> None:
        try:
            async for event in source:
                if isinstance(event, FinalEvent):
                    self._metrics.observe(self._endpoint, event)
                    _log_generation(self._endpoint, event)
                self._buffer.put_nowait(event)
        except asyncio.CancelledError:  # the client went away: the engine stops at its next step
            self._metrics.requests.labels(self._endpoint, "cancelled").inc()
            raise
        except Exception as exc:  # handed to the reader, who answers in its API's shape
            self._metrics.failed(self._endpoint)
            self._buffer.put_nowait(_Failure(exc))
        finally:
            release()
            self._buffer.put_nowait(_END)

    async def events(self) -> AsyncIterator[Any]:
        """The request's events, HEARTBEAT on idle; raises what the engine raised."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self._buffer.get(), self._heartbeat_s)
                except TimeoutError:
                    yield HEARTBEAT
                    continue
                if event is _END:
                    return
                if isinstance(event, _Failure):
                    raise event.error
                yield event
        finally:
            self.cancel()

    async def collect(self) -> list[Any]:
        return [e async for e in self.events() if e is not HEARTBEAT]

    def cancel(self) -> None:
        self._task.cancel()

    def fail(self, error: Exception) -> None:
        """Stop the work and hand its reader `error` (a shutdown): a stream ends with an error event."""
        if not self._task.done():
            self._buffer.put_nowait(_Failure(error))
            self._task.cancel()


def _log_generation(endpoint: str, final: FinalEvent) -> None:
    t = final.timings
    generation_log.info(
        "%s: prompt %d tokens (%d from the prefix cache, %d prefilled in %.2f s), %d generated in %.2f s "
        "(%.1f tok/s), finish %s", endpoint, final.usage.prompt_tokens, final.usage.cached_tokens, t.prompt_n,
        t.prompt_ms / 1e3, final.usage.completion_tokens, t.predicted_ms / 1e3, t.predicted_per_second,
        final.finish_reason)


@dataclass
class _Failure:
    error: Exception


_END = object()


@dataclass
class ServerState:
    settings: ServerSettings
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    model: LoadedModel | None = None
    load_error: str | None = None
    admission: Admission = field(init=False)
    running: set[Generation] = field(default_factory=set)
    loop: asyncio.AbstractEventLoop | None = None  # the server's, set at startup

    def __post_init__(self) -> None:
        self.admission = Admission(self.settings.max_queue, self.metrics)

    def ready(self) -> LoadedModel:
        if self.model is None:
            if self.load_error is not None:
                raise APIError(500, f"the model failed to load: {self.load_error}")
            raise APIError(503, "Loading model")
        return self.model

    def loaded(self) -> LoadedModel | None:
        """The model once it has loaded, None while it loads; raises ModelLoadError if the load failed."""
        if self.model is None and self.load_error is not None:
            raise ModelLoadError(f"the model failed to load: {self.load_error}")
        return self.model

    def attach(self, engine: Engine) -> None:
        engine.tokenizer.longest_piece  # computed now (a 262K-piece scan), before the first request needs it
        self.admission.slots = engine.parallel
        self.model = LoadedModel.of(engine, self.settings.chat_template, self.settings.alias)

    def start(self, source: AsyncIterator[Any], endpoint: str) -> Generation:
        """Admit a request (503 when the queue is full) and start pumping its events."""
        generation = Generation(source, self.admission.admit(), endpoint, self.metrics, self.settings.heartbeat_s)
        self.running.add(generation)
        generation.done.add_done_callback(lambda _: self.running.discard(generation))
        return generation

    def shut_down(self) -> None:
        """Called from a signal handler: running requests end now with a 503 (an error event on a stream)
        rather than being cut when the server stops."""
        def fail_all() -> None:
            for generation in list(self.running):
                generation.fail(APIError(503, "the server is shutting down"))

        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fail_all)

    def max_prompt_chars(self) -> int:
        """The most characters a prompt that fits the context can have (chat.prompt_size). Also the most token ids
        /tokenize can return, so the most /detokenize takes."""
        engine = self.ready().engine
        return max_prompt_chars(engine.tokenizer, engine.n_ctx)

    def check_prompt_chars(self, n_chars: int) -> None:
        """Refuse a prompt that cannot fit before tokenizing it (chat.prompt_size)."""
        engine = self.ready().engine
        try:
            check_prompt_chars(n_chars, engine.tokenizer, engine.n_ctx)
        except PromptTooLong as exc:
            raise APIError(400, str(exc), code="context_length_exceeded", extra={
                "n_prompt_chars": n_chars, "max_prompt_chars": exc.max_chars, "n_ctx": exc.n_ctx}) from None

    async def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of a prompt, tokenized in a thread (the tokenizer releases the GIL) once its length
        is known to be possible."""
        self.check_prompt_chars(len(text))
        return await asyncio.to_thread(self.ready().engine.tokenizer.encode, text, add_bos)

    async def prepare_chat(self, conversation: Conversation, options: ChatOptions) -> PreparedChat:
        """Render and tokenize a conversation in a thread (compiling a tool grammar the first time is slow
        too), after refusing one whose text alone is beyond the context."""
        model = self.ready()

        def prepare() -> PreparedChat:
            self.check_prompt_chars(conversation_chars(conversation) + json_chars(options.response_format))
            return model.chat.prepare(conversation, options)

        return await asyncio.to_thread(prepare)

    def check_context(self, n_prompt: int) -> None:
        n_ctx = self.ready().engine.n_ctx
        if n_prompt >= n_ctx:
            raise context_overflow(n_prompt, n_ctx)


# OpenAI's and Anthropic's default for what neither the request nor the checkpoint sets: temperature 1, no truncation.
API_SAMPLING = SamplingParams(temperature=1.0)


def sampling_params(defaults: SamplingDefaults, temperature: float | None, top_p: float | None, top_k: int | None,
                    min_p: float | None, seed: int | None) -> SamplingParams:
    """The request's sampling: each value it sets, else the checkpoint's default, else the API's."""
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}  # ranges: *_schema.py
    if seed is not None and not -2**63 <= seed < 2**64:  # what torch's generator takes
        raise APIError(400, f"seed must fit in 64 bits (from -2**63 to 2**64 - 1), got {seed}", param="seed")
    try:
        return defaults.resolve(API_SAMPLING, seed=seed, **given)
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from exc


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range (vocabulary of {vocab_size})", param=param)


# Stop strings are searched for after every token: a few short ones are what clients send.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096


def stop_strings(stop: str | list[str] | None, param: str = "stop") -> tuple[str, ...]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in strings):
        raise APIError(400, f"{param} must not contain empty strings", param=param)
    if len(strings) > MAX_STOP_STRINGS:
        raise APIError(400, f"{param} has {len(strings)} strings; at most {MAX_STOP_STRINGS} are accepted",
                       param=param)
    if (longest := max(map(len, strings), default=0)) > MAX_STOP_CHARS:
        raise APIError(400, f"{param} has a string of {longest} characters; at most {MAX_STOP_CHARS} are accepted",
                       param=param)
    return tuple(strings)


def max_new_tokens(*candidates: int | None, param: str = "max_tokens", default: int | None = None) -> int | None:
    """The request's limit (the first candidate it sets), which wins over the server's `default`, above it too."""
    value = next((c for c in candidates if c is not None), None)
    if value is not None and value < 1:
        raise APIError(400, f"{param} must be at least 1, got {value}", param=param)
    return default if value is None else value
