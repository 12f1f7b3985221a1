"""OpenAI Responses API `input` / `instructions` / `tools`, as clients send them (Codex CLI, the Agents SDK),
into the canonical form.

Input is a list of items, not of messages: an assistant turn arrives as a run of items (a reasoning item,
an assistant message, function_call items), which become one canonical assistant message; each
function_call_output becomes a tool message. Instructions become the leading system message."""

from __future__ import annotations

from typing import Any

from .openai_messages import parse_arguments
from .types import (
    ChatError,
    Conversation,
    Message,
    TextPart,
    Tool,
    ToolCall,
    no_parameters,
)
from .validate import (
    expect_list,
    expect_object,
    get_str,
    opt_str,
    text_parts,
    type_name,
)

_INPUT_TEXT = ("input_text", "text")  # "text" is what several clients send for plain parts
_OUTPUT_TEXT = ("output_text", "refusal", "text")
_PREFIX = "input_"  # of the Responses API's part types, left out of errors: "images are not supported"


def conversation_from_responses(input: Any, instructions: Any = None, tools: Any = None,
                                history: list[Message] | None = None) -> Conversation:
    """`history` is the stored conversation of a `previous_response_id` (its input and output, without
    its instructions, which OpenAI does not carry over)."""
    messages = list(history or [])
    messages.extend(input_messages(input, messages))
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ChatError(f"instructions must be a string, not {type_name(instructions)}", "instructions")
        if instructions:
            messages.insert(0, Message(role="system", content=[TextPart(instructions)]))
    if not messages:
        raise ChatError("input must not be empty", "input")
    return Conversation(messages=messages, tools=tools_from_responses(tools))


def input_messages(input: Any, history: list[Message] | None = None) -> list[Message]:
    """The canonical messages of `input` (a string is one user message); `history` precedes them, for
    matching function_call_output items with calls made earlier."""
    if isinstance(input, str):
        return [Message(role="user", content=[TextPart(input)])] if input else []
    out: list[Message] = []
    turn: _AssistantTurn | None = None  # the assistant items being gathered
    for i, raw in enumerate(expect_list(input, "input")):
        param = f"input[{i}]"
        item = expect_object(raw, param)
        kind = item.get("type", "message")
        role = item.get("role")
        if kind in ("reasoning", "function_call") or (kind == "message" and role == "assistant"):
            turn = turn or _AssistantTurn()
            turn.add(item, kind, param)
            continue
        if turn is not None:
            out.append(turn.message())
            turn = None
        if kind == "message":
            out.append(_message(item, param))
        elif kind == "function_call_output":
            out.append(_tool_result(item, param, [*(history or []), *out]))
        elif kind == "item_reference":
            raise ChatError(f"{param}: item references are not supported; send the item itself "
                            "(or use previous_response_id)", f"{param}.type")
        else:
            raise ChatError(f"{param}.type: items of type {kind!r} are not supported; expected message, "
                            "function_call, function_call_output or reasoning", f"{param}.type")
    if turn is not None:
        out.append(turn.message())
    return out


# Tools that run on OpenAI's side: a local model cannot call them, so they are left out of the prompt (Codex
# offers web_search to every model) rather than failing the request.
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                "computer_use", "computer_use_preview", "mcp", "tool_search", "programmatic_tool_calling")


def tools_from_responses(tools: Any) -> list[Tool]:
    return [tool for tool, _ in _tools(tools)]


def tool_namespaces(tools: Any) -> dict[str, str]:
    """The namespace of each function offered inside a `namespace` tool, which its calls name."""
    return {tool.name: namespace for tool, namespace in _tools(tools) if namespace}


def _tools(tools: Any) -> list[tuple[Tool, str | None]]:
    if tools is None:
        return []
    out: list[tuple[Tool, str | None]] = []
    for k, raw in enumerate(expect_list(tools, "tools")):
        param = f"tools[{k}]"
        raw = expect_object(raw, param)
        kind = raw.get("type")
        if kind in HOSTED_TOOLS or (isinstance(kind, str) and kind.startswith(HOSTED_TOOLS)):
            continue
        if kind == "namespace":
            namespace = get_str(raw, "name", param)
            out += [(_function(inner, f"{param}.tools[{j}]"), namespace)
                    for j, inner in enumerate(expect_list(raw.get("tools"), f"{param}.tools"))]
        else:
            out.append((_function(raw, param), None))
    return out


def _function(raw: Any, param: str) -> Tool:
    raw = expect_object(raw, param)
    kind = raw.get("type")
    if kind != "function":
        raise ChatError(f"{param}.type: only 'function' tools (and namespaces of them) are supported, not {kind!r}",
                        f"{param}.type")
    parameters = raw.get("parameters")
    return Tool(
        name=get_str(raw, "name", param),
        description=opt_str(raw, "description", param) or "",
        parameters=no_parameters() if parameters is None else expect_object(parameters, f"{param}.parameters"),
    )


def _message(item: dict[str, Any], param: str) -> Message:
    role = get_str(item, "role", param)
    if role not in ("user", "system", "developer"):
        raise ChatError(f"{param}.role: unknown role {role!r}; expected user, assistant, system or developer",
                        f"{param}.role")
    if "content" not in item:
        raise ChatError(f"{param}.content is required", f"{param}.content")
    content = text_parts(item["content"], f"{param}.content", text_types=_INPUT_TEXT, type_prefix=_PREFIX)
    return Message(role=role, content=content)


def _tool_result(item: dict[str, Any], param: str, before: list[Message]) -> Message:
    call_id = get_str(item, "call_id", param)
    call = next((c for m in reversed(before) for c in m.tool_calls if c.id == call_id), None)
    if call is None:
        raise ChatError(f"{param}.call_id {call_id!r} matches no function_call before it", f"{param}.call_id")
    if "output" not in item:
        raise ChatError(f"{param}.output is required", f"{param}.output")
    content = text_parts(item["output"], f"{param}.output", text_types=_INPUT_TEXT, type_prefix=_PREFIX)
    return Message(role="tool", content=content, tool_call_id=call_id, name=call.name)


class _AssistantTurn:
    """Reasoning, text and calls of one assistant turn, gathered from consecutive items."""

    def __init__(self) -> None:
        self.parts: list[TextPart] = []
        self.thoughts: list[str] = []
        self.calls: list[ToolCall] = []

    def add(self, item: dict[str, Any], kind: str, param: str) -> None:
        if kind == "reasoning":
            # Our own reasoning items carry their text in `content`; OpenAI's may only have a summary.
            for key, part_kind in (("content", "reasoning_text"), ("summary", "summary_text")):
                texts = [get_str(expect_object(p, f"{param}.{key}[{j}]"), "text", f"{param}.{key}[{j}]")
                         for j, p in enumerate(expect_list(item.get(key) or [], f"{param}.{key}"))]
                if texts:
                    self.thoughts.append("\n".join(texts))
                    break
        elif kind == "function_call":
            self.calls.append(ToolCall(
                id=get_str(item, "call_id", param),
                name=get_str(item, "name", param),
                arguments=parse_arguments(item.get("arguments"), f"{param}.arguments"),
            ))
        else:
            self.parts.extend(text_parts(item.get("content") or [], f"{param}.content", text_types=_OUTPUT_TEXT,
                                         type_prefix=_PREFIX))

    def message(self) -> Message:
        reasoning = "\n".join(t for t in self.thoughts if t)
        return Message(role="assistant", content=self.parts, reasoning=reasoning or None, tool_calls=self.calls)
