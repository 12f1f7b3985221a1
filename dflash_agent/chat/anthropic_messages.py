"""Anthropic Messages `system` / `messages` / `tools`, as clients send them, into the canonical form.

Anthropic carries tool results as `tool_result` blocks inside the next user message; the canonical form
(like OpenAI's) has one `tool` message per result, placed right after the assistant turn that made the
calls and before whatever text the user message also holds.

`role: "system"` entries inside `messages` (Anthropic's mid-conversation system messages, which Claude Code
sends) become canonical system messages where they stand; how a template carries them is the template's
business (Gemma 4 renders a system turn, Gemma 3 merges them into the neighbouring user turn). One placed
between an assistant's tool_use and the user message with its results moves after those results, since
results must follow their calls. `clear_at: "next_user_message"` drops the message once a later user
message exists, as Anthropic does (the prompt then no longer extends the previous one at that point)."""

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
    waiting: list[Message] = []  # system messages after tool_use blocks, placed after their results
    raw_messages = expect_list(messages, "messages", non_empty=True)
    last_user = max((i for i, m in enumerate(raw_messages) if isinstance(m, dict) and m.get("role") == "user"),
                    default=-1)
    for i, raw in enumerate(raw_messages):
        param = f"messages[{i}]"
        raw = expect_object(raw, param)
        role = get_str(raw, "role", param)
        if "content" not in raw and not (role == "system" and "output_config" in raw):
            raise ChatError(f"{param}.content is required", f"{param}.content")
        if role == "system":
            message = _system_message(raw, param, dropped=i < last_user)
            if message is not None:
                (waiting if previous is not None and previous.tool_calls else out).append(message)
            continue
        if role == "user":
            converted = _user_messages(raw["content"], f"{param}.content", previous)
        elif role == "assistant":
            converted = [_assistant_message(raw["content"], f"{param}.content")]
        elif role == "developer":
            raise ChatError(f"{param}.role: 'developer' is not a message role in the Anthropic API; "
                            "use 'system'", f"{param}.role")
        else:
            raise ChatError(f"{param}.role: unknown role {role!r}; expected 'user', 'assistant' or 'system'",
                            f"{param}.role")
        results = [m for m in converted if m.role == "tool"]
        out.extend(results + waiting + [m for m in converted if m.role != "tool"])
        waiting = []
        previous = next((m for m in reversed(converted) if m.role != "tool"), previous)
    out.extend(waiting)
    return Conversation(messages=out, tools=tools_from_anthropic(tools))


def _system_message(raw: dict[str, Any], param: str, dropped: bool) -> Message | None:
    """A mid-conversation system message, or None when it carries no text or has been cleared."""
    clear_at = raw.get("clear_at")
    if clear_at not in (None, "never", "next_user_message"):
        raise ChatError(f"{param}.clear_at must be 'next_user_message' or 'never', not {clear_at!r}",
                        f"{param}.clear_at")
    content = raw.get("content")
    if isinstance(content, list):
        for j, block in enumerate(content):
            if block_type(block, f"{param}.content[{j}]") in ("tool_addition", "tool_removal"):
                raise ChatError(f"{param}.content[{j}]: mid-conversation tool changes are not supported; "
                                "send every tool in the top-level 'tools'", f"{param}.content[{j}]")
    parts = [] if content is None else text_parts(content, f"{param}.content")
    if not parts or (dropped and clear_at == "next_user_message"):
        return None
    return Message(role="system", content=parts)


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
        elif kind in ("search_result", "document"):
            parts.extend(_quoted_text(block, kind, f"{param}[{j}]"))
        else:
            raise unsupported_media(kind, f"{param}[{j}]")
    # A message holding only tool results is not also a user turn.
    return results + ([Message(role="user", content=parts)] if parts or not results else [])


def _quoted_text(block: dict[str, Any], kind: str, param: str) -> list[TextPart]:
    """A search result or a text document as the text the model reads: its title and source, then its text."""
    if kind == "search_result":
        header = [get_str(block, "title", param), get_str(block, "source", param)]
        body = text_parts(block.get("content"), f"{param}.content")
    else:
        source = get_object(block, "source", param)
        source_type = source.get("type")
        if source_type == "text":
            body = [TextPart(get_str(source, "data", f"{param}.source"))]
        elif source_type == "content":
            body = text_parts(source.get("content"), f"{param}.source.content")
        else:
            raise ChatError(f"{param}.source.type: only text documents are supported (type 'text' or 'content'), "
                            f"not {source_type!r}; this model reads text only", f"{param}.source.type")
        header = [opt_str(block, "title", param) or "", opt_str(block, "context", param) or ""]
    text = "\n".join([h for h in header if h] + [p.text for p in body])
    return [TextPart(text)] if text else []


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
        elif kind == "compaction":
            # A summary of earlier context, which the client sends back in place of that context.
            summary = opt_str(block, "content", f"{param}[{j}]")
            parts.extend([TextPart(summary)] if summary else [])
        elif kind == "fallback":
            continue  # a boundary marker between model hops; Anthropic does not render it either
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
