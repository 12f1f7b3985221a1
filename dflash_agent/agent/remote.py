"""A running OpenAI-compatible server (`dflash-agent serve`, llama.cpp, vLLM, ...) as the agent's
model, through the official `openai` client, streaming."""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import msgspec
import openai

from ..chat.gemma3_tools import inline_tools
from ..chat.parser import OutputParser, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart, make_parser
from ..chat.types import Conversation, Message, ToolCall
from ..engine import RequestError, SamplingDefaults, SamplingParams, Usage
from .backend import AssistantTurn, BackendError, ContextFull, OnDelta, TurnOptions

log = logging.getLogger(__name__)

T = TypeVar("T")

# 429 (rate limited) and 503 (overloaded, loading) are the server's "later": retried this many times, waiting its
# Retry-After (at most RETRY_MAX_WAIT_S) or else 1, 2, 4, ... seconds
RETRIES = 4
RETRY_MAX_WAIT_S = 30.0
_RETRIED = (429, 503)

# How servers word a prompt that does not fit, beside OpenAI's code: vLLM ("This model's maximum context length
# is N tokens", code 400, param input_tokens), SGLang ("... longer than the model's context length ...", "...
# exceeds the model's maximum context length"), llama.cpp (type exceed_context_size_error), TGI ("must be <=")
_CONTEXT_WORDS = re.compile(r"maximum context length|context length|context window|exceed_context_size|"
                            r"too many tokens|prompt is too long|input_tokens.*must be", re.IGNORECASE)
_CONTEXT_TYPES = ("exceed_context_size_error", "context_length_exceeded")
# vLLM without --enable-auto-tool-choice / --tool-call-parser: '"auto" tool choice requires ... to be set'
_NO_TOOL_PARSER = re.compile(r"tool.choice.*requires.*--(?:enable-auto-tool-choice|tool-call-parser)", re.IGNORECASE)

# The model families whose output our parsers read, recognised in the id or path a server lists for its model
_FAMILIES = (("gemma4", re.compile(r"gemma[-_ ]?4", re.IGNORECASE)),
             ("gemma3", re.compile(r"gemma[-_ ]?3", re.IGNORECASE)))


def openai_messages(conversation: Conversation) -> list[dict[str, Any]]:
    """The canonical conversation as an OpenAI `messages` list (arguments as JSON text)."""
    return [_openai_message(m) for m in conversation.messages]


def _openai_message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.role == "assistant":
        if message.reasoning:
            out["reasoning_content"] = message.reasoning
        if message.tool_calls:
            out["content"] = message.text or None
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                for c in message.tool_calls
            ]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    return out


def sampling_arguments(params: SamplingParams) -> dict[str, Any]:
    """`params` as openai SDK create() arguments; top_k and min_p (vLLM's, llama.cpp's and our extension) only where
    they do something, so a server without them is not sent them."""
    out: dict[str, Any] = {"temperature": params.temperature}
    if params.top_p < 1:
        out["top_p"] = params.top_p
    extra = {name: value for name, value in (("top_k", params.top_k), ("min_p", params.min_p)) if value}
    if extra:
        out["extra_body"] = extra
    return out


def openai_tools(conversation: Conversation) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in conversation.tools]


class RemoteBackend:
    def __init__(self, base_url: str, model: str | None = None, temperature: float | None = 0.0,
                 api_key: str | None = None) -> None:
        """`base_url`: the API root (http://host:port/v1; a URL without a path gets /v1). `model`: the id to
        ask for; None takes the first one the server lists. `temperature` None: see `sampling`."""
        if not httpx.URL(base_url).path.strip("/"):
            base_url = base_url.rstrip("/") + "/v1"
        self.base_url = base_url
        # A local server needs no key; the SDK insists on one.
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0)
        self.model = model
        self.temperature = temperature
        self._sampling: dict[str, Any] | None = None
        self._cards: list[Any] | None = None  # what /v1/models listed
        self._family: str | None | bool = False  # False: not looked up yet
        # vLLM started without --tool-call-parser refuses tool_choice other than "none"
        self._server_parses_calls = True

    async def client_family(self) -> str | None:
        """The family whose tool syntax this client reads itself: None where the server handles tools (ours says
        its model's family on /v1/models) or the model is of no family we know. A server that is not ours (vLLM,
        SGLang, llama.cpp) may leave a Gemma 4 call in the text, and has no tool syntax for Gemma 3 at all."""
        if self._family is False:
            card = await self._card()
            if _ours(card):
                self._family = None
            else:
                names = [self.model or "", str(card.get("root") or "")]
                self._family = next((family for family, pattern in _FAMILIES
                                     if any(pattern.search(name) for name in names)), None)
        return self._family

    async def context_length(self) -> int | None:
        """The served model's context in tokens where /v1/models says it: ours and llama.cpp's in meta n_ctx,
        vLLM's as max_model_len."""
        return listed_context(await self._card())

    async def _card(self) -> dict[str, Any]:
        """What /v1/models says of the served model beyond OpenAI's fields (meta, max_model_len, root); {} where it
        lists nothing (a server without /v1/models: the turn says if it is down)."""
        model = await self.model_id()
        try:
            cards = await self._models()
        except BackendError:
            return {}
        card = next((m for m in cards if m.id == model), None)
        return (card.model_extra or {}) if card is not None else {}

    async def model_id(self) -> str:
        if self.model is None:
            models = await self._models()
            if not models:
                raise BackendError(f"the server at {self.base_url} lists no models; pass --model")
            self.model = models[0].id
        return self.model

    async def sampling(self) -> dict[str, Any]:
        """The sampling fields of every request (create() keyword arguments). With no temperature given: from our
        own server, the served model's recommended sampling (/v1/models meta sampling_defaults), else greedy, what
        the same model loaded in this process would use; from another server, the defaults it lists the same way,
        else none at all, so that its own apply (vLLM's: the model's generation_config.json)."""
        if self._sampling is None:
            if self.temperature is not None:
                self._sampling = {"temperature": self.temperature}
            else:
                card = await self._card()
                listed = SamplingDefaults.of(_meta(card).get("sampling_defaults"), self.base_url)
                ours = _ours(card)
                try:
                    self._sampling = sampling_arguments(listed.resolve(SamplingParams())) \
                        if listed.fields() or ours else {}
                except RequestError:  # a server listing values out of range: as if it listed none
                    self._sampling = sampling_arguments(SamplingParams()) if ours else {}
        return self._sampling

    async def _models(self) -> list[Any]:
        if self._cards is None:
            try:
                self._cards = (await self.retried(self.client.models.list)).data
            except openai.APIError as exc:
                raise self.error(exc) from None
        return self._cards

    async def retried(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, again after a 429 or 503 (up to RETRIES times, each after the server's Retry-After or a
        doubling wait); the last answer's error is raised as it came."""
        for attempt in range(RETRIES + 1):
            try:
                return await call()
            except openai.APIStatusError as exc:
                if exc.status_code not in _RETRIED or attempt == RETRIES:
                    raise
                asked = _retry_after(exc.response)
                wait = min(2.0 ** attempt if asked is None else asked, RETRY_MAX_WAIT_S)
                log.warning("the server at %s answered %d (%s); retrying in %.0f s (%d of %d)", self.base_url,
                            exc.status_code, _message(exc)[:200], wait, attempt + 1, RETRIES)
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def turn(self, conversation: Conversation, options: TurnOptions, on_delta: OnDelta) -> AssistantTurn:
        family = await self.client_family()
        if family == "gemma3":  # no tool syntax in its template: tools and calls as text, as our engine writes them
            conversation = inline_tools(conversation)
        request: dict[str, Any] = {
            "model": await self.model_id(),
            "messages": openai_messages(conversation),
            "stream": True,
            "stream_options": {"include_usage": True},
            **await self.sampling(),
        }
        if family == "gemma4":  # the call markers are special tokens, which vLLM and SGLang drop from the text
            request["extra_body"] = {**request.get("extra_body", {}), "skip_special_tokens": False}
        if conversation.tools:
            request["tools"] = openai_tools(conversation)
            if self._server_parses_calls:
                request["tool_choice"] = options.tool_choice
                request["parallel_tool_calls"] = options.parallel_tool_calls
            else:  # the model sees the tools; our parser reads its calls from the text
                request["tool_choice"] = "none"
        if options.max_tokens is not None:
            # vLLM refuses a max_tokens past its whole context (and shortens one that only passes what is left)
            context = await self.context_length()
            request["max_tokens"] = min(options.max_tokens, context) if context else options.max_tokens
        if options.enable_thinking:  # the switch vLLM, llama.cpp and `dflash-agent serve` read
            request["extra_body"] = {**request.get("extra_body", {}), "chat_template_kwargs": {"enable_thinking": True}}
        text: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, list[Any]] = {}  # stream index -> [id, name, argument fragments]
        finish, usage, timings = "stop", Usage(0, 0), None
        # Calls the server left in the text (no tool parser, or none for the family) are read as our engine reads them
        parser = make_parser(family) if family is not None else None
        try:
            try:
                stream = await self.retried(lambda: self.client.chat.completions.create(**request))
            except openai.BadRequestError as exc:
                if parser is None or request.get("tool_choice") == "none" or not _NO_TOOL_PARSER.search(_message(exc)):
                    raise
                log.info("the server at %s parses no tool calls (%s): this client reads them from the text",
                         self.base_url, _message(exc))
                self._server_parses_calls = False
                request["tool_choice"] = "none"
                request.pop("parallel_tool_calls", None)
                stream = await self.retried(lambda: self.client.chat.completions.create(**request))
            async for chunk in stream:
                extra = chunk.model_extra or {}
                if extra.get("timings"):
                    timings = extra["timings"]
                if chunk.usage is not None:
                    details = chunk.usage.prompt_tokens_details
                    usage = Usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens,
                                  (details.cached_tokens or 0) if details else 0)
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    self._read_delta(choice.delta, text, reasoning, calls, on_delta, parser)
        except openai.APIError as exc:
            raise self.error(exc) from None
        text_calls: list[ToolCall] = []
        if parser is not None:
            _pass_on(parser.finish(), text, reasoning, on_delta)
            text_calls = parser.result().tool_calls
            if text_calls and finish == "stop":
                finish = "tool_calls"
        tool_calls, bad = [], {}
        for index in sorted(calls):
            call_id, name, fragments = calls[index]
            raw = "".join(fragments)
            try:
                arguments = json.loads(raw) if raw.strip() else {}
                if not isinstance(arguments, dict):
                    raise ValueError(f"a JSON {type(arguments).__name__}, not an object")
            except ValueError as exc:
                bad[call_id] = f"the arguments are not a JSON object ({exc}): {raw[:200]!r}"
                arguments = {}
            tool_calls.append(ToolCall(call_id, name, arguments))
        tool_calls += text_calls
        return AssistantTurn("".join(text), "".join(reasoning) or None, tool_calls, finish, usage, timings, bad)

    def _read_delta(self, delta: Any, text: list[str], reasoning: list[str], calls: dict[int, list[Any]],
                    on_delta: OnDelta, parser: OutputParser | None) -> None:
        # Reasoning is not in OpenAI's schema: llama.cpp and we send `reasoning_content`, vLLM `reasoning`.
        extra = delta.model_extra or {}
        thought = extra.get("reasoning_content") or extra.get("reasoning")
        if thought:
            reasoning.append(thought)
            on_delta(ReasoningDelta(thought))
        if delta.content and parser is not None:
            _pass_on(parser.feed(delta.content), text, reasoning, on_delta)
        elif delta.content:
            text.append(delta.content)
            on_delta(TextDelta(delta.content))
        for part in delta.tool_calls or []:
            if part.index not in calls:
                name = part.function.name if part.function and part.function.name else ""
                calls[part.index] = [part.id or f"call_{part.index}", name, []]
                on_delta(ToolCallStart(part.index, calls[part.index][0], name))
            if part.function and part.function.arguments:
                calls[part.index][2].append(part.function.arguments)
                on_delta(ToolCallArgsDelta(part.index, part.function.arguments))

    def error(self, exc: openai.APIError) -> Exception:
        """The one-line error for what the openai client raised: ContextFull for a prompt the server says does
        not fit (in any of the servers' wordings), else BackendError."""
        if isinstance(exc, openai.APIConnectionError):
            return BackendError(f"cannot reach the server at {self.base_url}: {exc.__cause__ or exc}")
        if isinstance(exc, openai.APIStatusError):
            message = _message(exc)
            if _context_overflow(exc):
                return ContextFull(message)
            busy = f" (after {RETRIES} retries)" if exc.status_code in _RETRIED else ""
            return BackendError(f"the server at {self.base_url} answered {exc.status_code}{busy}: {message}")
        return BackendError(f"the server at {self.base_url} sent a bad response: {exc}")

    async def close(self) -> None:
        await self.client.close()


def listed_context(card: dict[str, Any]) -> int | None:
    """The context in tokens a /v1/models card gives (as JSON): ours and llama.cpp's say meta n_ctx, vLLM's
    max_model_len; None where it says neither."""
    context = _meta(card).get("n_ctx") or card.get("max_model_len")
    return int(context) if isinstance(context, (int, float)) and context > 0 else None


def _meta(card: dict[str, Any]) -> dict[str, Any]:
    meta = card.get("meta")
    return meta if isinstance(meta, dict) else {}


def _ours(card: dict[str, Any]) -> bool:
    """`dflash-agent serve` says its model's family in meta, and parses and samples as the engine here does."""
    return bool(_meta(card).get("family"))


# Parser events whose calls are numbered past any the server itself streams in the same answer
_TEXT_CALL_INDEX = 1 << 20


def _pass_on(deltas: list[Any], text: list[str], reasoning: list[str], on_delta: OnDelta) -> None:
    """What our parser read from the server's text: kept (text, reasoning) and passed to the view."""
    for delta in deltas:
        if isinstance(delta, TextDelta):
            text.append(delta.text)
        elif isinstance(delta, ReasoningDelta):
            reasoning.append(delta.text)
        elif isinstance(delta, (ToolCallStart, ToolCallArgsDelta)):
            delta = msgspec.structs.replace(delta, index=delta.index + _TEXT_CALL_INDEX)
        on_delta(delta)


def _error_fields(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error", body)
    return error if isinstance(error, dict) else {}


def _message(exc: openai.APIStatusError) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    # vLLM's 401 is {"error": "Unauthorized"}, which the SDK hands over as the string
    message = _error_fields(exc).get("message") or body.get("error") or (
        exc.body if isinstance(exc.body, str) else None)
    message = message if isinstance(message, str) and message else exc.message
    if exc.status_code in (401, 403):
        message += " (the key is read from DFLASH_AGENT_API_KEY, else OPENAI_API_KEY)"
    return message


def _context_overflow(exc: openai.APIStatusError) -> bool:
    error = _error_fields(exc)
    if error.get("code") in _CONTEXT_TYPES or error.get("type") in _CONTEXT_TYPES:
        return True
    return exc.status_code in (400, 413, 422) and bool(_CONTEXT_WORDS.search(_message(exc)))


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds to wait from Retry-After (seconds or an HTTP date) or OpenAI's retry-after-ms; None without one."""
    headers = response.headers
    try:
        if "retry-after-ms" in headers:
            return max(float(headers["retry-after-ms"]) / 1000, 0.0)
        value = headers.get("retry-after")
        if value is None:
            return None
        try:
            return max(float(value), 0.0)
        except ValueError:
            when = email.utils.parsedate_to_datetime(value)
            return max(when.timestamp() - time.time(), 0.0)
    except (TypeError, ValueError, OverflowError):
        return None
