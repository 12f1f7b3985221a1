"""Errors in each API's own shape: OpenAI's `{"error": {...}}` and Anthropic's `{"type": "error", ...}`,
whatever raised them (our checks, the chat layer, Litestar's body parsing and limits)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from ..chat.types import ChatError
from ..engine import ContextOverflowError
from .openai_schema import SAMPLING_RANGES

log = logging.getLogger(__name__)

# OpenAI-style error types by status; Anthropic's come from `_ANTHROPIC_TYPES`.
_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
    500: "server_error", 503: "unavailable_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error",
}


class APIError(Exception):
    """An error a client caused (or must wait out); rendered in the shape of the API it called."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.extra = extra or {}
        self.headers = headers or {}


def context_overflow(n_prompt_tokens: int, n_ctx: int) -> APIError:
    """Anthropic's wording, which Claude Code parses ("prompt is too long: N tokens > M") to compact the
    conversation by the excess; llama.cpp's fields and OpenAI's code, which Codex CLI and others read."""
    return APIError(
        400, f"prompt is too long: {n_prompt_tokens + 1} tokens > {n_ctx} maximum (the prompt and one token of "
        "answer): shorten the prompt or start the server with a larger --ctx-size",
        code="context_length_exceeded", extra={"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx},
    )


def as_api_error(exc: Exception) -> APIError:
    """Anything a request handler may raise, as the error the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ChatError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, ContextOverflowError):
        return context_overflow(exc.needed - 1, exc.n_ctx)  # needed counts one token of answer
    if isinstance(exc, UnicodeDecodeError):  # Litestar decodes the body before any check of ours
        return APIError(400, f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}")
    if isinstance(exc, RecursionError):  # msgspec's depth limit, from the body or a structure inside it
        return APIError(400, "the request body's JSON is nested too deeply")
    if isinstance(exc, ValidationException):
        return _validation_error(exc)
    if isinstance(exc, HTTPException):
        message = exc.detail
        if exc.status_code == 413:
            message = "the request body is larger than the server accepts (see serve --max-body-mb)"
        elif exc.status_code == 404:
            message = f"no such endpoint: {message}" if message != "Not Found" else "no such endpoint"
        return APIError(exc.status_code, message, headers=dict(exc.headers or {}))
    log.exception("unhandled error in a request")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def _validation_error(exc: ValidationException) -> APIError:
    problems = exc.extra if isinstance(exc.extra, list) else []
    if not problems:
        return APIError(400, str(exc.detail))
    first = problems[0]
    key = first.get("key") if isinstance(first, dict) else None
    message = first.get("message", exc.detail) if isinstance(first, dict) else str(first)
    if key in (None, "data"):
        return APIError(400, f"invalid request body: {message}")
    if key in SAMPLING_RANGES:
        return APIError(400, f"{key} must be {SAMPLING_RANGES[key]}", param=key)
    message = str(message).split(" - at `$", 1)[0]  # msgspec's path: the field is named already
    return APIError(400, f"invalid value for {key}: {message}", param=key)


def openai_payload(err: APIError) -> dict[str, Any]:
    return {"error": {
        "message": err.message, "type": _OPENAI_TYPES.get(err.status, "invalid_request_error"),
        "param": err.param, "code": err.code or err.status, **err.extra,
    }}


def anthropic_payload(err: APIError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message, **err.extra}}


def openai_error(request: Request, exc: Exception) -> Response:
    err = as_api_error(exc)
    return Response(openai_payload(err), status_code=err.status, headers=err.headers)


def anthropic_error(request: Request, exc: Exception) -> Response:
    err = as_api_error(exc)
    return Response(anthropic_payload(err), status_code=err.status, headers=err.headers)


def handlers(render: Callable[[Request, Exception], Response]) -> dict[type[Exception], Callable]:
    """Exception handlers for a router whose clients expect `render`'s shape."""
    return {Exception: render}
