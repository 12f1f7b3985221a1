"""`dflash-agent prompt`: render (and tokenize) the prompt a request would give the model. Only the
tokenizer and the chat template are read; the weights are never loaded."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engine import GGUFError, ModelLoadError, Tokenizer
from ..engine.formats.config import ModelConfig
from ..engine.formats.gguf import read_gguf
from ..engine.load.weights import resolve_model_path
from .openai_messages import messages_from_openai, tools_from_openai
from .template import ChatTemplate, render_and_encode, select_template
from .types import ChatError, Conversation


def load_tokenizer_and_template(model: str, template: str | None = None) -> tuple[Tokenizer, ChatTemplate]:
    """A model's tokenizer and chat template (`template` overrides: a built-in name or a file)."""
    path = resolve_model_path(model)
    # The template first: it is cheap, and a bad --template should not wait for the tokenizer.
    if path.is_dir():
        chat_template = select_template(template, path, ModelConfig.from_hf_dir(path).family)
        return Tokenizer.from_dir(path), chat_template
    try:
        gguf = read_gguf(path)  # memory-maps the file and parses its header only
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from None
    family = ModelConfig.from_gguf_fields(gguf.fields, set(gguf.tensors), source=str(path)).family
    chat_template = select_template(template, path, family, gguf)
    return Tokenizer.from_gguf(path, gguf=gguf), chat_template


def read_request(messages_file: Path, tools_file: Path | None = None) -> Conversation:
    """Messages (and tools) as an OpenAI client sends them: a JSON list, or an object with
    "messages" (and "tools"), such as a saved chat-completions request body."""
    data = _read_json(messages_file)
    tools, tools_source = None, messages_file
    if isinstance(data, dict):
        if "messages" not in data:
            raise ChatError(f"{messages_file}: the object has no 'messages'", "messages")
        data, tools = data["messages"], data.get("tools")
    if tools_file is not None:
        if tools is not None:
            raise ChatError(f"tools are given twice: in {messages_file} and in {tools_file}", "tools")
        tools, tools_source = _read_json(tools_file), tools_file
        if isinstance(tools, dict):
            tools = tools.get("tools")
    return Conversation(messages=_in_file(messages_from_openai, data, messages_file),
                        tools=_in_file(tools_from_openai, tools, tools_source))


def _in_file(convert: Callable[[Any], Any], data: Any, path: Path) -> Any:
    try:
        return convert(data)
    except ChatError as exc:
        raise ChatError(f"{path}: {exc}", exc.param) from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ChatError(f"cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ChatError(f"{path} is not valid JSON ({exc})") from None


def prompt_command(messages_file: Path, tools_file: Path | None, template: str | None, model: str,
                   enable_thinking: bool, add_generation_prompt: bool, as_json: bool) -> str:
    """What the command prints: the prompt text, or {"prompt", "token_ids"} as JSON."""
    conversation = read_request(messages_file, tools_file)
    tokenizer, chat_template = load_tokenizer_and_template(model, template)
    text, ids = render_and_encode(chat_template, tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                                  enable_thinking=enable_thinking)
    return json.dumps({"prompt": text, "token_ids": ids}, ensure_ascii=False) if as_json else text
