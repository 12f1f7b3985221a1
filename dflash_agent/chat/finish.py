"""How a generation ended, in one vocabulary: each HTTP dialect names these values its own way (a table each), and
which reason wins when several hold is decided here, once."""

from __future__ import annotations

import enum

from ..engine import FinalEvent


class Finish(enum.Enum):
    STOP = "stop"  # the model ended its turn
    STOP_SEQUENCE = "stop_sequence"  # one of the request's stop strings
    LENGTH = "length"  # the request's max_tokens ran out
    CONTEXT_FULL = "context_full"  # the context filled up before max_tokens ran out
    TOOL_CALLS = "tool_calls"  # the turn ended with calls to run
    CANCELLED = "cancelled"  # the engine dropped the request

    @classmethod
    def of(cls, final: FinalEvent, tool_calls: bool, stop: tuple[str, ...] = ()) -> Finish:
        """`tool_calls`: the answer holds a call; `stop`: the request's stop strings."""
        if final.finish_reason == "length":  # first: a tool call cut by the limit is not one to run
            return cls.CONTEXT_FULL if final.context_full else cls.LENGTH
        if tool_calls:
            return cls.TOOL_CALLS
        if isinstance(final.stop, str) and final.stop in stop:
            return cls.STOP_SEQUENCE
        if final.finish_reason == "cancelled":
            return cls.CANCELLED
        return cls.STOP
