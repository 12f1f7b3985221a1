"""A scripted model: a test double behind the agent's Backend protocol that replays assistant turns
(text and tool calls), streaming them as the chat parser would. It isolates the loop from any
model; everything else (tools, transcript, view) runs for real."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash_agent.agent.backend import AssistantTurn, TurnOptions
from dflash_agent.chat.parser import Delta, TextDelta, ToolCallArgsDelta, ToolCallStart
from dflash_agent.chat.types import Conversation, ToolCall
from dflash_agent.engine import Usage


@dataclass
class Say:
    """One scripted turn: text, then tool calls given as (name, arguments)."""

    text: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    finish_reason: str | None = None  # default: "tool_calls" with calls, else "stop"
    completion_tokens: int = 10
    delay: float = 0.0  # seconds "generating", to test interruption


def bash(command: str, **more: Any) -> tuple[str, dict[str, Any]]:
    return "bash", {"command": command, **more}


class ScriptedModel:
    """Replays `script`; an entry may be a function of the conversation so far (to react to a tool
    result). Records every conversation and options it was given."""

    def __init__(self, script: list[Say | Callable[[Conversation], Say]]) -> None:
        self.script = list(script)
        self.conversations: list[Conversation] = []
        self.options: list[TurnOptions] = []
        self._calls = 0

    async def turn(self, conversation: Conversation, options: TurnOptions,
                   on_delta: Callable[[Delta], None]) -> AssistantTurn:
        self.conversations.append(conversation)
        self.options.append(options)
        if not self.script:
            raise AssertionError("the agent asked for more turns than the script has")
        entry = self.script.pop(0)
        say = entry(conversation) if callable(entry) else entry
        if say.delay:
            await asyncio.sleep(say.delay)
        if say.text:
            on_delta(TextDelta(say.text))
        calls = []
        for index, (name, arguments) in enumerate(say.calls):
            self._calls += 1
            call = ToolCall(f"call_{self._calls}", name, arguments)
            on_delta(ToolCallStart(index, call.id, name))
            on_delta(ToolCallArgsDelta(index, json.dumps(arguments)))
            calls.append(call)
        finish = say.finish_reason or ("tool_calls" if calls else "stop")
        prompt_tokens = sum(len(m.text) for m in conversation.messages) // 4
        return AssistantTurn(say.text, None, calls, finish, Usage(prompt_tokens, say.completion_tokens))
