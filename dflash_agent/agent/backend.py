"""How the agent reaches a model: one assistant turn per call. The in-process engine, a server
over HTTP and the tests' scripted model all implement `Backend`; the loop knows nothing else."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..chat.parser import Delta
from ..chat.types import Conversation, ToolCall
from ..engine import Usage

OnDelta = Callable[[Delta], None]


@dataclass(frozen=True)
class TurnOptions:
    tool_choice: Any = "auto"  # "auto" | "none" | "required" | a named function (OpenAI's form)
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    enable_thinking: bool = False  # Gemma 4's reasoning before it answers or calls


@dataclass
class AssistantTurn:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: str  # "stop" | "length" | "tool_calls" | "cancelled"
    usage: Usage
    timings: dict[str, Any] | None = None  # llama.cpp's names, when the model reports them
    # Calls whose arguments were not a JSON object (from a server we did not write): id -> why.
    bad_arguments: dict[str, str] = field(default_factory=dict)


class Backend(Protocol):
    async def turn(self, conversation: Conversation, options: TurnOptions, on_delta: OnDelta) -> AssistantTurn:
        """The model's next turn after `conversation` (which carries the tools), its text and calls
        streamed to `on_delta` as they are parsed. Cancelling the awaiting task stops generation."""
        ...


class BackendError(ConnectionError):
    """The model could not be reached or refused the request (one line for the user)."""


class ContextFull(Exception):
    """The conversation no longer fits the model's context."""
