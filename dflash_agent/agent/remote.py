"""A running OpenAI-compatible server (`dflash-agent serve`, llama.cpp, vLLM, ...) as the agent's
model, through the official `openai` client, streaming."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from ..chat.parser import ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart
from ..chat.types import Conversation, Message, ToolCall
from ..engine import RequestError, SamplingDefaults, SamplingParams, Usage
from .backend import AssistantTurn, BackendError, ContextFull, OnDelta, TurnOptions


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

    async def model_id(self) -> str:
        if self.model is None:
            models = await self._models()
            if not models:
                raise BackendError(f"the server at {self.base_url} lists no models; pass --model")
            self.model = models[0].id
        return self.model

    async def sampling(self) -> dict[str, Any]:
        """The sampling fields of every request (create() keyword arguments). With no temperature given, the served
        model's recommended sampling where the server lists it (`dflash-agent serve`: /v1/models meta
        sampling_defaults), else greedy: what the same model loaded in this process would use."""
        if self._sampling is None:
            if self.temperature is not None:
                self._sampling = {"temperature": self.temperature}
            else:
                model = await self.model_id()
                try:
                    cards = await self._models()
                except BackendError:  # a server without /v1/models lists nothing; the turn says if it is down
                    cards = []
                card = next((m for m in cards if m.id == model), None)
                meta = (card.model_extra or {}).get("meta") if card is not None else None
                listed = SamplingDefaults.of(meta.get("sampling_defaults") if isinstance(meta, dict) else None,
                                             self.base_url)
                try:
                    params = listed.resolve(SamplingParams())
                except RequestError:  # a server listing values out of range: greedy, as with none
                    params = SamplingParams()
                self._sampling = sampling_arguments(params)
        return self._sampling

    async def _models(self) -> list[Any]:
        if self._cards is None:
            try:
                self._cards = (await self.client.models.list()).data
            except openai.APIError as exc:
                raise self._error(exc) from None
        return self._cards

    async def turn(self, conversation: Conversation, options: TurnOptions, on_delta: OnDelta) -> AssistantTurn:
        request: dict[str, Any] = {
            "model": await self.model_id(),
            "messages": openai_messages(conversation),
            "stream": True,
            "stream_options": {"include_usage": True},
            **await self.sampling(),
        }
        if conversation.tools:
            request["tools"] = openai_tools(conversation)
            request["tool_choice"] = options.tool_choice
            request["parallel_tool_calls"] = options.parallel_tool_calls
        if options.max_tokens is not None:
            request["max_tokens"] = options.max_tokens
        if options.enable_thinking:  # the switch vLLM, llama.cpp and `dflash-agent serve` read
            request["extra_body"] = {**request.get("extra_body", {}), "chat_template_kwargs": {"enable_thinking": True}}
        text: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, list[Any]] = {}  # stream index -> [id, name, argument fragments]
        finish, usage, timings = "stop", Usage(0, 0), None
        try:
            stream = await self.client.chat.completions.create(**request)
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
                    self._read_delta(choice.delta, text, reasoning, calls, on_delta)
        except openai.APIError as exc:
            raise self._error(exc) from None
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
        return AssistantTurn("".join(text), "".join(reasoning) or None, tool_calls, finish, usage, timings, bad)

    def _read_delta(self, delta: Any, text: list[str], reasoning: list[str], calls: dict[int, list[Any]],
                    on_delta: OnDelta) -> None:
        # Reasoning is not in OpenAI's schema: llama.cpp and we send `reasoning_content`, vLLM `reasoning`.
        extra = delta.model_extra or {}
        thought = extra.get("reasoning_content") or extra.get("reasoning")
        if thought:
            reasoning.append(thought)
            on_delta(ReasoningDelta(thought))
        if delta.content:
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

    def _error(self, exc: openai.APIError) -> Exception:
        if isinstance(exc, openai.APIConnectionError):
            return BackendError(f"cannot reach the server at {self.base_url}: {exc.__cause__ or exc}")
        if isinstance(exc, openai.APIStatusError):
            body = exc.body if isinstance(exc.body, dict) else {}
            error = body.get("error", body) if isinstance(body.get("error", body), dict) else {}
            message = error.get("message") or exc.message
            if error.get("code") == "context_length_exceeded":
                return ContextFull(message)
            return BackendError(f"the server at {self.base_url} answered {exc.status_code}: {message}")
        return BackendError(f"the server at {self.base_url} sent a bad response: {exc}")

    async def close(self) -> None:
        await self.client.close()
