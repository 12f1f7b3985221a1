"""The canonical chat form: what OpenAI and Anthropic requests are converted into, and what
templates render. Tool-call arguments are parsed objects here, never JSON strings."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from ..errors import UserError

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatError(UserError):
    """A request the chat layer cannot render or honour; the API layer answers it with a 400.
    `param` names the offending field the way the client spelled it (`messages[2].content`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TextPart(msgspec.Struct, frozen=True, tag="text"):
    text: str


class ImagePart(msgspec.Struct, frozen=True, tag="image"):
    """Kept so converters can say clearly that images are not supported by the text decoder."""

    url: str


ContentPart = TextPart | ImagePart


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    name: str
    arguments: dict[str, Any]


class Message(msgspec.Struct, frozen=True):
    role: Role
    content: list[ContentPart] = []
    reasoning: str | None = None  # assistant thinking, when the client sends it back
    tool_calls: list[ToolCall] = []  # assistant only
    tool_call_id: str | None = None  # tool only: the call this result answers
    name: str | None = None  # tool only: the function that produced the result

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


def no_parameters() -> dict[str, Any]:
    """The JSON schema of a tool that takes no arguments."""
    return {"type": "object", "properties": {}}


class Tool(msgspec.Struct, frozen=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=no_parameters)


class Conversation(msgspec.Struct, frozen=True):
    messages: list[Message]
    tools: list[Tool] = []
