"""The terminal view of a run (rich): each step, the model's text as it streams, each tool call and
a preview of its result, and a summary at the end."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.status import Status

from ..chat.parser import ReasoningDelta, TextDelta, ToolCallStart
from ..chat.types import ToolCall
from .loop import AgentEvent, ModelDelta, RunEnd, StepStart, ToolEnd, ToolStart, TurnEnd

PREVIEW_HEAD, PREVIEW_TAIL = 3, 5  # lines of a long tool result shown: its start and its end (test summaries)
PREVIEW_CHARS = 160
OUTCOME_STYLES = {"answered": "green", "interrupted": "yellow"}


# Control characters but newline and tab, shown as \x.. escapes: a repository's files, a command's output or the
# model's text would otherwise reach the terminal raw (ESC sequences clear the screen, move the cursor over what
# was printed, or set the clipboard through OSC 52)
_VISIBLE = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0)) if c not in (0x09, 0x0a)}


def visible(text: str) -> str:
    return text.translate(_VISIBLE)


def describe_call(call: ToolCall) -> str:
    """One line that says what a call does."""
    args = call.arguments
    if call.name == "bash":
        return "$ " + _clip(str(args.get("command", "")).strip().replace("\n", " ⏎ "))
    if call.name in ("read_file", "write_file", "edit_file", "list_dir") and isinstance(args.get("path"), str):
        detail = ""
        if call.name == "read_file" and ("offset" in args or "limit" in args):
            detail = f" (from line {args.get('offset', 1)}, {args.get('limit', 'all')} lines)"
        return f"{call.name} {args['path']}{detail}"
    if call.name in ("glob", "grep") and isinstance(args.get("pattern"), str):
        return f"{call.name} {args['pattern']!r} in {args.get('path', '.')}"
    return f"{call.name} {_clip(json.dumps(args, ensure_ascii=False))}"


def _clip(text: str, limit: int = PREVIEW_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


class TerminalView:
    """Follows an agent's events (pass it as `on_event`)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)
        self._status: Status | None = None
        self._streaming: type | None = None  # the kind of model text printed on the current line

    def __call__(self, event: AgentEvent) -> None:
        if isinstance(event, StepStart):
            self.console.rule(f"step {event.step}", style="dim")
            self._spin("thinking…")
        elif isinstance(event, ModelDelta):
            self._on_delta(event)
        elif isinstance(event, TurnEnd):
            self._end_line()
            self._stop_spin()
            self.console.print(f"[dim]{self._turn_stats(event)}[/dim]")
        elif isinstance(event, ToolStart):
            self.console.print(f"[bold cyan]▶[/] {escape(visible(describe_call(event.call)))}")
            self._spin(f"running {event.call.name}…")
        elif isinstance(event, ToolEnd):
            self._stop_spin()
            self._preview(event)
        elif isinstance(event, RunEnd):
            self._end_line()
            self._stop_spin()
            r = event.result
            style = OUTCOME_STYLES.get(r.outcome, "red")
            self.console.rule(f"[{style}]{r.outcome}[/] after {r.steps} step{'s' if r.steps != 1 else ''} · "
                              f"{r.usage.completion_tokens:,} tokens generated · {r.seconds:.1f} s", style="dim")

    def _on_delta(self, event: ModelDelta) -> None:
        delta = event.delta
        if isinstance(delta, TextDelta | ReasoningDelta):
            self._stop_spin()
            if self._streaming is not type(delta):
                self._end_line()
            style = "dim italic" if isinstance(delta, ReasoningDelta) else None
            self.console.print(visible(delta.text), end="", style=style, markup=False, highlight=False,
                               soft_wrap=True)
            self._streaming = type(delta)
        elif isinstance(delta, ToolCallStart):
            self._end_line()
            self._spin(f"writing a {delta.name} call…")

    def _turn_stats(self, event: TurnEnd) -> str:
        usage, timings = event.turn.usage, event.turn.timings or {}
        parts = [f"{usage.completion_tokens:,} tokens"]
        if timings.get("predicted_per_second"):
            parts.append(f"{timings['predicted_per_second']:.1f} tok/s")
        prompt = f"prompt {usage.prompt_tokens:,}"
        if usage.cached_tokens:
            prompt += f" ({usage.cached_tokens:,} cached)"
        parts.append(prompt)
        if event.turn.finish_reason == "length":
            parts.append("cut off at the token limit")
        return " · ".join(parts)

    def _preview(self, event: ToolEnd) -> None:
        lines = [_clip(visible(line)) for line in event.result.text.splitlines()] or [""]
        hidden = len(lines) - PREVIEW_HEAD - PREVIEW_TAIL
        shown = lines if hidden <= 1 else [*lines[:PREVIEW_HEAD], f"… {hidden:,} more lines",
                                           *lines[-PREVIEW_TAIL:]]
        style = "red" if event.result.is_error else "dim"
        for line in shown:
            self.console.print(f"  [{style}]│ {escape(line)}[/]", soft_wrap=True)

    def _spin(self, message: str) -> None:
        if not self.console.is_terminal:
            return
        self._stop_spin()
        self._status = self.console.status(message, spinner="dots")
        self._status.start()

    def _stop_spin(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def _end_line(self) -> None:
        if self._streaming is not None:
            self.console.print()
            self._streaming = None

    def close(self) -> None:
        self._stop_spin()


def print_welcome(console: Console, details: dict[str, Any]) -> None:
    console.print(" · ".join(f"[bold]{k}[/] {escape(str(v))}" for k, v in details.items()), soft_wrap=True)
