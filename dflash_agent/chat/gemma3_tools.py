"""Tool calling for Gemma 3, which has no tool syntax of its own: the conversation is rewritten into
plain text turns before its template renders it.

- The tools are described in the system turn, with the instruction to call one by answering with a
  fenced block holding `{"name": ..., "arguments": {...}}` (info string `TOOL_CALL_FENCE`).
- Earlier assistant tool calls are written back as those blocks, so the model sees its own format.
- Tool results become a user turn of ```tool_result blocks (`{"name": ..., "content": ...}`).
- Gemma 3 has no system turn: a system message after the first (Anthropic's mid-conversation system
  messages) is merged into the user turn next to it, as tool results are, since turns must alternate. In that
  turn system text comes first, as Gemma 3's template puts the system prompt first.

`chat/parser.py` reads the model's blocks back and the tool-call grammar forces them; both rely on the
exact fence written here."""

from __future__ import annotations

import json

from .types import Conversation, Message, TextPart, Tool, ToolCall

TOOL_CALL_FENCE = "tool_call"
TOOL_RESULT_FENCE = "tool_result"


def format_tool_call(call: ToolCall) -> str:
    """One call as the model is asked to write it."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"```{TOOL_CALL_FENCE}\n{body}\n```"


def format_tool_result(name: str, content: str) -> str:
    # JSON keeps the block well-formed whatever the result holds, fences and newlines included.
    body = json.dumps({"name": name, "content": content}, ensure_ascii=False)
    return f"```{TOOL_RESULT_FENCE}\n{body}\n```"


def tools_prompt(tools: list[Tool]) -> str:
    """The system-turn text that declares the tools and how to call them."""
    lines = ["# Tools", "", "You can call these tools:"]
    for tool in tools:
        lines += ["", f"## {tool.name}"]
        if tool.description:
            lines.append(tool.description.strip())
        lines.append(f"Parameters (JSON schema): {json.dumps(tool.parameters, ensure_ascii=False)}")
    lines += [
        "",
        ("To call a tool, answer with a fenced block like this one, holding a JSON object with the tool's name "
         "and its arguments:"),
        f"```{TOOL_CALL_FENCE}",
        '{"name": "NAME", "arguments": {"ARGUMENT": "VALUE"}}',
        "```",
        ("Write one block per call; to make several calls, write several blocks one after another. "
         f"Each result comes back in a ```{TOOL_RESULT_FENCE} block."),
    ]
    return "\n".join(lines)


def inline_tools(conversation: Conversation) -> Conversation:
    """The conversation as plain system/user/assistant turns, tools and calls written as text, and only
    a leading system message. A conversation without tools, calls, results or later system messages is
    returned unchanged."""
    messages = conversation.messages
    later_system = any(m.role in ("system", "developer") for m in messages[1:])
    if not conversation.tools and not later_system and not any(m.tool_calls or m.role == "tool" for m in messages):
        return conversation
    out: list[Message] = []
    if conversation.tools:
        declared = tools_prompt(conversation.tools)
        if messages and messages[0].role in ("system", "developer"):
            declared = f"{_text(messages[0])}\n\n{declared}"
            messages = messages[1:]
        out.append(Message(role="system", content=[TextPart(declared)]))
    group: list[Message] = []  # the user, tool and later system messages between two assistant turns
    for message in messages:
        if message.role == "assistant":
            if group:
                out.append(_user_turn(group))
                group = []
            # Gemma 3 does not think, so earlier reasoning has nowhere to go.
            blocks = [_text(message), *(format_tool_call(c) for c in message.tool_calls)]
            out.append(Message(role="assistant", content=[TextPart("\n\n".join(b for b in blocks if b))]))
        else:
            group.append(message)
    if group:
        out.append(_user_turn(group))
    return Conversation(messages=out)


def _user_turn(group: list[Message]) -> Message:
    """One user turn from the messages between two assistant turns, since Gemma 3's turns must alternate.
    System text comes first, as Gemma 3's template puts the system prompt before the first user message, so the
    turn ends with what the user and the tools said: Claude Code sends its agent and skill listings as system
    messages after the user's request, and a small model that reads them last continues the listing instead
    of answering."""
    if len(group) == 1 and group[0].role == "user":
        return group[0]
    system = [_text(m) for m in group if m.role in ("system", "developer")]
    said = [format_tool_result(m.name or "", m.text) if m.role == "tool" else _text(m)
            for m in group if m.role not in ("system", "developer")]
    return Message(role="user", content=[TextPart("\n\n".join(t for t in system + said if t))])


def _text(message: Message) -> str:
    return "\n\n".join(p.text.strip() for p in message.content if isinstance(p, TextPart) and p.text.strip())
