"""The one base of every error a user causes and can fix: a bad option, a file that is not a model, a request
the engine cannot serve. The CLI prints these (and `OSError`, a user's path) as one line; anything else is a
bug and keeps its traceback. Imports nothing, so every layer (tools and kernels too) can raise it.

A `ValueError`, so callers that catch bad values (the HTTP and MCP boundaries) keep catching them."""

from __future__ import annotations


class UserError(ValueError):
    """Something the user asked for or pointed at that cannot work; the message says what would."""
