"""OpenAI Chat Completions `messages` / `tools`, as clients send them, into the canonical form."""

from __future__ import annotations

import json
from typing import Any

from .types import ChatError, Conversation, Message, Tool, ToolCall, no_parameters
from .validate import (
    expect_list,
    expect_object,
    get_object,
    get_str,
    opt_str,
    text_parts,
    type_name,
)

ROLES = ("system", "developer", "user", "assistant", "tool")


def conversation_from_openai(messages: Any, tools: Any = None) -> Conversation:
    return Conversation(messages=messages_from_openai(messages), tools=tools_from_openai(tools))


def messages_from_openai(messages: Any) -> list[Message]:
    out: list[Message] = []
    # The assistant message that the tool messages being read answer; None outside such a run.
    answering: Message | None = None
    for i, raw in enumerate(expect_list(messages, "messages", non_empty=True)):
        param = f"messages[{i}]"
        raw = expect_object(raw, param)
        role = get_str(raw, "role", param)
        if role == "tool":
            out.append(_tool_message(raw, param, answering))
            continue
        if role in ("system", "developer", "user"):
            # Refusal parts only occur in assistant messages; user parts may be images, which text_parts refuses.
            message = Message(role=role, content=text_parts(_content(raw, param), f"{param}.content"))
        elif role == "assistant":
            message = _assistant_message(raw, param)
        else:
            raise ChatError(f"{param}.role: unknown role {role!r}; expected one of {', '.join(ROLES)}",
                            f"{param}.role")
        answering = message if message.tool_calls else None
        out.append(message)
    return out


def tools_from_openai(tools: Any) -> list[Tool]:
    if tools is None:
        return []
    out = []
    for k, raw in enumerate(expect_list(tools, "tools")):
        param = f"tools[{k}]"
        raw = expect_object(raw, param)
        kind = raw.get("type", "function")
        if kind != "function":
            raise ChatError(f"{param}.type: only 'function' tools are supported, not {kind!r}", f"{param}.type")
        function = get_object(raw, "function", param)
        parameters = function.get("parameters")
        out.append(Tool(
            name=get_str(function, "name", f"{param}.function"),
            description=opt_str(function, "description", f"{param}.function") or "",
            parameters=no_parameters() if parameters is None else expect_object(parameters,
                                                                               f"{param}.function.parameters"),
        ))
    return out


def _content(raw: dict[str, Any], param: str) -> Any:
    if raw.get("content") is None:
        raise ChatError(f"{param}.content is required", f"{param}.content")
    return raw["content"]


def _assistant_message(raw: dict[str, Any], param: str) -> Message:
    content = raw.get("content")
    parts = [] if content is None else text_parts(content, f"{param}.content", text_types=("text", "refusal"))
    # `reasoning_content` is the DeepSeek / llama.cpp name, `reasoning` vLLM's newer one.
    reasoning = opt_str(raw, "reasoning_content", param)
    if reasoning is None:
        reasoning = opt_str(raw, "reasoning", param)
    calls = raw.get("tool_calls")
    tool_calls = [] if calls is None else [
        _tool_call(call, f"{param}.tool_calls[{j}]") for j, call in enumerate(expect_list(calls, f"{param}.tool_calls"))
    ]
    return Message(role="assistant", content=parts, reasoning=reasoning or None, tool_calls=tool_calls)


def _tool_call(raw: Any, param: str) -> ToolCall:
    raw = expect_object(raw, param)
    kind = raw.get("type", "function")
    if kind != "function":
        raise ChatError(f"{param}.type: only 'function' tool calls are supported, not {kind!r}", f"{param}.type")
    function = get_object(raw, "function", param)
    return ToolCall(
        id=get_str(raw, "id", param),
        name=get_str(function, "name", f"{param}.function"),
        arguments=parse_arguments(function.get("arguments"), f"{param}.function.arguments"),
    )


def parse_arguments(value: Any, param: str) -> dict[str, Any]:
    """Tool-call arguments: the JSON string OpenAI specifies, or an already-decoded object (some clients
    send that). An empty string or null means a call without arguments."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ChatError(f"{param} is not valid JSON ({exc})", param) from None
        if not isinstance(value, dict):
            raise ChatError(f"{param} must encode a JSON object, not {type_name(value)}", param)
        return value
    return expect_object(value, param)


def _tool_message(raw: dict[str, Any], param: str, answering: Message | None) -> Message:
    call_id = get_str(raw, "tool_call_id", param)
    if answering is None:
        raise ChatError(f"{param}: a tool message must follow an assistant message with tool_calls "
                        "(or other tool messages answering it)", f"{param}.role")
    call = next((c for c in answering.tool_calls if c.id == call_id), None)
    if call is None:
        known = ", ".join(repr(c.id) for c in answering.tool_calls)
        raise ChatError(f"{param}.tool_call_id {call_id!r} matches no tool call of the preceding assistant message "
                        f"(its calls: {known})", f"{param}.tool_call_id")
    content = raw.get("content")
    return Message(
        role="tool",
        content=[] if content is None else text_parts(content, f"{param}.content"),
        tool_call_id=call_id,
        name=call.name,
    )
