"""Typed reads from decoded client JSON. Every failure is a ChatError naming the field the way the
client spelled it (`messages[2].tool_calls[0].id`), so a 400 tells the client exactly what to fix."""

from __future__ import annotations

from typing import Any

from .types import ChatError, TextPart


def type_name(value: Any) -> str:
    """JSON's name for a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def expect_object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ChatError(f"{param} must be an object, not {type_name(value)}", param)
    return value


def expect_list(value: Any, param: str, *, non_empty: bool = False) -> list[Any]:
    if not isinstance(value, list):
        raise ChatError(f"{param} must be an array, not {type_name(value)}", param)
    if non_empty and not value:
        raise ChatError(f"{param} must not be empty", param)
    return value


def get_str(obj: dict[str, Any], key: str, param: str) -> str:
    value = opt_str(obj, key, param)
    if value is None:
        raise ChatError(f"{param}.{key} is required", f"{param}.{key}")
    return value


def opt_str(obj: dict[str, Any], key: str, param: str) -> str | None:
    """`obj[key]` as a string, or None when it is absent or null."""
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ChatError(f"{param}.{key} must be a string, not {type_name(value)}", f"{param}.{key}")
    return value


def get_object(obj: dict[str, Any], key: str, param: str) -> dict[str, Any]:
    if key not in obj:
        raise ChatError(f"{param}.{key} is required", f"{param}.{key}")
    return expect_object(obj[key], f"{param}.{key}")


def block_type(block: Any, param: str) -> str:
    """The `type` of a content part / block, which both APIs require."""
    block = expect_object(block, param)
    return get_str(block, "type", param)


def unsupported_media(kind: str, param: str) -> ChatError:
    if kind in ("image", "image_url"):
        return ChatError(f"{param}: images are not supported; this model reads text only", param)
    return ChatError(f"{param}: content of type {kind!r} is not supported; send text", param)


def text_parts(value: Any, param: str, *, text_types: tuple[str, ...] = ("text",),
               type_prefix: str = "") -> list[TextPart]:
    """A string, or a list of text parts, as canonical TextParts. Empty texts carry nothing and are
    dropped, so `""` and "no content" convert to the same canonical message. `type_prefix`: what an API puts
    before its part types (the Responses API's `input_`), left out of the error for a part that is not text."""
    if isinstance(value, str):
        return [TextPart(value)] if value else []
    parts = []
    for j, part in enumerate(expect_list(value, param)):
        kind = block_type(part, f"{param}[{j}]")
        if kind not in text_types:
            raise unsupported_media(kind.removeprefix(type_prefix), f"{param}[{j}]")
        parts.extend(text_part(part, kind, f"{param}[{j}]"))
    return parts


def text_part(part: dict[str, Any], kind: str, param: str) -> list[TextPart]:
    """The text of one part whose type is known to be textual: OpenAI's `refusal` parts keep it in
    `refusal`, every other kind (`text`, the Responses API's `input_text` / `output_text`) in `text`. A list
    so that an empty text adds nothing."""
    text = get_str(part, "refusal" if kind == "refusal" else "text", param)
    return [TextPart(text)] if text else []
