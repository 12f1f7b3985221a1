"""Anthropic Messages `system` / `messages` / `tools`, as clients send them, into the canonical form.

Anthropic carries tool results as `tool_result` blocks inside the next user message; the canonical form
(like OpenAI's) has one `tool` message per result, placed right after the assistant turn that made the
calls and before whatever text the user message also holds."""

from __future__ import annotations

from typing import Any

from .types import ChatError, Conversation, Message, TextPart, Tool, ToolCall
from .validate import (
    block_type,
    expect_list,
    expect_object,
    get_object,
    get_str,
    opt_str,
    text_part,
    text_parts,
    unsupported_media,
)


def conversation_from_anthropic(messages: Any, system: Any = None, tools: Any = None) -> Conversation:
    out = _system_messages(system)
    previous: Message | None = None  # the last canonical user/assistant message, for tool_result checks
    for i, raw in enumerate(expect_list(messages, "messages", non_empty=True)):
        param = f"messages[{i}]"
        raw = expect_object(raw, param)
        role = get_str(raw, "role", param)
        if "content" not in raw:
            raise ChatError(f"{param}.content is required", f"{param}.content")
        if role == "user":
            converted = _user_messages(raw["content"], f"{param}.content", previous)
        elif role == "assistant":
            converted = [_assistant_message(raw["content"], f"{param}.content")]
        elif role in ("system", "developer"):
            raise ChatError(f"{param}.role: {role!r} is not a message role in the Anthropic API; "
                            "pass the system prompt in the top-level 'system' field", f"{param}.role")
        else:
            raise ChatError(f"{param}.role: unknown role {role!r}; expected 'user' or 'assistant'", f"{param}.role")
        out.extend(converted)
        previous = next((m for m in reversed(converted) if m.role != "tool"), previous)
    return Conversation(messages=out, tools=tools_from_anthropic(tools))


def tools_from_anthropic(tools: Any) -> list[Tool]:
    if tools is None:
        return []
    out = []
    for k, raw in enumerate(expect_list(tools, "tools")):
        param = f"tools[{k}]"
        raw = expect_object(raw, param)
        kind = raw.get("type", "custom")
        if kind != "custom":
            # Anthropic's server-defined tools (bash_20250124, web_search...) run on Anthropic's side.
            raise ChatError(f"{param}.type: only custom tools are supported, not {kind!r}", f"{param}.type")
        out.append(Tool(
            name=get_str(raw, "name", param),
            description=opt_str(raw, "description", param) or "",
            parameters=get_object(raw, "input_schema", param),
        ))
    return out


def _system_messages(system: Any) -> list[Message]:
    if system is None:
        return []
    parts = text_parts(system, "system")
    return [Message(role="system", content=parts)] if parts else []


def _user_messages(content: Any, param: str, previous: Message | None) -> list[Message]:
    if isinstance(content, str):
        return [Message(role="user", content=text_parts(content, param))]
    results: list[Message] = []
    parts: list[TextPart] = []
    for j, block in enumerate(expect_list(content, param)):
        kind = block_type(block, f"{param}[{j}]")
        if kind == "text":
            parts.extend(text_part(block, kind, f"{param}[{j}]"))
        elif kind == "tool_result":
            results.append(_tool_result(block, f"{param}[{j}]", previous))
        else:
            raise unsupported_media(kind, f"{param}[{j}]")
    # A message holding only tool results is not also a user turn.
    return results + ([Message(role="user", content=parts)] if parts or not results else [])


def _tool_result(block: dict[str, Any], param: str, previous: Message | None) -> Message:
    call_id = get_str(block, "tool_use_id", param)
    if previous is None or previous.role != "assistant" or not previous.tool_calls:
        raise ChatError(f"{param}: a tool_result must be in the user message right after an assistant message "
                        "with tool_use blocks", param)
    call = next((c for c in previous.tool_calls if c.id == call_id), None)
    if call is None:
        known = ", ".join(repr(c.id) for c in previous.tool_calls)
        raise ChatError(f"{param}.tool_use_id {call_id!r} matches no tool_use of the preceding assistant message "
                        f"(its calls: {known})", f"{param}.tool_use_id")
    content = block.get("content")
    parts = [] if content is None else text_parts(content, f"{param}.content")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise ChatError(f"{param}.is_error must be a boolean", f"{param}.is_error")
    if is_error:
        # The canonical form (like OpenAI's) has no error flag: say it in the text the model reads.
        parts = [TextPart("Error: "), *parts]
    return Message(role="tool", content=parts, tool_call_id=call_id, name=call.name)


def _assistant_message(content: Any, param: str) -> Message:
    if isinstance(content, str):
        return Message(role="assistant", content=text_parts(content, param))
    parts: list[TextPart] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(expect_list(content, param)):
        kind = block_type(block, f"{param}[{j}]")
        if kind == "text":
            parts.extend(text_part(block, kind, f"{param}[{j}]"))
        elif kind == "thinking":
            thoughts.append(get_str(block, "thinking", f"{param}[{j}]"))
        elif kind == "redacted_thinking":
            # Encrypted by Anthropic's servers: there is no text to show the model, and this server never
            # emits such blocks, so dropping them loses nothing it produced.
            continue
        elif kind == "tool_use":
            calls.append(ToolCall(
                id=get_str(block, "id", f"{param}[{j}]"),
                name=get_str(block, "name", f"{param}[{j}]"),
                arguments=get_object(block, "input", f"{param}[{j}]"),
            ))
        else:
            raise unsupported_media(kind, f"{param}[{j}]")
    reasoning = "\n".join(t for t in thoughts if t)
    return Message(role="assistant", content=parts, reasoning=reasoning or None, tool_calls=calls)
