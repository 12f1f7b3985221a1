"""Tool calling for Gemma 3, which has no tool syntax of its own: the conversation is rewritten into
plain text turns before its template renders it.

- The tools are described in the system turn, with the instruction to call one by answering with a
  fenced block holding `{"name": ..., "arguments": {...}}` (info string `TOOL_CALL_FENCE`).
- Earlier assistant tool calls are written back as those blocks, so the model sees its own format.
- Tool results become a user turn of ```tool_result blocks (`{"name": ..., "content": ...}`).
- Gemma 3 has no system turn: a system message after the first (Anthropic's mid-conversation system
  messages) is merged into the user turn next to it, as tool results are, since turns must alternate. In that
  turn system text comes first, as Gemma 3's template puts the system prompt first.
- Turns must alternate, but OpenAI and Anthropic accept several user (or assistant) messages in a row
  (opencode's title request sends two): consecutive turns of one side are merged into one, their texts joined
  by a blank line. A merged turn only grows at its end, so a conversation that grows still extends its earlier
  prompt up to the text it had.

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
    """The conversation as plain system/user/assistant turns that alternate, tools and calls written as text,
    and only a leading system message. A conversation without tools, calls, results, later system messages or
    two turns of one side in a row is returned unchanged; one without the first four only has its runs merged."""
    messages = conversation.messages
    later_system = any(m.role in ("system", "developer") for m in messages[1:])
    if not conversation.tools and not later_system and not any(m.tool_calls or m.role == "tool" for m in messages):
        return _merge_repeated(conversation)
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
            if out and out[-1].role == "assistant":  # the assistant's second message in a row
                blocks.insert(0, out.pop().text)
            out.append(Message(role="assistant", content=[TextPart("\n\n".join(b for b in blocks if b))]))
        else:
            group.append(message)
    if group:
        out.append(_user_turn(group))
    return Conversation(messages=out)


def _merge_repeated(conversation: Conversation) -> Conversation:
    """A plain conversation (a leading system message, then user and assistant turns) with each run of turns
    of one side merged into one, as `_user_turn` merges a group, and the rest untouched."""
    out: list[Message] = []
    for message in conversation.messages:
        previous = out[-1] if out else None
        if previous is None or previous.role != message.role or message.role not in ("user", "assistant") \
                or _has_images(previous) or _has_images(message):  # left to the template, which refuses images
            out.append(message)
            continue
        texts = (_text(previous), _text(message))
        out[-1] = Message(role=message.role, content=[TextPart("\n\n".join(t for t in texts if t))])
    if len(out) == len(conversation.messages):
        return conversation
    return Conversation(messages=out, tools=conversation.tools)


def _has_images(message: Message) -> bool:
    return any(not isinstance(p, TextPart) for p in message.content)


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
