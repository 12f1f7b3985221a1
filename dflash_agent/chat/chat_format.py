"""One model's chat format: render a request into prompt ids, build the grammar it asks for, and
parse what the model writes back. The HTTP API, the agent and the MCP server all go through here."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..engine import (
    Engine,
    FinalEvent,
    GenerateRequest,
    GrammarCompiler,
    SamplingParams,
    StopCriteria,
    TokenGrammar,
    Tokenizer,
)
from .constraints import MAX_PARALLEL_CALLS, response_format_grammar, tool_call_grammar
from .gemma4_syntax import TOOL_RESPONSE_OPEN, TURN_CLOSE
from .parser import Delta, OutputParser, make_parser
from .template import ChatTemplate, render_and_encode, select_template
from .types import ChatError, Conversation

# Tokens that end an assistant turn, by family; their ids come from the tokenizer.
_TURN_END_PIECES = {"gemma4": (TURN_CLOSE, TOOL_RESPONSE_OPEN), "gemma3": ("<end_of_turn>",)}


@dataclass(frozen=True)
class ChatOptions:
    tool_choice: Any = "auto"  # "auto" | "none" | "required" | a named function (OpenAI or Anthropic form)
    parallel_tool_calls: bool = True
    response_format: Any = None  # OpenAI's response_format
    enable_thinking: bool = False
    add_generation_prompt: bool = True


@dataclass
class PreparedChat:
    prompt: str
    prompt_ids: list[int]
    grammar: TokenGrammar | None
    stop_ids: frozenset[int]
    family: str
    max_calls: int = MAX_PARALLEL_CALLS  # 1 when the request turned parallel tool calls off

    def parser(self) -> OutputParser:
        """A fresh streaming parser for this request's output."""
        return make_parser(self.family, max_calls=self.max_calls)


class ChatFormat:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, family: str, vocab_size: int) -> None:
        if family not in _TURN_END_PIECES:
            raise ChatError(f"no chat format for model family {family!r}")
        self.tokenizer = tokenizer
        self.template = template
        self.family = family
        self.vocab_size = vocab_size
        ends = (tokenizer.token_id(piece) for piece in _TURN_END_PIECES[family])
        self.stop_ids = tokenizer.stop_ids | frozenset(i for i in ends if i is not None)

    @classmethod
    def for_engine(cls, engine: Engine, template: str | None = None) -> ChatFormat:
        """The loaded model's format, with the checkpoint's own template unless `template`
        (gemma4, gemma3 or a file) overrides it."""
        family = engine.model.config.family
        return cls(engine.tokenizer, select_template(template, engine.model_path, family), family,
                   engine.model.config.vocab_size)

    @cached_property
    def grammars(self) -> GrammarCompiler:
        # Built on first use: reading a 262k vocabulary into xgrammar takes a moment.
        return GrammarCompiler(self.tokenizer, self.vocab_size, extra_stop_ids=self.stop_ids)

    def prepare(self, conversation: Conversation, options: ChatOptions = ChatOptions()) -> PreparedChat:
        """Raises ChatError (a 400 for the API) for a request that cannot be rendered or forced."""
        if options.tool_choice == "none":
            # The model cannot call what it is not shown, so "none" holds without a grammar.
            conversation = Conversation(messages=conversation.messages, tools=[])
        grammar = tool_call_grammar(
            self.grammars, self.family, conversation.tools, options.tool_choice, options.parallel_tool_calls
        )
        if grammar is None and options.response_format is not None:
            grammar = response_format_grammar(self.grammars, options.response_format)
        text, ids = render_and_encode(
            self.template, self.tokenizer, conversation,
            add_generation_prompt=options.add_generation_prompt, enable_thinking=options.enable_thinking,
        )
        max_calls = MAX_PARALLEL_CALLS if options.parallel_tool_calls else 1
        return PreparedChat(text, ids, grammar, self.stop_ids, self.family, max_calls)


async def stream_chat(
    engine: Engine,
    prepared: PreparedChat,
    parser: OutputParser,
    sampling: SamplingParams | None = None,
    max_tokens: int | None = None,
    stop: tuple[str, ...] = (),
    request_id: str = "",
    cache_prompt: bool = True,
    on_prefix: Callable[[int], None] | None = None,
) -> AsyncIterator[Delta | FinalEvent]:
    """Generate a prepared chat request: parsed deltas as they stream, then the engine's FinalEvent.
    `parser.result()` holds the whole answer afterwards. `on_prefix`: see GenerateRequest."""
    request = GenerateRequest(
        prepared.prompt_ids, sampling or SamplingParams(), StopCriteria(prepared.stop_ids, stop), max_tokens,
        prepared.grammar, request_id, cache_prompt, on_prefix,
    )
    async with engine.stream(request) as events:  # closing this generator cancels the request at once
        async for event in events:
            if isinstance(event, FinalEvent):
                for delta in parser.finish():
                    yield delta
                yield event
                return
            for delta in parser.feed(event.text_delta):
                yield delta


@dataclass(frozen=True)
class LoadedModel:
    """A loaded engine with its chat format and the name clients see: what every surface serves."""

    engine: Engine
    chat: ChatFormat
    name: str

    @classmethod
    def of(cls, engine: Engine, template: str | None = None, name: str | None = None) -> LoadedModel:
        return cls(engine, ChatFormat.for_engine(engine, template), name or engine.model_name)
