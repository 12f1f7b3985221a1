"""Gemma 4's tool-call syntax, both ways: the special-token strings, the serializer the chat
template applies to tool-call arguments, and an incremental reader that turns argument text
into JSON as it streams in.

The syntax (gemma4.md 4.2): `<|tool_call>call:NAME{key:value,...}<tool_call|>`. Keys are bare;
strings sit between two `<|"|>` tokens with nothing escaped inside; numbers, `true`/`false`
and nulls are bare; `{...}` and `[...]` nest.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

# The special tokens as they appear in text decoded with special tokens kept. The parsers and
# the serializer use these names only.
CHANNEL_OPEN = "<|channel>"
CHANNEL_CLOSE = "<channel|>"
TOOL_CALL_OPEN = "<|tool_call>"
TOOL_CALL_CLOSE = "<tool_call|>"
STRING_DELIM = '<|"|>'
TURN_CLOSE = "<turn|>"
TOOL_RESPONSE_OPEN = "<|tool_response>"
EOS = "<eos>"

# Tokens that end the model's message: generation stops on them, so anything after one is not
# part of the answer (a hallucinated tool response or next turn).
END_MARKERS = (TURN_CLOSE, TOOL_RESPONSE_OPEN, EOS)
# Tokens that structure a message. Outside a string value each of them also ends a tool call.
FRAME_MARKERS = (CHANNEL_OPEN, CHANNEL_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, *END_MARKERS)
_ARG_MARKERS = (STRING_DELIM, *FRAME_MARKERS)

CALL_PREFIX = "call:"


# --- serializer -------------------------------------------------------------------------------


def format_value(value: Any) -> str:
    """A value as the template's `format_argument(value, escape_keys=False)` renders it.

    Mappings are `dictsort`ed (keys compared lower-cased, ties kept in insertion order);
    numbers are printed the way Jinja prints them, with `str()`: floats use Python's repr
    (`2.0`, `1e-05`, `1e+16`, `inf`). None is `null`, as in Google's July 2026 template and
    dflash_agent/templates/gemma4.jinja; the May 2026 reference template printed Jinja's `None` (the
    parser reads both).
    """
    if isinstance(value, str):
        return STRING_DELIM + value + STRING_DELIM
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda item: item[0].lower())
        return "{" + ",".join(f"{key}:{format_value(item)}" for key, item in items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(item) for item in value) + "]"
    return str(value)


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One assistant tool call exactly as Google's Gemma 4 chat template renders it in history.

    What survives a trip through `Gemma4OutputParser`: everything JSON can hold, except strings
    (values or keys) that contain `<|"|>` (the delimiter has no escape), keys that contain `:`,
    a special token, one of `{}[],`, or surrounding whitespace, and non-finite floats.
    """
    return TOOL_CALL_OPEN + CALL_PREFIX + name + format_value(arguments) + TOOL_CALL_CLOSE


# --- marker scanning --------------------------------------------------------------------------


def match_marker(buf: str, i: int, markers: Iterable[str]) -> str | None:
    """The marker that starts at buf[i]; "" when buf ends inside what may still become one
    (the caller waits for more text); None when no marker starts there."""
    partial = False
    for marker in markers:
        if buf.startswith(marker, i):
            return marker
        partial = partial or (len(buf) - i < len(marker) and marker.startswith(buf[i:]))
    return "" if partial else None


def find_marker(buf: str, markers: Iterable[str], start: int = 0) -> tuple[int, str | None]:
    """The first marker in buf[start:], as (position, marker). A marker cut off by the end of
    buf gives (position, None); no marker at all gives (len(buf), None)."""
    markers = tuple(markers)
    i = buf.find("<", start)  # every marker starts with "<"
    while i >= 0:
        found = match_marker(buf, i, markers)
        if found is not None:
            return i, found or None
        i = buf.find("<", i + 1)
    return len(buf), None


# --- incremental argument reader --------------------------------------------------------------

_WHITESPACE = re.compile(r"\s*")
# Runs of ordinary characters; "<" stops them so a possible marker is looked at on its own.
_BARE_KEY_RUN = re.compile(r"[^:{}\[\],<]*")
_BARE_VALUE_RUN = re.compile(r"[^,}\]<]*")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
# `None` is what the May 2026 template printed for a null (and True/False what Python would).
_BARE_WORDS: dict[str, Any] = {
    "true": True, "false": False, "null": None, "None": None, "True": True, "False": False,
}


def bare_value(token: str) -> Any:
    """The value of an unquoted token. Empty means null (a newer template prints None as
    nothing); a word that is neither a keyword nor a JSON number is kept as a string, since
    the model sometimes leaves a string unquoted."""
    token = token.strip()
    if not token:
        return None
    if token in _BARE_WORDS:
        return _BARE_WORDS[token]
    if _JSON_NUMBER.fullmatch(token):
        try:
            if any(c in token for c in ".eE"):
                number = float(token)
                return number if math.isfinite(number) else token
            return int(token)
        except ValueError:  # an int past Python's digit limit
            return token
    return token


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class ReadOutcome(enum.Enum):
    NEED_MORE = "need_more"  # everything consumed but a possible marker prefix at the end
    CLOSED = "closed"  # the argument object's closing brace was consumed
    MARKER = "marker"  # stopped in front of a special token that ends the call
    INVALID = "invalid"  # stopped in front of text that does not fit the syntax


class _State(enum.Enum):
    KEY_START = enum.auto()  # after "{" or "," in an object
    BARE_KEY = enum.auto()
    QUOTED_KEY = enum.auto()  # tolerated: <|"|>key<|"|>:
    COLON = enum.auto()  # after a quoted key
    VALUE_START = enum.auto()  # after ":", or "[" / "," in an array
    STRING = enum.auto()
    BARE_VALUE = enum.auto()
    VALUE_END = enum.auto()  # after a value: ",", "}" or "]"
    DONE = enum.auto()


class _Container:
    __slots__ = ("closer", "count", "keys")

    def __init__(self, opener: str) -> None:
        self.closer = "}" if opener == "{" else "]"
        self.count = 0  # members written so far, to know when a comma is due
        self.keys: set[str] = set()  # an object's keys so far


class ArgumentReader:
    """Reads one call's argument object (after its opening brace) as it streams in and writes
    the same value as compact JSON: `json.dumps(value, ensure_ascii=False,
    separators=(",", ":"))`, piece by piece.

    A key is written only together with the start of its value, and a bare value only once it
    is complete, so `close()` can always finish the JSON text, whatever point the stream
    stopped at. Keys keep their order. A repeated key is invalid: JSON readers would keep
    only its last value, and the JSON already written could not say so.
    """

    def __init__(self) -> None:
        self._stack = [_Container("{")]
        self._state = _State.KEY_START
        self._token: list[str] = []  # the bare key, quoted key or bare value being read
        self._key = ""

    def read(self, buf: str, final: bool) -> tuple[int, str, ReadOutcome]:
        """Consume a prefix of buf; return (characters consumed, JSON written, outcome). With
        final, nothing is held back as a possible marker prefix."""
        out: list[str] = []
        i, n = 0, len(buf)
        while i < n:
            state = self._state
            if state in (_State.STRING, _State.QUOTED_KEY):
                i = self._read_delimited(buf, i, final, out)
                if self._state is state:  # no closing delimiter yet
                    return i, "".join(out), ReadOutcome.NEED_MORE
                continue
            c = buf[i]
            if c == "<":
                marker = match_marker(buf, i, _ARG_MARKERS)
                if marker == "" and not final:
                    return i, "".join(out), ReadOutcome.NEED_MORE
                if marker == STRING_DELIM and state is _State.KEY_START:
                    self._state = _State.QUOTED_KEY
                    i += len(STRING_DELIM)
                    continue
                if marker == STRING_DELIM and state is _State.VALUE_START:
                    out.append(self._open_value('"'))
                    self._state = _State.STRING
                    i += len(STRING_DELIM)
                    continue
                if marker == STRING_DELIM:
                    return i, "".join(out), ReadOutcome.INVALID
                if marker:
                    return i, "".join(out), ReadOutcome.MARKER
            if state in (_State.KEY_START, _State.COLON, _State.VALUE_START, _State.VALUE_END):
                skip = _WHITESPACE.match(buf, i).end()
                if skip > i:
                    i = skip
                    continue
            step = self._step(buf, i, c, out)
            if step is None:
                return i, "".join(out), ReadOutcome.INVALID
            i = step
            if self._state is _State.DONE:
                return i, "".join(out), ReadOutcome.CLOSED
        return i, "".join(out), ReadOutcome.NEED_MORE

    def close(self) -> str:
        """The JSON that completes what was written: a string or bare value in progress is
        kept, a key without a value is dropped, open containers are closed."""
        out: list[str] = []
        if self._state is _State.STRING:
            out.append('"')
        elif self._state is _State.BARE_VALUE:
            out.append(self._open_value(_json(bare_value("".join(self._token)))))
        out.extend(container.closer for container in reversed(self._stack))
        self._stack.clear()
        self._state = _State.DONE
        return "".join(out)

    def _read_delimited(self, buf: str, i: int, final: bool, out: list[str]) -> int:
        """Read string or quoted-key text up to the closing <|"|>; return the new position."""
        end, marker = find_marker(buf, (STRING_DELIM,), i)
        if marker is None and final:
            end = len(buf)
        piece = buf[i:end]
        if self._state is _State.STRING:
            # json escapes character by character, so escaped pieces concatenate correctly.
            out.append(_json(piece)[1:-1])
        else:
            self._token.append(piece)
        if marker is None:
            return end
        if self._state is _State.STRING:
            out.append('"')
            self._state = _State.VALUE_END
        else:
            self._key = "".join(self._token)
            self._token.clear()
            self._state = _State.COLON
        return end + len(STRING_DELIM)

    def _step(self, buf: str, i: int, c: str, out: list[str]) -> int | None:
        """Handle the character c = buf[i] (not whitespace where whitespace is skipped, not a
        marker); return the new position, or None if c does not fit."""
        state = self._state
        top = self._stack[-1]
        if state is _State.KEY_START:
            if c == "}":
                return self._close_container(i, out)
            if c in "{[],":
                return None
            self._state = _State.BARE_KEY
            return i
        if state is _State.BARE_KEY:
            if c == ":":
                self._key = "".join(self._token).strip()
                self._token.clear()
                return self._key_done(i)
            if c in "{}[],":
                return None
            end = _BARE_KEY_RUN.match(buf, i + 1).end()
            self._token.append(buf[i:end])
            return end
        if state is _State.COLON:
            return self._key_done(i) if c == ":" else None
        if state is _State.VALUE_START:
            if c in "{[":
                out.append(self._open_value(c))
                self._stack.append(_Container(c))
                self._state = _State.KEY_START if c == "{" else _State.VALUE_START
                return i + 1
            if c == "]" and top.closer == "]":  # empty array, or a trailing comma
                return self._close_container(i, out)
            if c in ",}]":  # nothing between ":" and the delimiter: null
                out.append(self._open_value("null"))
                self._state = _State.VALUE_END
                return i
            self._state = _State.BARE_VALUE
            return i
        if state is _State.BARE_VALUE:
            if c in ",}]":
                out.append(self._open_value(_json(bare_value("".join(self._token)))))
                self._token.clear()
                self._state = _State.VALUE_END
                return i
            end = _BARE_VALUE_RUN.match(buf, i + 1).end()
            self._token.append(buf[i:end])
            return end
        # VALUE_END
        if c == ",":
            self._state = _State.KEY_START if top.closer == "}" else _State.VALUE_START
            return i + 1
        if c == top.closer:
            return self._close_container(i, out)
        return None

    def _key_done(self, i: int) -> int | None:
        """At the colon after a key: on to its value, unless the key is a repeat."""
        keys = self._stack[-1].keys
        if self._key in keys:
            return None
        keys.add(self._key)
        self._state = _State.VALUE_START
        return i + 1

    def _open_value(self, fragment: str) -> str:
        """The JSON that starts a value in the current container: comma, key, then fragment."""
        top = self._stack[-1]
        prefix = "," if top.count else ""
        if top.closer == "}":
            prefix += _json(self._key) + ":"
        top.count += 1
        return prefix + fragment

    def _close_container(self, i: int, out: list[str]) -> int:
        out.append(self._stack.pop().closer)
        self._state = _State.VALUE_END if self._stack else _State.DONE
        return i + 1
