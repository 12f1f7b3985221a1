"""The agent loop: the model's turn, its tool calls run, their results appended, again, until the
model answers without a call or a budget runs out.

The conversation only ever grows at its end (assistant turn, then its tool results), so each
prompt starts with the previous one token for token and the engine's prefix cache has to prefill
only what is new. Tool results are cut to a size before they enter it."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from ..chat.parser import Delta
from ..chat.types import Conversation, Message, TextPart, Tool, ToolCall
from ..engine import Usage
from ..tools.registry import Registry
from ..tools.tool import ToolResult, elide_middle
from .backend import AssistantTurn, Backend, ContextFull, TurnOptions
from .transcript import Transcript

log = logging.getLogger(__name__)

Outcome = Literal["answered", "max_steps", "max_tokens", "context_full", "interrupted"]
# What `dflash-agent run` exits with; 1 is an error (one line on stderr).
EXIT_CODES: dict[Outcome, int] = {"answered": 0, "max_steps": 3, "max_tokens": 4, "context_full": 4,
                                  "interrupted": 128 + signal.SIGINT}
INTERRUPTED_RESULT = "interrupted by the user before this call ran"


@dataclass(frozen=True)
class AgentConfig:
    max_steps: int = 30
    max_tokens: int | None = None  # generated tokens over the whole run
    max_turn_tokens: int = 4096  # generated tokens in one model turn
    tool_output_chars: int = 20_000  # a tool result is cut to this before it enters the context
    tool_choice: Any = "auto"  # "required" forces a call every step (the chat layer's grammar)
    parallel_tool_calls: bool = True
    enable_thinking: bool = False


# --- events: what a view, a transcript or an MCP progress report follows ---------------------------


@dataclass(frozen=True)
class StepStart:
    step: int


@dataclass(frozen=True)
class ModelDelta:
    step: int
    delta: Delta


@dataclass(frozen=True)
class TurnEnd:
    """The model's turn is complete; its tool calls (if any) run next."""

    step: int
    turn: AssistantTurn


@dataclass(frozen=True)
class ToolStart:
    step: int
    call: ToolCall


@dataclass(frozen=True)
class ToolEnd:
    step: int
    call: ToolCall
    result: ToolResult
    seconds: float


@dataclass(frozen=True)
class StepEnd:
    """A step is done: the model's turn and its tool calls. (One MCP progress notification.)"""

    step: int
    max_steps: int
    usage: Usage  # the run's so far


@dataclass
class RunResult:
    outcome: Outcome
    answer: str  # the model's last text
    steps: int
    usage: Usage
    seconds: float

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.outcome]


@dataclass(frozen=True)
class RunEnd:
    result: RunResult


AgentEvent = StepStart | ModelDelta | TurnEnd | ToolStart | ToolEnd | StepEnd | RunEnd


class Agent:
    """One conversation with the model over a set of tools. `run` may be called again (a chat): each
    call appends the user's message and continues the same conversation."""

    def __init__(self, backend: Backend, registry: Registry, system_prompt: str,
                 config: AgentConfig = AgentConfig(), on_event: Callable[[AgentEvent], None] | None = None,
                 transcript: Transcript | None = None) -> None:
        self.backend = backend
        self.registry = registry
        self.config = config
        self.on_event = on_event or (lambda event: None)
        self.transcript = transcript
        # Fixed for the whole conversation: the tools are part of every prompt's prefix.
        self.tools = [Tool(s.name, s.description, s.input_schema) for s in registry.tools]
        self.messages: list[Message] = []
        self._task: asyncio.Task | None = None
        self._interrupted = False
        self._steps = 0
        self._append(Message(role="system", content=[TextPart(system_prompt)]))

    def interrupt(self) -> None:
        """Stop the run in progress at once (generation, or the running command, with it); `run` then
        returns with outcome "interrupted". Call it from the event loop's thread (a signal handler
        installed with loop.add_signal_handler, another task)."""
        if self._task is not None and not self._interrupted:
            self._interrupted = True
            self._task.cancel()

    def clear(self) -> None:
        """Start a new conversation (a chat's /clear): the system prompt alone, the earlier tasks forgotten."""
        if self._task is not None:
            raise RuntimeError("the agent is running a task")
        del self.messages[1:]
        if self.transcript is not None:
            self.transcript.event("clear")

    async def run(self, task: str) -> RunResult:
        """Cancelling the task that awaits this raises CancelledError as usual (after the transcript
        records it); `interrupt()` makes it return instead."""
        if self._task is not None:
            raise RuntimeError("the agent is already running a task")
        started = time.monotonic()
        self._task, self._interrupted, self._steps = asyncio.current_task(), False, 0
        usage = Usage(0, 0)
        self._append(Message(role="user", content=[TextPart(task)]))
        try:
            outcome, answer = await self._loop(usage)
        except asyncio.CancelledError:
            self._answer_open_calls()
            if not self._interrupted:
                self._record_end("cancelled", usage, started)
                raise
            self._task.uncancel()
            outcome, answer = "interrupted", self._last_answer()
        except BaseException as exc:
            self._answer_open_calls()
            self._record_end("error", usage, started, error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._task = None
        result = RunResult(outcome, answer, self._steps, usage, time.monotonic() - started)
        if outcome == "context_full" and self._steps == 0:
            # The task does not fit (beside the conversation so far): kept, it would fill every later turn too.
            self.messages.pop()
            if self.transcript is not None:
                self.transcript.event("dropped", role="user", reason="the task does not fit in the context")
        self._record_end(outcome, usage, started)
        self.on_event(RunEnd(result))
        return result

    async def _loop(self, usage: Usage) -> tuple[Outcome, str]:
        cfg = self.config
        while True:
            if self._steps >= cfg.max_steps:
                return "max_steps", self._last_answer()
            budget = cfg.max_turn_tokens
            if cfg.max_tokens is not None:
                budget = min(budget, cfg.max_tokens - usage.completion_tokens)
                if budget <= 0:
                    return "max_tokens", self._last_answer()
            step = self._steps + 1
            self.on_event(StepStart(step))
            try:
                turn = await self.backend.turn(Conversation(list(self.messages), self.tools),
                                               TurnOptions(cfg.tool_choice, cfg.parallel_tool_calls, budget,
                                                           cfg.enable_thinking),
                                               lambda delta: self.on_event(ModelDelta(step, delta)))
            except ContextFull as exc:
                log.info("context full: %s", exc)
                return "context_full", self._last_answer()
            self._steps = step
            log.debug("step %d: %d prompt tokens (%d cached), %d generated, %s, %d calls", step,
                      turn.usage.prompt_tokens, turn.usage.cached_tokens, turn.usage.completion_tokens,
                      turn.finish_reason, len(turn.tool_calls))
            usage.prompt_tokens += turn.usage.prompt_tokens
            usage.completion_tokens += turn.usage.completion_tokens
            usage.cached_tokens += turn.usage.cached_tokens
            self._append(Message(role="assistant", content=[TextPart(turn.content)] if turn.content else [],
                                 reasoning=turn.reasoning, tool_calls=turn.tool_calls),
                         step=step, finish_reason=turn.finish_reason, usage=asdict(turn.usage),
                         timings=turn.timings)
            self.on_event(TurnEnd(step, turn))
            for call in turn.tool_calls:
                await self._call_tool(step, call, turn.bad_arguments.get(call.id))
            self.on_event(StepEnd(step, cfg.max_steps, replace(usage)))
            if not turn.tool_calls:
                # Cut off by a token limit is not an answer.
                return ("max_tokens" if turn.finish_reason == "length" else "answered"), turn.content

    async def _call_tool(self, step: int, call: ToolCall, bad_arguments: str | None) -> None:
        self.on_event(ToolStart(step, call))
        started = time.monotonic()
        if bad_arguments is not None:
            result = ToolResult(bad_arguments, is_error=True)
        else:
            result = await self.registry.dispatch(call.name, call.arguments)
        seconds = time.monotonic() - started
        log.debug("step %d: %s took %.2f s%s", step, call.name, seconds, " (error)" if result.is_error else "")
        self._append_result(call, result, seconds)
        self.on_event(ToolEnd(step, call, result, seconds))

    def _append_result(self, call: ToolCall, result: ToolResult, seconds: float | None = None) -> None:
        text = elide_middle(result.text, self.config.tool_output_chars)
        if result.is_error:
            text = f"Error: {text}"
        self._append(Message(role="tool", content=[TextPart(text)], tool_call_id=call.id, name=call.name),
                     is_error=result.is_error, seconds=seconds)

    def _answer_open_calls(self) -> None:
        """Every call of the last assistant turn gets a result, so the conversation stays valid
        (and can go on, in a chat) after an interruption."""
        last = next((i for i in range(len(self.messages) - 1, -1, -1) if self.messages[i].role == "assistant"), None)
        if last is None:
            return
        answered = {m.tool_call_id for m in self.messages[last + 1:] if m.role == "tool"}
        for call in self.messages[last].tool_calls:
            if call.id not in answered:
                self._append_result(call, ToolResult(INTERRUPTED_RESULT, is_error=True))

    def _last_answer(self) -> str:
        return next((m.text for m in reversed(self.messages) if m.role == "assistant"), "")

    def _append(self, message: Message, **extra: Any) -> None:
        self.messages.append(message)
        if self.transcript is not None:
            self.transcript.message(message, **extra)

    def _record_end(self, outcome: str, usage: Usage, started: float, **extra: Any) -> None:
        if self.transcript is not None:
            self.transcript.event("end", outcome=outcome, steps=self._steps, usage=asdict(usage),
                                  seconds=round(time.monotonic() - started, 3), **extra)
