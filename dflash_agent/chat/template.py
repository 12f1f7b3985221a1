"""Render a canonical Conversation with a Jinja chat template, the way Hugging Face's
`apply_chat_template` does, so that a checkpoint's own template renders here exactly as it does there.

Templates are untrusted code (they ship inside downloaded checkpoints): they run in Jinja's immutable
sandbox and only ever see plain dicts, lists and strings."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..engine import GGUFError, Tokenizer
from ..engine.formats.config import Family
from ..engine.formats.gguf import GGUFFile, read_gguf
from .gemma3_tools import inline_tools
from .types import ChatError, Conversation, ImagePart, Message, Tool

log = logging.getLogger(__name__)

BUILTIN_TEMPLATES: tuple[Family, ...] = ("gemma4", "gemma3")


def _raise_exception(message: str) -> None:
    # Templates call this for conversations they cannot render (roles out of order): the client's mistake.
    raise ChatError(str(message), "messages")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF replaces Jinja's own filter, which HTML-escapes and sorts keys; templates rely on neither.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def make_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment HF renders chat templates in (less its assistant-mask `generation` tag)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(frozen=True)
class RenderOptions:
    add_generation_prompt: bool = True
    enable_thinking: bool = False
    bos_token: str = "<bos>"
    eos_token: str = "<eos>"


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template. `family` is the model family it renders for: Gemma 3 has no tool syntax,
    so its conversations are rewritten with `gemma3_tools.inline_tools` first."""

    text: str
    source: str  # where it came from, for logs and error messages
    family: Family | None = None
    compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = make_environment().from_string(self.text)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatError(f"chat template {self.source}: syntax error on line {exc.lineno}: {exc.message}") from None
        object.__setattr__(self, "compiled", compiled)

    def render(self, conversation: Conversation, options: RenderOptions = RenderOptions()) -> str:
        return self._render(conversation, options, lambda value: value)

    def render_marked(self, conversation: Conversation, options: RenderOptions,
                      find_specials: Callable[[str], list[tuple[int, int]]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of it where the request's own strings (contents,
        arguments, tool schemas, ...) spell special tokens (`find_specials` finds them in a string).
        Each such spelling is wrapped in a random marker before rendering and located by it afterwards,
        so the spans are right whatever the template does around it (trim, tojson, joins)."""
        marker = f"[[dflash-literal-{secrets.token_hex(12)}]]"

        def mark(value: str) -> str:
            pos, out = 0, []
            for start, end in find_specials(value):
                out += [value[pos:start], marker, value[start:end], marker]
                pos = end
            return "".join(out) + value[pos:] if out else value

        parts = self._render(conversation, options, mark).split(marker)
        # Odd parts lie between a pair of markers. A template that lost a closing marker leaves the
        # rest as literal too: it may only ever read too much as text, never too little.
        text, spans = "", []
        for i, part in enumerate(parts):
            if i % 2:
                spans.append((len(text), len(text) + len(part)))
            text += part
        return text, spans

    def _render(self, conversation: Conversation, options: RenderOptions, mark: Callable[[str], str]) -> str:
        if self.family == "gemma3":
            conversation = inline_tools(conversation)
        variables = {
            "messages": _map_strings(template_messages(conversation.messages), mark),
            "tools": _map_strings(template_tools(conversation.tools), mark) or None,
            "add_generation_prompt": options.add_generation_prompt,
            "enable_thinking": options.enable_thinking,
            "bos_token": options.bos_token,
            "eos_token": options.eos_token,
        }
        try:
            return self.compiled.render(**variables)
        except ChatError:
            raise
        except (jinja2.TemplateError, TypeError) as exc:
            raise ChatError(f"chat template {self.source} failed: {type(exc).__name__}: {exc}") from None


def _map_strings(value: Any, mark: Callable[[str], str]) -> Any:
    """`value` with `mark` applied to every string in it, dict keys included."""
    if isinstance(value, str):
        return mark(value)
    if isinstance(value, dict):
        return {_map_strings(k, mark): _map_strings(v, mark) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, mark) for v in value]
    return value


def render_and_encode(template: ChatTemplate, tokenizer: Tokenizer, conversation: Conversation,
                      add_generation_prompt: bool = True, enable_thinking: bool = False) -> tuple[str, list[int]]:
    """The prompt text and its token ids, with the tokenizer's own BOS/EOS spellings. Templates write BOS
    themselves; `encode` parses it as the special token and does not add a second one. Special tokens
    spelled inside the request's strings are tokenized as text: only the template makes control tokens,
    so a message cannot close its turn and forge another."""
    options = RenderOptions(
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
        bos_token=_piece(tokenizer, tokenizer.bos_id, "<bos>"),
        eos_token=_piece(tokenizer, tokenizer.eos_id, "<eos>"),
    )
    text, literal = template.render_marked(conversation, options, tokenizer.find_special_pieces)
    return text, tokenizer.encode(text, add_bos=True, plain_spans=literal)


def _piece(tokenizer: Tokenizer, token_id: int | None, default: str) -> str:
    return default if token_id is None else tokenizer.id_to_piece(token_id)


# --- canonical -> the dicts templates read ------------------------------------------------------------------


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI-style message dicts, as HF passes them to templates: tool-call arguments as mappings,
    reasoning under `reasoning_content` (the name HF aliases everything to) and `reasoning`."""
    return [_message_dict(m, i) for i, m in enumerate(messages)]


def _message_dict(message: Message, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": _content(message, index)}
    if message.reasoning is not None:
        out["reasoning_content"] = out["reasoning"] = message.reasoning
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _content(message: Message, index: int) -> str | list[dict[str, str]]:
    # One text part is sent as a plain string, the shape most templates were written for; several stay
    # a list of parts, since templates differ in how they join them.
    for j, part in enumerate(message.content):
        if isinstance(part, ImagePart):
            raise ChatError("images are not supported; this model reads text only", f"messages[{index}].content[{j}]")
    if len(message.content) <= 1:
        return message.text
    return [{"type": "text", "text": part.text} for part in message.content]


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tools
    ]


# --- where a template comes from ----------------------------------------------------------------------------


def builtin_template(name: Family) -> ChatTemplate:
    """Our own template for a model family, shipped in `dflash_agent/templates/`."""
    text = resources.files("dflash_agent.templates").joinpath(f"{name}.jinja").read_text(encoding="utf-8")
    return ChatTemplate(text, source=f"built-in {name}.jinja", family=name)


def checkpoint_template(path: Path, gguf: GGUFFile | None = None) -> str | None:
    """The chat template a checkpoint ships, if any: an HF directory's `chat_template.jinja` or its
    `tokenizer_config.json` `chat_template`; a GGUF's `tokenizer.chat_template`."""
    if path.is_dir():
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        return _tokenizer_config_template(path / "tokenizer_config.json")
    if gguf is None:
        try:
            gguf = read_gguf(path)
        except GGUFError as exc:
            raise ChatError(str(exc)) from None
    value = gguf.fields.get("tokenizer.chat_template")
    return value if isinstance(value, str) else None


def _tokenizer_config_template(config_file: Path) -> str | None:
    if not config_file.is_file():
        return None
    try:
        value = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ChatError(f"{config_file} is not a JSON object ({exc})") from None
    if value is None or isinstance(value, str):
        return value
    # A list of named templates ({"name", "template"}); "default" is the one HF renders without a name.
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ChatError(f"{config_file}: chat_template has no 'default' template")


def select_template(override: str | None = None, model_path: Path | None = None, family: Family | None = None,
                    gguf: GGUFFile | None = None) -> ChatTemplate:
    """The template to render with: `override` (a built-in name or a file), else the checkpoint's own,
    else ours for the model's family."""
    if override in BUILTIN_TEMPLATES:
        return builtin_template(override)
    if override is not None:
        path = Path(override).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ChatError(f"template {override!r} is neither {' nor '.join(BUILTIN_TEMPLATES)} nor a readable "
                            f"file ({exc.strerror})") from None
        return ChatTemplate(text, source=str(path), family=family)
    if model_path is not None:
        text = checkpoint_template(model_path, gguf)
        if text is not None:
            log.debug("using the chat template shipped in %s", model_path)
            return ChatTemplate(text, source=f"{model_path} (its own)", family=family)
    if family is None:
        raise ChatError("no chat template: the model ships none and its family is unknown; pass a template")
    return builtin_template(family)
