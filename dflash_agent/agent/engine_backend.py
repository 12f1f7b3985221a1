"""The in-process engine as the agent's model."""

from __future__ import annotations

import asyncio
import itertools
from contextlib import aclosing
from dataclasses import asdict

from ..chat.chat_format import ChatFormat, ChatOptions, stream_chat
from ..chat.prompt_size import check_prompt_chars, conversation_chars
from ..chat.types import Conversation
from ..engine import ContextOverflowError, Engine, FinalEvent, SamplingParams
from .backend import AssistantTurn, ContextFull, OnDelta, TurnOptions


class EngineBackend:
    def __init__(self, engine: Engine, chat: ChatFormat, sampling: SamplingParams | None = None) -> None:
        self.engine = engine
        self.chat = chat
        self.sampling = sampling or SamplingParams()
        self._ids = itertools.count()

    async def turn(self, conversation: Conversation, options: TurnOptions, on_delta: OnDelta) -> AssistantTurn:
        # refused by its length first, then rendered and tokenized in a thread: the event loop may serve others
        # (serve's /mcp, the HTTP API)
        try:
            check_prompt_chars(conversation_chars(conversation), self.engine.tokenizer, self.engine.n_ctx)
        except ContextOverflowError as exc:
            raise ContextFull(str(exc)) from None
        prepared = await asyncio.to_thread(self.chat.prepare, conversation, ChatOptions(
            tool_choice=options.tool_choice, parallel_tool_calls=options.parallel_tool_calls,
            enable_thinking=options.enable_thinking))
        parser = prepared.parser()
        request_id = f"agent-{id(self):x}-{next(self._ids)}"
        final: FinalEvent | None = None
        # Closing the stream when the turn ends early (cancelled, or on_delta raised) frees the engine at once.
        events = stream_chat(self.engine, prepared, parser, self.sampling, options.max_tokens, request_id=request_id)
        try:
            async with aclosing(events):
                async for event in events:
                    if isinstance(event, FinalEvent):
                        final = event
                    else:
                        on_delta(event)
        except ContextOverflowError as exc:
            raise ContextFull(str(exc)) from None
        parsed = parser.result()
        return AssistantTurn(parsed.content, parsed.reasoning, parsed.tool_calls, final.finish_reason, final.usage,
                             asdict(final.timings))
