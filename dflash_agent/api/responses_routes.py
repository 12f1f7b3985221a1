"""OpenAI Responses API: POST /v1/responses (what Codex CLI and the OpenAI Agents SDK speak), streamed with
the event sequence of `openai.types.responses`, and GET /v1/responses/{id} for stored responses.

One machine (`_Output`) turns the parser's deltas into output items and their events, so a streamed and a
non-streamed response carry the same items. `previous_response_id` is served from an in-memory store of
recent conversations (the input, without its instructions, plus the output)."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Router, get, post
from litestar.datastructures import State
from litestar.params import FromPath, JSONBody

from ..chat.chat_format import ChatOptions, LoadedModel, stream_chat
from ..chat.parser import ParsedOutput, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart
from ..chat.responses_input import conversation_from_responses, tool_namespaces
from ..chat.types import Message, TextPart, ToolCall
from ..engine import FinalEvent, SamplingParams
from .errors import APIError, as_api_error, handlers, openai_error
from .openai_schema import Timings
from .responses_schema import JSONObject, JSONSchema, ResponsesRequest, ResponseUsage, TextConfig
from .service import HEARTBEAT, EventStream, Generation, ServerState, max_new_tokens, sampling_params

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


@post("/v1/responses", status_code=200, summary="Create a response (OpenAI Responses API)")
async def create_response(data: JSONBody[ResponsesRequest], state: State) -> dict | EventStream:
    server: ServerState = state.server
    model = server.ready()
    _refuse_unsupported(data)
    store = _store(state)
    history = store.get(data.previous_response_id)[0] if data.previous_response_id else None
    conversation = conversation_from_responses(data.input, data.instructions, data.tools, history)
    options = ChatOptions(
        tool_choice=_tool_choice(data.tool_choice),
        parallel_tool_calls=True if data.parallel_tool_calls is None else data.parallel_tool_calls,
        response_format=_response_format(data.text), enable_thinking=_thinking(data.reasoning),
    )
    prepared = await server.prepare_chat(conversation, options)
    server.check_context(len(prepared.prompt_ids))
    sampling = sampling_params(model.engine.sampling_defaults, data.temperature, data.top_p, data.top_k, data.min_p,
                               data.seed)
    max_tokens = max_new_tokens(data.max_output_tokens, param="max_output_tokens", default=server.settings.max_tokens)
    response_id = f"resp_{uuid.uuid4().hex}"
    parser = prepared.parser()
    source = stream_chat(model.engine, prepared, parser, sampling, max_tokens, (), response_id,
                         cache_prompt=data.cache_prompt)
    generation = server.start(source, "responses")
    base = _base(data, response_id, model.name, sampling)
    namespaces = tool_namespaces(data.tools)
    # What previous_response_id continues: the conversation without its instructions, plus the answer.
    kept = conversation.messages[1:] if data.instructions else conversation.messages

    def finished(output: _Output, final: FinalEvent) -> dict[str, Any]:
        out = parser.result()
        response = _final(base, output, final, _reasoning_tokens(model, out))
        if data.store:
            store.put(response_id, [*kept, _answer(out)], response)
        return response

    if data.stream:
        return EventStream(_events(generation, base, finished, namespaces))
    output = _Output(namespaces)
    final = None
    for event in await generation.collect():
        if isinstance(event, FinalEvent):
            final = event
        else:
            output.feed(event)
    assert final is not None
    output.close(final)
    return finished(output, final)


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


def _base(data: ResponsesRequest, response_id: str, model: str, sampling: SamplingParams) -> dict[str, Any]:
    """The response object's fields that do not depend on the output; the sampling actually used, as OpenAI
    reports it."""
    fmt = msgspec.to_builtins(data.text.format) if data.text is not None and data.text.format else {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "model": model, "output": [], "error": None, "incomplete_details": None,
        "instructions": data.instructions, "tools": data.tools or [],
        "tool_choice": data.tool_choice if data.tool_choice is not None else "auto",
        "parallel_tool_calls": True if data.parallel_tool_calls is None else data.parallel_tool_calls,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "max_output_tokens": data.max_output_tokens,
        "previous_response_id": data.previous_response_id, "metadata": data.metadata or {},
        "reasoning": {"effort": (data.reasoning or {}).get("effort"), "summary": None},
        "text": {"format": fmt}, "store": data.store, "truncation": data.truncation or "disabled", "usage": None,
    }


def _final(base: dict[str, Any], output: _Output, final: FinalEvent, reasoning_tokens: int) -> dict[str, Any]:
    cut = final.finish_reason == "length"
    return {**base, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": output.items, "usage": msgspec.to_builtins(ResponseUsage.of(final, reasoning_tokens)),
            "timings": msgspec.to_builtins(Timings.of(final))}


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
        item["status"] = "incomplete" if final is not None and final.finish_reason == "length" else "completed"
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


async def _events(generation: Generation, base: dict[str, Any], finished: Any,
                  namespaces: dict[str, str]) -> AsyncIterator[bytes]:
    sequence = 0

    def sse(event: dict[str, Any]) -> bytes:
        nonlocal sequence
        payload = {**event, "sequence_number": sequence}
        sequence += 1
        return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"

    yield sse({"type": "response.created", "response": base})
    yield sse({"type": "response.in_progress", "response": base})
    output = _Output(namespaces)
    try:
        async for event in generation.events():
            if event is HEARTBEAT:
                yield b": ping\n\n"
                continue
            if isinstance(event, FinalEvent):
                output.close(event)
                response = finished(output, event)
            else:
                output.feed(event)
            for e in output.events:
                yield sse(e)
            output.events.clear()
            if isinstance(event, FinalEvent):
                kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
                yield sse({"type": kind, "response": response})
    except Exception as exc:  # the status line is gone: a failed response, as OpenAI sends
        err = as_api_error(exc)
        failed = {**base, "status": "failed", "output": output.items,
                  "error": {"code": str(err.code or "server_error"), "message": err.message}}
        yield sse({"type": "response.failed", "response": failed})


def responses_router() -> Router:
    return Router("/", route_handlers=[create_response, retrieve_response], exception_handlers=handlers(openai_error))
