"""Incremental parsing of model output into content, reasoning and tool-call deltas.

The engine streams detokenized text (special tokens kept); a parser is fed those chunks, of
any size, and returns deltas as soon as they are certain. It holds back only what may still
turn out to be a marker (a prefix of `<|tool_call>` at the end of a chunk, say) or, for
Gemma 3, a line that may be a fence.

Contract shared by both parsers:
- `feed(text)` / `finish()` never raise on model output; `finish()` closes whatever is open.
- The final `result()` is exactly the fold of the deltas: content and reasoning are the
  concatenated text deltas, and each call's arguments are the JSON its fragments spell out,
  which is `json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))`.
- Output that cannot be read as a tool call is surfaced as content, never dropped
  (logged at debug).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Callable
from typing import Protocol

import msgspec

from .gemma3_tools import TOOL_CALL_FENCE
from .gemma4_syntax import (
    CALL_PREFIX,
    CHANNEL_CLOSE,
    CHANNEL_OPEN,
    END_MARKERS,
    FRAME_MARKERS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ArgumentReader,
    ReadOutcome,
    find_marker,
)
from .types import ChatError, ToolCall

log = logging.getLogger(__name__)


# --- deltas and result ------------------------------------------------------------------------


class TextDelta(msgspec.Struct, frozen=True):
    text: str


class ReasoningDelta(msgspec.Struct, frozen=True):
    text: str


class ToolCallStart(msgspec.Struct, frozen=True):
    index: int  # 0-based position of the call in this output
    id: str
    name: str


class ToolCallArgsDelta(msgspec.Struct, frozen=True):
    index: int
    fragment: str  # the next piece of the call's arguments as JSON text


Delta = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgsDelta


class ParsedOutput(msgspec.Struct, frozen=True):
    content: str
    reasoning: str | None  # None when the model produced no reasoning text
    tool_calls: list[ToolCall]


class OutputParser(Protocol):
    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...

    def result(self) -> ParsedOutput: ...


def random_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _dump_arguments(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class _Transcript:
    """Everything a parser has emitted, folded into the final message, and the emitting
    itself (with adjacent pieces of the same kind merged)."""

    def __init__(self, id_factory: Callable[[], str], max_calls: int | None = None) -> None:
        self._id_factory = id_factory
        self._max_calls = max_calls
        self._dropping = False  # inside a call past max_calls: neither it nor its arguments are kept
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[tuple[str, str, list[str]]] = []  # id, name, argument fragments
        self._pending: list[Delta] = []
        self.finished = False

    def text(self, text: str) -> None:
        if text:
            self._text.append(text)
            self._push(TextDelta(text))

    def reasoning(self, text: str) -> None:
        if text:
            self._reasoning.append(text)
            self._push(ReasoningDelta(text))

    def start_call(self, name: str) -> None:
        self._dropping = self._max_calls is not None and len(self._calls) >= self._max_calls
        if self._dropping:
            return
        call_id = self._id_factory()
        self._calls.append((call_id, name, []))
        self._pending.append(ToolCallStart(len(self._calls) - 1, call_id, name))

    def arguments(self, fragment: str) -> None:
        """Append to the arguments of the latest call."""
        if fragment and not self._dropping:
            self._calls[-1][2].append(fragment)
            self._push(ToolCallArgsDelta(len(self._calls) - 1, fragment))

    def take(self) -> list[Delta]:
        pending, self._pending = self._pending, []
        return pending

    def result(self) -> ParsedOutput:
        if not self.finished:
            raise RuntimeError("result() is available after finish()")
        calls = [
            ToolCall(id=call_id, name=name, arguments=json.loads("".join(fragments)))
            for call_id, name, fragments in self._calls
        ]
        return ParsedOutput("".join(self._text), "".join(self._reasoning) or None, calls)

    def _push(self, delta: Delta) -> None:
        last = self._pending[-1] if self._pending else None
        if type(last) is type(delta) and isinstance(delta, (TextDelta, ReasoningDelta)):
            self._pending[-1] = type(delta)(last.text + delta.text)
        elif (
            isinstance(last, ToolCallArgsDelta)
            and isinstance(delta, ToolCallArgsDelta)
            and last.index == delta.index
        ):
            self._pending[-1] = ToolCallArgsDelta(delta.index, last.fragment + delta.fragment)
        else:
            self._pending.append(delta)


# --- Gemma 4 ----------------------------------------------------------------------------------

# What may follow <|tool_call>: `call:NAME{`. The prefix is tolerated missing.
_CALL_HEADER = re.compile(r"\s*(?:" + re.escape(CALL_PREFIX) + r")?([\w.\-]+)\{")
_CALL_HEADER_PREFIX = re.compile(r"\s*(?:" + re.escape(CALL_PREFIX) + r")?[\w.\-]*")
_MAX_HEADER = 256
# A channel opens with a label ("thought") and a newline. Longer words than this are taken
# for reasoning text rather than a label.
_CHANNEL_LABEL = re.compile(r"[A-Za-z_]*")
_MAX_LABEL = 32


def _is_prefix(text: str, marker: str) -> bool:
    """text is empty or a proper prefix of marker."""
    return len(text) < len(marker) and marker.startswith(text)


class Gemma4OutputParser:
    """Gemma 4 output: `<|channel>thought\\n...<channel|>` reasoning, content, and
    `<|tool_call>call:NAME{...}<tool_call|>` calls, in any order and number.

    Tolerated (gemma4.md 4.3): `<turn|>`, `<|tool_response>`, `<eos>` or the end of the stream
    in place of `<tool_call|>`; a stray empty thought channel or `<channel|>`; a missing
    `call:` prefix; quoted keys; text after calls. An end-of-message token ends parsing: any
    text after it is ignored. Inside a string value only `<|"|>` means anything, so values
    may contain the other markers' text.

    Malformed calls: a `<|tool_call>` not followed by `call:NAME{` is content. Once the header
    is read the call has been announced (ToolCallStart), so a syntax error in its arguments
    closes the call with the arguments read so far, and the text from the error on is
    content. The stream ending mid-call closes the call the same way.
    """

    def __init__(
        self, *, id_factory: Callable[[], str] = random_call_id, in_reasoning: bool = False,
        max_calls: int | None = None,
    ) -> None:
        """in_reasoning: the prompt ended inside an open thought channel (label included).
        max_calls: calls past this many are dropped."""
        self._out = _Transcript(id_factory, max_calls)
        self._buf = ""
        self._handler = self._reasoning if in_reasoning else self._text
        self._args: ArgumentReader | None = None

    def feed(self, text: str) -> list[Delta]:
        if self._out.finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        self._run(final=False)
        return self._out.take()

    def finish(self) -> list[Delta]:
        if not self._out.finished:
            self._run(final=True)
            self._out.finished = True
        return self._out.take()

    def result(self) -> ParsedOutput:
        return self._out.result()

    def _run(self, final: bool) -> None:
        # Each handler consumes from _buf and/or switches _handler; False means it waits.
        while self._handler(final):
            pass

    def _text(self, final: bool) -> bool:
        return self._framed(final, self._out.text)

    def _reasoning(self, final: bool) -> bool:
        return self._framed(final, self._out.reasoning)

    def _framed(self, final: bool, emit: Callable[[str], None]) -> bool:
        """Content or reasoning up to the next marker, which decides what comes next."""
        at, marker = find_marker(self._buf, FRAME_MARKERS)
        if marker is None:
            end = len(self._buf) if final else at
            emit(self._buf[:end])
            self._buf = self._buf[end:]
            return False
        emit(self._buf[:at])
        self._buf = self._buf[at + len(marker) :]
        if marker == CHANNEL_OPEN:
            if self._handler == self._text:
                self._handler = self._label
            else:
                log.debug("ignoring %s inside reasoning", marker)
        elif marker == CHANNEL_CLOSE and self._handler == self._reasoning:
            self._handler = self._text
        elif marker == TOOL_CALL_OPEN:
            self._handler = self._header
        elif marker in END_MARKERS:
            self._handler = self._ended
        else:
            log.debug("dropping stray %s", marker)
        return True

    def _label(self, final: bool) -> bool:
        """Just after <|channel>: drop the channel's label."""
        label = _CHANNEL_LABEL.match(self._buf).end()
        rest = self._buf[label:]
        if label and rest.startswith("\n"):
            self._buf = rest[1:]
        elif label and (rest.startswith(CHANNEL_CLOSE) or (final and not rest)):
            self._buf = rest
        elif not final and label <= _MAX_LABEL and _is_prefix(rest, CHANNEL_CLOSE):
            return False  # the label may go on, or <channel|> may be arriving
        self._handler = self._reasoning
        return True

    def _header(self, final: bool) -> bool:
        """Just after <|tool_call>: `call:NAME{` starts the call."""
        match = _CALL_HEADER.match(self._buf)
        if match:
            self._buf = self._buf[match.end() :]
            self._out.start_call(match.group(1))
            self._out.arguments("{")
            self._args = ArgumentReader()
            self._handler = self._arguments
            return True
        if (
            not final
            and len(self._buf) <= _MAX_HEADER
            and _CALL_HEADER_PREFIX.fullmatch(self._buf)
        ):
            return False
        if final and _CALL_HEADER_PREFIX.fullmatch(self._buf):
            # A call cut by the token limit before its arguments: tool syntax, never content.
            log.debug("dropping a tool call cut before its arguments: %r", self._buf[:80])
            self._buf = ""
            self._handler = self._text
            return True
        log.debug("not a tool call header after %s: %r", TOOL_CALL_OPEN, self._buf[:80])
        self._out.text(TOOL_CALL_OPEN)
        self._handler = self._text
        return True

    def _arguments(self, final: bool) -> bool:
        assert self._args is not None
        consumed, fragment, outcome = self._args.read(self._buf, final)
        self._buf = self._buf[consumed:]
        self._out.arguments(fragment)
        if outcome is ReadOutcome.CLOSED:
            self._args = None
            self._handler = self._call_end
            return True
        if outcome is ReadOutcome.NEED_MORE and not final:
            return False
        if outcome is ReadOutcome.INVALID:
            log.debug("malformed tool call arguments at %r; rest is content", self._buf[:80])
        self._out.arguments(self._args.close())
        self._args = None
        self._buf = self._buf.removeprefix(TOOL_CALL_CLOSE)
        self._handler = self._text
        return True

    def _call_end(self, final: bool) -> bool:
        """After the arguments' closing brace: <tool_call|> is expected; anything else (an
        end-of-message token, another call, text) is left to the text handler."""
        if self._buf.startswith(TOOL_CALL_CLOSE):
            self._buf = self._buf[len(TOOL_CALL_CLOSE) :]
        elif not final and _is_prefix(self._buf, TOOL_CALL_CLOSE):
            return False
        self._handler = self._text
        return True

    def _ended(self, final: bool) -> bool:
        if self._buf.strip():
            log.debug("ignoring text after the end of the message: %r", self._buf[:80])
        self._buf = ""
        return False


# --- Gemma 3: fenced JSON ---------------------------------------------------------------------

# CommonMark fences: up to three spaces, then three or more backticks or tildes.
_FENCE_OPEN = re.compile(r" {0,3}(`{3,}|~{3,})([^\n]*)\n?")
_FENCE_CLOSE = re.compile(r" {0,3}(`{3,}|~{3,})[ \t]*\r?\n?")


class FencedToolCallParser:
    """Tool calls written as fenced blocks whose info string is `tool_call` (the convention
    chat/gemma3_tools.py teaches Gemma 3):

        ```tool_call
        {"name": "NAME", "arguments": {...}}
        ```

    Everything else is content, other fenced blocks included. Fences follow CommonMark, so a
    `tool_call` fence shown inside another code block stays text, as a markdown view would
    show it. A block's JSON is read when its closing fence arrives (or the stream ends); the
    call's deltas come then. A block that is not a JSON object with a string `name` and an
    object `arguments` (or a JSON string holding one; missing means {}) is content.

    Tool syntax never reaches content when the output is cut (max_tokens): a last line that
    could still have become a `tool_call` opening fence (```` ``` ````, ```` ```tool ````) is
    dropped, as is an unclosed block. Blank lines after a call are the separator between
    blocks: they are content only if text follows them.
    """

    def __init__(self, *, id_factory: Callable[[], str] = random_call_id, max_calls: int | None = None) -> None:
        """max_calls: calls past this many are dropped."""
        self._out = _Transcript(id_factory, max_calls)
        self._buf = ""
        self._line_start = True  # _buf starts at the beginning of a line
        self._code_fence: str | None = None  # the fence of an open ordinary code block
        self._call_fence: str | None = None  # the fence of an open tool_call block
        self._call_lines: list[str] = []  # that block's raw lines, opening fence included
        self._after_call = False  # nothing but blank lines since the last tool_call block
        self._blank = ""  # those blank lines, held until text follows them

    def feed(self, text: str) -> list[Delta]:
        if self._out.finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        self._run(final=False)
        return self._out.take()

    def finish(self) -> list[Delta]:
        if not self._out.finished:
            self._run(final=True)
            if self._call_fence is not None:  # no closing fence: read what there is
                self._end_call_block(closed=False)
            self._blank = ""  # the separator after the last call
            self._out.finished = True
        return self._out.take()

    def result(self) -> ParsedOutput:
        return self._out.result()

    def _run(self, final: bool) -> None:
        buf, pos = self._buf, 0
        while pos < len(buf):
            newline = buf.find("\n", pos)
            end = newline + 1 if newline >= 0 else len(buf)
            line = buf[pos:end]
            if self._call_fence is None and not self._line_start:
                # The rest of a line already known to be plain text.
                self._text(line)
            elif self._after_call and not line.strip(" \t\r\n"):
                if newline < 0 and not final:
                    break  # blank so far: a separator, or the start of text
                self._blank += line
            elif self._call_fence is None and not self._may_be_fence(line):
                self._line_start = False
                continue
            elif newline < 0 and not final:
                break  # a fence line, or a line of the tool_call block: wait for all of it
            elif newline < 0 and self._call_fence is None and self._code_fence is None and _cut_call_opening(line):
                log.debug("dropping a tool_call fence cut before it opened: %r", line)
            else:
                self._whole_line(line)
            pos = end
            self._line_start = newline >= 0
        self._buf = buf[pos:]

    @staticmethod
    def _may_be_fence(line: str) -> bool:
        """False once the start of a line rules out a fence."""
        stripped = line.lstrip(" ")
        return len(line) - len(stripped) <= 3 and (not stripped or stripped[0] in "`~")

    def _whole_line(self, line: str) -> None:
        if self._call_fence is not None:
            self._call_lines.append(line)
            if self._closes(line, self._call_fence):
                self._end_call_block(closed=True)
            return
        if self._code_fence is not None:
            if self._closes(line, self._code_fence):
                self._code_fence = None
            self._text(line)
            return
        opening = _FENCE_OPEN.fullmatch(line)
        if opening is None or (opening.group(1)[0] == "`" and "`" in opening.group(2)):
            self._text(line)  # not a fence (an inline ```code``` span, say)
        elif opening.group(2).strip() == TOOL_CALL_FENCE:
            self._call_fence = opening.group(1)
            self._call_lines = [line]
            self._blank, self._after_call = "", False  # the separator between two calls
        else:
            self._code_fence = opening.group(1)
            self._text(line)

    def _text(self, text: str) -> None:
        """Content, after the blank lines it follows."""
        self._out.text(self._blank + text)
        self._blank = ""
        self._after_call = False

    @staticmethod
    def _closes(line: str, fence: str) -> bool:
        closing = _FENCE_CLOSE.fullmatch(line)
        return (
            closing is not None
            and closing.group(1)[0] == fence[0]
            and len(closing.group(1)) >= len(fence)
        )

    def _end_call_block(self, closed: bool) -> None:
        lines, self._call_lines, self._call_fence = self._call_lines, [], None
        body = "".join(lines[1:-1] if closed else lines[1:])
        call = self._read_call(body)
        if call is None and not closed:
            # A block the output ended inside (the token limit cut it): tool syntax, never content.
            log.debug("dropping an unfinished tool_call block: %r", body[:80])
            return
        if call is None:
            log.debug("tool_call block is not a valid call; kept as content: %r", body[:80])
            self._text("".join(lines))
            return
        name, arguments = call
        self._out.start_call(name)
        self._out.arguments(arguments)
        self._after_call = True

    @staticmethod
    def _read_call(body: str) -> tuple[str, str] | None:
        """(name, arguments as JSON text) from a block's body, or None if it is not a call."""
        try:
            call = json.loads(body)
            arguments = call.get("arguments", {}) if isinstance(call, dict) else None
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            name = call.get("name") if isinstance(call, dict) else None
            if not (isinstance(name, str) and name and isinstance(arguments, dict)):
                return None
            return name, _dump_arguments(arguments)
        except ValueError:  # bad JSON, or a NaN / infinity JSON text cannot carry
            return None


_PARTIAL_OPENING = re.compile(r" {0,3}(?:`+|~+)[ \t]*(\w*)")


def _cut_call_opening(line: str) -> bool:
    """An unfinished last line that could still have become a tool_call block's opening fence."""
    partial = _PARTIAL_OPENING.fullmatch(line)
    return partial is not None and TOOL_CALL_FENCE.startswith(partial.group(1))


# --- factory ----------------------------------------------------------------------------------


def make_parser(family: str, *, id_factory: Callable[[], str] = random_call_id,
                max_calls: int | None = None) -> OutputParser:
    """The output parser for a model family: "gemma4" (native syntax) or "gemma3" (fenced
    JSON blocks). `max_calls`: the calls kept of one answer; the model's further calls are
    dropped (their text too)."""
    if family == "gemma4":
        return Gemma4OutputParser(id_factory=id_factory, max_calls=max_calls)
    if family == "gemma3":
        return FencedToolCallParser(id_factory=id_factory, max_calls=max_calls)
    raise ChatError(f"no output parser for model family {family!r}")
