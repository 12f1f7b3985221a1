"""A prompt refused by its length in characters before it is tokenized or rendered: no token spells more than the
tokenizer's longest piece (`Tokenizer.longest_piece`), so a text of n characters has at least n / that many tokens,
and one that cannot fit the context is refused at once instead of after seconds of tokenizing, during which a
server's event loop would answer no one."""

from __future__ import annotations

from typing import Any

import msgspec

from ..engine import ContextOverflowError, Tokenizer
from .types import Conversation


class PromptTooLong(ContextOverflowError):
    def __init__(self, n_chars: int, longest_piece: int, n_ctx: int) -> None:
        at_least = -(-n_chars // longest_piece)
        super().__init__(at_least, n_ctx)
        self.args = (f"prompt is too long: at least {at_least} tokens > {n_ctx} maximum (its {n_chars} characters, "
                     f"at most {longest_piece} per token): shorten it or start the server with a larger --ctx-size",)
        self.n_chars, self.max_chars = n_chars, n_ctx * longest_piece


def max_prompt_chars(tokenizer: Tokenizer, n_ctx: int) -> int:
    """The most characters a prompt that fits `n_ctx` tokens can have."""
    return n_ctx * tokenizer.longest_piece


def check_prompt_chars(n_chars: int, tokenizer: Tokenizer, n_ctx: int) -> None:
    """Raise PromptTooLong where `n_chars` characters cannot fit `n_ctx` tokens, whatever they spell."""
    if n_chars > max_prompt_chars(tokenizer, n_ctx):
        raise PromptTooLong(n_chars, tokenizer.longest_piece, n_ctx)


def conversation_chars(conversation: Conversation) -> int:
    """The characters of a conversation that reach the template and the tokenizer: the messages' text, reasoning
    and tool calls, and the tools' names, descriptions and schemas (as compact JSON, which no template renders
    shorter). A 10 MB tool description once passed a count of the messages alone and took 8-24 s to refuse."""
    total = 0
    for message in conversation.messages:
        total += len(message.text) + len(message.reasoning or "")
        total += sum(len(call.name) + json_chars(call.arguments) for call in message.tool_calls)
    for tool in conversation.tools:
        total += len(tool.name) + len(tool.description) + json_chars(tool.parameters)
    return total


def json_chars(value: Any) -> int:
    return 0 if value is None else len(msgspec.json.encode(value).decode())
