"""The embedded engine with the model's words replaced by a script: a test double for what a 270M model cannot do
on a coding assistant's prompt (call a tool, read its result, end its turn). Everything else is real: the
tokenizer, the chat template and tool syntax, the HTTP routes, and the client under test. It records every prompt
it was given, rendered, so a test can check what came back from the client. With `prefill=True` each prompt is
also prefilled by the real engine (prefix cache included) before the scripted answer, so usage and timings are
real."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from dflash_agent.engine import Engine, FinalEvent, GenerateRequest, Timings, TokenEvent, Usage


def fenced_call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call in the Gemma 3 syntax the chat layer teaches the embedded model."""
    return "```tool_call\n" + json.dumps({"name": name, "arguments": arguments}) + "\n```"


class ScriptedEngine:
    """`reply(prompt_text)` says what the model answers to a rendered prompt."""

    def __init__(self, engine: Engine, reply: Callable[[str], str], prefill: bool = False) -> None:
        self._engine, self._reply, self._prefill = engine, reply, prefill
        self.prompts: list[str] = []
        self.usages: list[Usage] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    stream = Engine.stream  # the engine's own consumer, reading this generate()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
        prompt = self._engine.tokenizer.decode(request.prompt_ids)
        self.prompts.append(prompt)
        text = self._reply(prompt)
        ids = self._engine.tokenizer.encode(text, add_bos=False)
        usage, timings = Usage(len(request.prompt_ids), len(ids)), Timings(prompt_n=len(request.prompt_ids))
        if self._prefill:  # one real token after the prompt, which the script's answer replaces
            async for event in self._engine.generate(replace(request, max_tokens=1, grammar=None)):
                if isinstance(event, FinalEvent):
                    usage, timings = replace(event.usage, completion_tokens=len(ids)), event.timings
        elif request.on_prefix is not None:
            request.on_prefix(0)
        self.usages.append(usage)
        yield TokenEvent(ids, text)
        yield FinalEvent("stop", usage, timings)
