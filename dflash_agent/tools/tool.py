"""What a tool is: one declaration (name, description, argument schema, safety flags, function),
and what calling it gives back."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec


class ToolError(Exception):
    """A call that could not do what it asked (no such file, path outside the workspace, ...).
    The message is for the model: it says what went wrong and what to do instead."""


@dataclass(frozen=True)
class ToolResult:
    text: str
    # The call could not be carried out (MCP's isError). A command that ran and failed is not an
    # error: its output and exit code are the result.
    is_error: bool = False


@dataclass(frozen=True)
class ToolSpec:
    """One tool, declared once. `params` is a msgspec Struct: it is both the JSON schema the model
    sees and the validator of the arguments it sends. The flags are MCP's tool annotations."""

    name: str
    description: str
    params: type[msgspec.Struct]
    run: Callable[[Any], Awaitable[str]]  # the validated params -> the text for the model; ToolError on failure
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False
    input_schema: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_schema", struct_schema(self.params))


def struct_schema(params: type[msgspec.Struct]) -> dict[str, Any]:
    """A flat JSON schema of an argument Struct: msgspec's, unwrapped from its `$defs`."""
    schema = msgspec.json.schema(params)
    body = dict(schema["$defs"][schema["$ref"].rsplit("/", 1)[1]])
    body.pop("title", None)
    if len(schema["$defs"]) > 1:
        raise TypeError(f"{params.__name__}: tool arguments must be a flat Struct (no nested Structs)")
    return body


def elision_note(count: int, unit: str) -> str:
    return f"[... {count:,} {unit} elided; narrow the command or read a smaller range to see them ...]"


def elide_middle(text: str, limit: int) -> str:
    """`text` cut to about `limit` characters by dropping its middle: the head shows what started,
    the tail how it ended (errors, summaries), and the note says how much is missing."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n{elision_note(len(text) - limit, 'characters')}\n{text[-tail:]}"
