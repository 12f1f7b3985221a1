"""OpenAI Responses API: POST /v1/responses (what Codex CLI and the OpenAI Agents SDK speak), streamed with
the event sequence of `openai.types.responses`, and GET /v1/responses/{id} for stored responses.

One machine (`_Output`) turns the parser's deltas into output items and their events, so a streamed and a
non-streamed response carry the same items. `previous_response_id` is served from an in-memory store of
recent conversations (the input, without its instructions, plus the output)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
from litestar import Router, get, post
from litestar.datastructures import State
from litestar.params import FromPath, JSONBody

from ..chat.chat_format import ChatOptions, LoadedModel
from ..chat.finish import Finish
from ..chat.parser import ParsedOutput, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart
from ..chat.responses_input import conversation_from_responses, tool_namespaces
from ..chat.types import Message, TextPart, ToolCall
from ..engine import FinalEvent
from .errors import APIError, handlers, openai_error
from .openai_schema import Timings
from .pipeline import Call, Dialect, Limit, Reply, Sampling, StreamEncoder, frames, run
from .responses_schema import JSONObject, JSONSchema, ResponsesRequest, ResponseUsage, TextConfig
from .service import EventStream, Generation, ServerState

STORED_RESPONSES = 64  # conversations kept for previous_response_id, least recently used dropped first


class ResponseStore:
    """Recent responses: the conversation each ends (for previous_response_id) and the response object."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[list[Message], dict[str, Any]]] = OrderedDict()

    def put(self, response_id: str, messages: list[Message], response: dict[str, Any]) -> None:
        self._items[response_id] = (messages, response)
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[list[Message], dict[str, Any]]:
        if response_id not in self._items:
            raise APIError(400, f"previous response {response_id!r} not found: this server keeps the last "
                           f"{self.capacity} responses in memory; send the whole conversation as input",
                           param="previous_response_id", code="previous_response_not_found")
        self._items.move_to_end(response_id)
        return self._items[response_id]


def _store(state: State) -> ResponseStore:
    if "responses" not in state:
        state["responses"] = ResponseStore()
    return state["responses"]


def _refuse_unsupported(data: ResponsesRequest) -> None:
    if data.background:
        raise APIError(400, "background responses are not supported", param="background")
    if data.conversation is not None:
        raise APIError(400, "conversation objects are not supported; use previous_response_id or send the "
                       "whole input", param="conversation")
    if data.top_logprobs:
        raise APIError(400, "top_logprobs is not supported", param="top_logprobs")
    if data.truncation not in (None, "disabled", "auto"):
        raise APIError(400, f"truncation must be 'auto' or 'disabled', not {data.truncation!r}", param="truncation")


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    """The Responses spelling (`{"type": "function", "name": N}`) as the chat layer's."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise APIError(400, f"tool_choice must be auto, none, required or a function, not {choice!r}",
                           param="tool_choice")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice: only auto, none, required and {\"type\": \"function\", \"name\": ...} are "
                   "supported", param="tool_choice")


def _response_format(text: TextConfig | None) -> Any:
    """`text.format` (checked as the body was decoded) as Chat Completions' response_format."""
    fmt = text.format if text is not None else None
    if isinstance(fmt, JSONSchema):
        spec = {"name": fmt.name, "schema": fmt.schema, **({"strict": fmt.strict} if fmt.strict is not None else {})}
        return {"type": "json_schema", "json_schema": spec}
    if isinstance(fmt, JSONObject):
        return {"type": "json_object"}
    return None


def _thinking(reasoning: dict[str, Any] | None) -> bool:
    return reasoning is not None and reasoning.get("effort") not in (None, "none", "minimal")


# the response's status (and an item's that the end cut)
STATUSES = {Finish.STOP: "completed", Finish.STOP_SEQUENCE: "completed", Finish.LENGTH: "incomplete",
            Finish.CONTEXT_FULL: "incomplete", Finish.TOOL_CALLS: "completed", Finish.CANCELLED: "completed"}


class Responses(Dialect[ResponsesRequest]):
    endpoint, id_prefix, finish_names = "responses", "resp_", STATUSES

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def parse(self, data: ResponsesRequest, server: ServerState) -> Call:
        _refuse_unsupported(data)
        history = self.store.get(data.previous_response_id)[0] if data.previous_response_id else None
        conversation = await asyncio.to_thread(conversation_from_responses, data.input, data.instructions, data.tools,
                                               history)
        options = ChatOptions(
            tool_choice=_tool_choice(data.tool_choice),
            parallel_tool_calls=True if data.parallel_tool_calls is None else data.parallel_tool_calls,
            response_format=_response_format(data.text), enable_thinking=_thinking(data.reasoning),
        )
        sampling = Sampling(data.temperature, data.top_p, data.top_k, data.min_p, data.seed)
        limit = Limit(data.max_output_tokens, "max_output_tokens", server.settings.max_tokens)
        return Call(conversation, sampling, limit, data.stream, options, cache_prompt=data.cache_prompt)

    def stream(self, data: ResponsesRequest, reply: Reply, generation: Generation) -> AsyncIterator[bytes]:
        output = _Output(tool_namespaces(data.tools))
        return frames(generation, _ResponseEvents(_base(data, reply), partial(self.finished, data, reply), output))

    def whole(self, data: ResponsesRequest, reply: Reply, events: list) -> dict[str, Any]:
        output = _Output(tool_namespaces(data.tools))
        for event in events[:-1]:
            output.feed(event)
        output.close(events[-1])
        return self.finished(data, reply, output, events[-1])

    def finished(self, data: ResponsesRequest, reply: Reply, output: _Output, final: FinalEvent) -> dict[str, Any]:
        """The response a closed output makes, stored for previous_response_id."""
        out, status = reply.parser.result(), output.status(final)
        usage = ResponseUsage.of(final, _reasoning_tokens(reply.model, out))
        response = {**_base(data, reply), "status": status,
                    "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                    "output": output.items, "usage": msgspec.to_builtins(usage),
                    "timings": msgspec.to_builtins(Timings.of(final))}
        if data.store:
            # What previous_response_id continues: the conversation without its instructions, plus the answer.
            messages = reply.call.prompt.messages
            self.store.put(reply.request_id, [*(messages[1:] if data.instructions else messages), _answer(out)],
                           response)
        return response


@post("/v1/responses", status_code=200, summary="Create a response (OpenAI Responses API)")
async def create_response(data: JSONBody[ResponsesRequest], state: State) -> dict | EventStream:
    return await run(Responses(_store(state)), data, state.server)


@get("/v1/responses/{response_id:str}", summary="A stored response (OpenAI Responses API)")
async def retrieve_response(response_id: FromPath[str], state: State) -> dict:
    state.server.ready()
    try:
        return _store(state).get(response_id)[1]
    except APIError:
        raise APIError(404, f"no response {response_id!r} is stored here", param="response_id") from None


def _answer(out: ParsedOutput) -> Message:
    return Message(role="assistant", content=[TextPart(out.content)] if out.content else [],
                   reasoning=out.reasoning or None,
                   tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in out.tool_calls])


def _reasoning_tokens(model: LoadedModel, out: ParsedOutput) -> int:
    return len(model.engine.tokenizer.encode(out.reasoning)) if out.reasoning else 0


def _base(data: ResponsesRequest, reply: Reply) -> dict[str, Any]:
    """The response object's fields that do not depend on the output; the sampling actually used, as OpenAI
    reports it."""
    fmt = msgspec.to_builtins(data.text.format) if data.text is not None and data.text.format else {"type": "text"}
    return {
        "id": reply.request_id, "object": "response", "created_at": reply.created, "status": "in_progress",
        "model": reply.model.name, "output": [], "error": None, "incomplete_details": None,
        "instructions": data.instructions, "tools": data.tools or [],
        "tool_choice": data.tool_choice if data.tool_choice is not None else "auto",
        "parallel_tool_calls": True if data.parallel_tool_calls is None else data.parallel_tool_calls,
        "temperature": reply.sampling.temperature, "top_p": reply.sampling.top_p,
        "max_output_tokens": data.max_output_tokens,
        "previous_response_id": data.previous_response_id, "metadata": data.metadata or {},
        "reasoning": {"effort": (data.reasoning or {}).get("effort"), "summary": None},
        "text": {"format": fmt}, "store": data.store, "truncation": data.truncation or "disabled", "usage": None,
    }


class _Output:
    """Output items built from the parser's deltas, with the stream events that build them."""

    def __init__(self, namespaces: dict[str, str]) -> None:
        self.namespaces = namespaces  # function name -> the namespace tool it was offered in
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []  # taken by the stream as they come
        self._open: Any = None  # "reasoning", "message" or ("call", parser index)
        self._text = ""

    def feed(self, delta: Any) -> None:
        if isinstance(delta, ReasoningDelta):
            self._ensure("reasoning", lambda: {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [],
                                               "status": "in_progress"})
            self._text += delta.text
            self._emit("response.reasoning_text.delta", content_index=0, delta=delta.text)
        elif isinstance(delta, TextDelta):
            if self._open != "message":
                self._open_message()
            self._text += delta.text
            self._emit("response.output_text.delta", content_index=0, delta=delta.text, logprobs=[])
        elif isinstance(delta, ToolCallStart):
            namespace = self.namespaces.get(delta.name)
            self._ensure(("call", delta.index), lambda: {"type": "function_call", "id": _id("fc"),
                                                         "call_id": delta.id, "name": delta.name, "arguments": "",
                                                         "status": "in_progress",
                                                         **({"namespace": namespace} if namespace else {})})
        elif isinstance(delta, ToolCallArgsDelta):
            self.items[-1]["arguments"] += delta.fragment
            self._emit("response.function_call_arguments.delta", delta=delta.fragment)

    def close(self, final: FinalEvent | None = None) -> None:
        """Finish the open item (incomplete when the token limit cut it). At the end of an output that has no
        item at all (the model ended its turn at once) an empty message is the answer, as OpenAI sends it."""
        if final is not None and not self.items:
            self._open_message()
        if self._open is None:
            return
        item = self.items[-1]
        item["status"] = "completed" if final is None else self.status(final)
        if self._open == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": self._text}]
            self._emit("response.reasoning_text.done", content_index=0, text=self._text)
        elif self._open == "message":
            part = _text_part(self._text)
            item["content"] = [part]
            self._emit("response.output_text.done", content_index=0, text=self._text, logprobs=[])
            self._emit("response.content_part.done", content_index=0, part=part)
        else:
            self._emit("response.function_call_arguments.done", arguments=item["arguments"], name=item["name"])
        self._emit("response.output_item.done", item=json.loads(json.dumps(item)), with_item_id=False)
        self._open, self._text = None, ""

    def status(self, final: FinalEvent) -> str:
        called = any(item["type"] == "function_call" for item in self.items)
        return Responses.finish_names[Finish.of(final, called)]

    def _open_message(self) -> None:
        self._ensure("message", lambda: {"type": "message", "id": _id("msg"), "role": "assistant",
                                         "status": "in_progress", "content": []})
        self._emit("response.content_part.added", content_index=0, part=_text_part(""))

    def _ensure(self, key: Any, make: Any) -> None:
        if self._open == key:
            return
        self.close()
        self.items.append(make())
        self._open = key
        self._emit("response.output_item.added", item=json.loads(json.dumps(self.items[-1])), with_item_id=False)

    def _emit(self, kind: str, with_item_id: bool = True, **fields: Any) -> None:
        event = {"type": kind, "output_index": len(self.items) - 1}
        if with_item_id:
            event["item_id"] = self.items[-1]["id"]
        self.events.append({**event, **fields})


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class _ResponseEvents(StreamEncoder):
    """A streamed response: created and in_progress, the output's events as its items are built, then completed
    or incomplete; each event numbered."""

    base: dict[str, Any]
    finished: Callable[[_Output, FinalEvent], dict[str, Any]]
    output: _Output
    sequence: int = 0

    def sse(self, event: dict[str, Any]) -> bytes:
        payload = {**event, "sequence_number": self.sequence}
        self.sequence += 1
        return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"

    def opening(self) -> list[bytes]:
        return [self.sse({"type": "response.created", "response": self.base}),
                self.sse({"type": "response.in_progress", "response": self.base})]

    def feed(self, event: object) -> list[bytes]:
        self.output.feed(event)
        return self.drain()

    def close(self, final: FinalEvent) -> list[bytes]:
        self.output.close(final)
        response = self.finished(self.output, final)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*self.drain(), self.sse({"type": kind, "response": response})]

    def failed(self, error: APIError) -> list[bytes]:
        failed = {**self.base, "status": "failed", "output": self.output.items,
                  "error": {"code": str(error.code or "server_error"), "message": error.message}}
        return [self.sse({"type": "response.failed", "response": failed})]

    def drain(self) -> list[bytes]:
        out = [self.sse(e) for e in self.output.events]
        self.output.events.clear()
        return out


def responses_router() -> Router:
    return Router("/", route_handlers=[create_response, retrieve_response], exception_handlers=handlers(openai_error))
