"""What to force, per chat format: grammars for `tool_choice` and `response_format`.

`tool_call_grammar` forces a tool call in the model family's own syntax:

* gemma4: `<|tool_call>call:NAME{ARGS}<tool_call|>` with ARGS in Gemma 4's argument syntax
  (bare keys, strings between two `<|"|>` tokens, nothing escaped), one call or, with
  `parallel`, one to MAX_PARALLEL_CALLS concatenated;
* gemma3 (no native tools): the fenced JSON block our Gemma 3 prompt asks for
  (`chat/gemma3_tools.py`), ```` ```tool_call\\n{"name": "NAME", "arguments": {...}}\\n``` ````,
  with `parallel` one to MAX_PARALLEL_CALLS separated by a blank line.

Both are generated here from the tool's JSON schema, as EBNF (xgrammar's JSON-schema
converter only writes JSON). Supported: `type` (one or a list; `nullable`), `enum`, `const`,
`properties` / `required`, `additionalProperties` (as the value schema of an object without
`properties`), `items` with `minItems` / `maxItems`, `anyOf` / `oneOf` (as anyOf), `allOf`
(merged), local `$ref`, and `minimum` / `maximum` / `exclusiveMinimum` / `exclusiveMaximum`
(integers exactly; a number with a fraction only where a whole unit fits inside the bounds, and
no exponent). Where a schema says more than that,
the grammar is looser and a call still has the right shape:

* strings ignore `pattern`, `format`, `minLength`, `maxLength`; numbers ignore `multipleOf`;
* an object with `properties` takes exactly those (OpenAI's strict mode) in one fixed order,
  each optional one present or not: Gemma 4 sorts keys case-insensitively, as its template does
  in history; JSON keeps the schema's order. Object size bounds and `patternProperties` are
  ignored;
* `prefixItems`, `contains`, `uniqueItems` are ignored, and item counts above 64 are treated
  as unbounded;
* `not`, `if`/`then`/`else` and `dependentRequired` are ignored.

And tighter in two places: numbers have at most 16 digits before and after the point and two
in the exponent, so a sampling model cannot run on with digits; a Gemma 4 string cannot hold
the text `<|"|>` (the delimiter has no escape, so every parser would end the string there),
and free-form Gemma 4 keys are limited to characters a bare key can hold.

`response_format_grammar` maps OpenAI's `response_format` onto xgrammar's JSON support.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..engine import GrammarCompiler, GrammarError, TokenGrammar
from .gemma3_tools import TOOL_CALL_FENCE
from .gemma4_syntax import (
    CALL_PREFIX,
    STRING_DELIM,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
)
from .types import ChatError, Tool

__all__ = ["response_format_grammar", "tool_call_grammar"]

FAMILIES = ("gemma4", "gemma3")
# Bounded repetition beyond this many items compiles into large automata for no real benefit.
MAX_COUNTED_ITEMS = 64
# Calls in one turn with `parallel` (without it, one): enough for an agent's batch of reads, few
# enough that a looping model cannot fill a turn with them.
MAX_PARALLEL_CALLS = 16
# Nesting a schema may have: far past any tool's, short of Python's recursion limit
MAX_SCHEMA_DEPTH = 64
# Object properties a constrained schema may have in all: xgrammar's compile time grows much faster than their
# count (docs/serving.md gives the figures)
MAX_SCHEMA_PROPERTIES = 1000
# Gemma 3 parallel calls: the separator the history uses between blocks (gemma3_tools).
_GEMMA3_CALL_SEPARATOR = "\n\n"


# --- public API -------------------------------------------------------------------------------


def tool_call_grammar(compiler: GrammarCompiler, family: str, tools: Sequence[Tool], tool_choice: Any,
                      parallel: bool) -> TokenGrammar | None:
    """The grammar that forces a call for `tool_choice`, or None when nothing is forced.

    `tool_choice`: None, "auto" or "none" (nothing forced); "required" / "any" (a call to any of
    `tools`); or one named function, as OpenAI (`{"type": "function", "function": {"name": N}}`)
    or Anthropic (`{"type": "tool", "name": N}`) spell it, which allows exactly one call.
    `parallel`: allow several calls when any tool may be called.
    Raises ChatError for a choice that names no tool or a schema that cannot be compiled."""
    if family not in FAMILIES:
        raise ChatError(f"no tool-call grammar for model family {family!r} (known: {', '.join(FAMILIES)})")
    chosen = _chosen_tools(tools, tool_choice)
    if chosen is None:
        return None
    if tool_choice not in ("required", "any") and not (isinstance(tool_choice, Mapping)
                                                       and tool_choice.get("type") == "any"):
        parallel = False  # a named function: exactly one call to it (OpenAI's and Anthropic's meaning)
    if family == "gemma4":
        text, named = _gemma4_calls(compiler, chosen, parallel)
    else:
        text, named = _gemma3_calls(chosen, parallel), ()
    try:
        return compiler.ebnf(text, tokens=named)
    except GrammarError as exc:  # our own output; a failure here means a schema we mistranslated
        raise ChatError(f"the tool schemas cannot be compiled into a grammar: {exc}", "tools") from exc


def response_format_grammar(compiler: GrammarCompiler, response_format: Any) -> TokenGrammar | None:
    """OpenAI's `response_format`: None or `{"type": "text"}` (None), `{"type": "json_object"}`
    (any JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.

    The output never holds properties the schema does not list, whatever `strict` says: the
    result always validates, and a small model is not invited to ramble."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ChatError("response_format must be an object", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return compiler.json_object()
    if kind != "json_schema":
        raise ChatError(f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}",
                        "response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ChatError("response_format.json_schema must be an object", "response_format.json_schema")
    schema = spec.get("schema")
    if schema is None:
        return compiler.json_object()
    if not isinstance(schema, Mapping):
        raise ChatError("response_format.json_schema.schema must be an object", "response_format.json_schema.schema")
    try:
        return compiler.json_schema(dict(schema), strict=True)
    except GrammarError as exc:
        raise ChatError(f"response_format.json_schema.schema: {exc}", "response_format.json_schema.schema") from exc


def _chosen_tools(tools: Sequence[Tool], tool_choice: Any) -> list[Tool] | None:
    """The tools one of which must be called, or None when the model may answer freely."""
    if isinstance(tool_choice, Mapping):
        kind = tool_choice.get("type")
        if kind == "function":
            function = tool_choice.get("function")
            name = function.get("name") if isinstance(function, Mapping) else None
        elif kind == "tool":
            name = tool_choice.get("name")
        elif kind in ("auto", "none", "any"):
            return _chosen_tools(tools, kind)
        else:
            raise ChatError(f"tool_choice.type {kind!r} is not supported", "tool_choice")
        if not isinstance(name, str):
            raise ChatError("tool_choice must name the function to call", "tool_choice")
        named = [tool for tool in tools if tool.name == name]
        if not named:
            known = ", ".join(tool.name for tool in tools) or "none"
            raise ChatError(f"tool_choice names {name!r}, which is not among the tools ({known})", "tool_choice")
        return named
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice in ("required", "any"):
        if not tools:
            raise ChatError(f"tool_choice is {tool_choice!r} but no tools were given", "tool_choice")
        return list(tools)
    raise ChatError(f"tool_choice {tool_choice!r} is not supported; use 'auto', 'none', 'required' or "
                    "a function", "tool_choice")


# --- per-family call grammars -----------------------------------------------------------------


def _gemma4_calls(compiler: GrammarCompiler, tools: Sequence[Tool], parallel: bool) -> tuple[str, list[int]]:
    try:
        open_id, close_id, quote_id = (compiler.token_id(p) for p in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, STRING_DELIM))
    except GrammarError as exc:
        raise ChatError(f"not a Gemma 4 tokenizer: {exc}") from exc
    rules = _Rules()
    syntax = _Gemma4Syntax(rules, quote_id, avoid=(STRING_DELIM,))
    alternatives = [_lit(tool.name) + " " + _arguments(syntax, rules, tool, i) for i, tool in enumerate(tools)]
    call = rules.add(f"Token({open_id}) {_lit(CALL_PREFIX)} ({' | '.join(alternatives)}) Token({close_id})", "call")
    return rules.text(f"{call}{{1,{MAX_PARALLEL_CALLS}}}" if parallel else call), [open_id, close_id, quote_id]


def _gemma3_calls(tools: Sequence[Tool], parallel: bool) -> str:
    rules = _Rules()
    syntax = _JsonSyntax(rules)
    alternatives = [
        _lit(json.dumps(tool.name, ensure_ascii=False) + ', "arguments": ') + " " + _arguments(syntax, rules, tool, i)
        for i, tool in enumerate(tools)
    ]
    head, tail = f'```{TOOL_CALL_FENCE}\n{{"name": ', "}\n```"
    call = rules.add(f"{_lit(head)} ({' | '.join(alternatives)}) {_lit(tail)}", "call")
    more = f"({_lit(_GEMMA3_CALL_SEPARATOR)} {call}){{0,{MAX_PARALLEL_CALLS - 1}}}"
    return rules.text(f"{call} {more}" if parallel else call)


def _arguments(syntax: _Syntax, rules: _Rules, tool: Tool, index: int) -> str:
    """The rule for one tool's argument object; ChatError names the tool on a bad schema."""
    schema = tool.parameters
    try:
        if not isinstance(schema, Mapping):
            raise _SchemaError("parameters must be a JSON schema object")
        if _types(schema) - {"object"}:
            # Arguments are always an object; a schema saying otherwise gets the generic one.
            schema = {"type": "object"}
        return _SchemaConverter(syntax, rules, schema).value(schema)
    except RecursionError:  # a reference cycle that never reaches a type: {"allOf": [{"$ref": "#"}]}
        raise ChatError(f"tools[{index}] ({tool.name}): the schema refers to itself without end",
                        f"tools[{index}]") from None
    except _SchemaError as exc:
        raise ChatError(f"tools[{index}] ({tool.name}): {exc}", f"tools[{index}]") from exc


# --- EBNF text --------------------------------------------------------------------------------


def _lit(text: str) -> str:
    """An EBNF string literal for text."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _class_char(ch: str) -> str:
    """ch escaped for use inside an EBNF character class."""
    if ch in "\\]^-":
        return "\\" + ch
    return _lit(ch)[1:-1]


class _Rules:
    """Named EBNF rules; identical bodies share one name."""

    def __init__(self) -> None:
        self._bodies: dict[str, str] = {}
        self._by_body: dict[str, str] = {}

    def add(self, body: str, hint: str) -> str:
        name = self._by_body.get(body)
        if name is None:
            name = self.reserve(hint)
            self.define(name, body)
        return name

    def reserve(self, hint: str) -> str:
        """A fresh name, for a rule that must exist before its body does (recursion)."""
        name, n = hint, 1
        while name in self._bodies:
            n += 1
            name = f"{hint}-{n}"
        self._bodies[name] = ""
        return name

    def define(self, name: str, body: str) -> None:
        self._bodies[name] = body
        self._by_body.setdefault(body, name)

    def has(self, name: str) -> bool:
        return name in self._bodies

    def text(self, root: str) -> str:
        lines = [f"root ::= {root}"]
        lines += [f"{name} ::= {body}" for name, body in self._bodies.items()]
        return "\n".join(lines) + "\n"


# --- value syntaxes ---------------------------------------------------------------------------


class _Syntax:
    """How one value syntax spells things; the parts JSON and Gemma 4 share live here.

    Rules whose length is open (strings, keys) end with their own terminator (closing quote,
    key separator): xgrammar then knows inside the rule which tokens may follow and
    precomputes their masks; a rule that may end anywhere makes it check tokens against the
    enclosing rules at every step, a hundred times slower on a 262k vocabulary."""

    member_sep: str  # EBNF for the separator between members / items
    key_sep: str  # EBNF between a key and its value
    sort_keys: bool  # properties in case-insensitive key order (else the schema's)

    def __init__(self, rules: _Rules) -> None:
        self.rules = rules

    def string(self) -> str:
        raise NotImplementedError

    def literal(self, value: Any) -> str:
        """EBNF for exactly this value."""
        raise NotImplementedError

    def key(self, name: str) -> str:
        raise NotImplementedError

    def free_key(self) -> str:
        """Any key of a free-form object, followed by the key separator."""
        raise NotImplementedError

    # At most 16 digits before and after the point and two in the exponent (module docstring).
    def integer(self) -> str:
        return self.rules.add('"-"? ("0" | [1-9] [0-9]{0,15})', "int")

    def number(self) -> str:
        return self.rules.add('"-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,16})? ([eE] [+\\-]? [0-9]{1,2})?', "num")

    def boolean(self) -> str:
        return self.rules.add('"true" | "false"', "bool")

    def null(self) -> str:
        return self.rules.add('"null"', "null")

    def any_value(self) -> str:
        if self.rules.has("any"):
            return "any"
        self.rules.reserve("any")
        member = f"{self.free_key()} any"
        obj = self.rules.add(f'"{{" ({member} ({self.member_sep} {member})*)? "}}"', "any-obj")
        arr = self.rules.add(f'"[" (any ({self.member_sep} any)*)? "]"', "any-arr")
        self.rules.define("any", " | ".join(
            [self.string(), self.number(), self.boolean(), self.null(), obj, arr]))
        return "any"

    def scalar(self, value: Any) -> str:
        """Literal text of a bool, null or finite number (shared by both syntaxes)."""
        if value is None:
            return "null"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float) and not math.isfinite(value):
            raise _SchemaError(f"{value!r} cannot be written in a tool call")
        return json.dumps(value)


class _JsonSyntax(_Syntax):
    member_sep = _lit(", ")
    key_sep = _lit(": ")
    sort_keys = False

    def string(self) -> str:
        if not self.rules.has("str"):
            # Characters up to the closing quote, escapes restarting the run.
            body = self.rules.reserve("str-body")
            self.rules.define(body, r'[^"\\\x00-\x1f]* ("\"" | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) '
                              + body + ")")
            self.rules.define(self.rules.reserve("str"), f'"\\"" {body}')
        return "str"

    def literal(self, value: Any) -> str:
        if isinstance(value, float) and not math.isfinite(value):
            raise _SchemaError(f"{value!r} cannot be written in JSON")
        return _lit(json.dumps(value, ensure_ascii=False, separators=(", ", ": ")))

    def key(self, name: str) -> str:
        return _lit(json.dumps(name, ensure_ascii=False))

    def free_key(self) -> str:
        return f"{self.string()} {self.key_sep}"


class _Gemma4Syntax(_Syntax):
    member_sep = _lit(",")
    key_sep = _lit(":")
    sort_keys = True

    # A bare key as the template writes it and parsers read it: up to ":", no structure.
    _BARE_KEY_BAD = frozenset(':,{}[]<>|"\'\\')

    def __init__(self, rules: _Rules, quote_id: int, avoid: Sequence[str]) -> None:
        super().__init__(rules)
        self._quote = f"Token({quote_id})"
        self._avoid = tuple(avoid)

    def string(self) -> str:
        if not self.rules.has("str"):
            self.rules.define(self.rules.reserve("str"),
                              f"{self._quote} {_avoiding(self.rules, self._avoid, self._quote)}")
        return "str"

    def literal(self, value: Any) -> str:
        if isinstance(value, str):
            self._check_text(value)
            return f"{self._quote} {_lit(value)} {self._quote}" if value else f"{self._quote} {self._quote}"
        if isinstance(value, Mapping):
            items = sorted(value.items(), key=lambda item: item[0].lower())
            members = f" {self.member_sep} ".join(f"{self.key(k)} {self.key_sep} {self.literal(v)}" for k, v in items)
            return f'"{{" {members} "}}"' if members else '"{" "}"'
        if isinstance(value, list):
            items = f" {self.member_sep} ".join(self.literal(v) for v in value)
            return f'"[" {items} "]"' if items else '"[" "]"'
        return _lit(self.scalar(value))

    def key(self, name: str) -> str:
        if not name or name != name.strip() or set(name) & self._BARE_KEY_BAD:
            raise _SchemaError(f"property name {name!r} cannot be written as a bare Gemma 4 key")
        return _lit(name)

    def free_key(self) -> str:
        bad = "".join(_class_char(c) for c in sorted(self._BARE_KEY_BAD))
        return self.rules.add(f"[^\\x00-\\x20{bad}]+ {self.key_sep}", "key")

    def _check_text(self, text: str) -> None:
        for marker in self._avoid:
            if marker in text:
                raise _SchemaError(f"the value {text!r} contains {marker!r}, which a Gemma 4 string cannot hold")


def _avoiding(rules: _Rules, patterns: Sequence[str], end: str) -> str:
    """A rule for any text in which none of `patterns` occurs, followed by `end`.

    A string-matching automaton written as rules: a state is the longest suffix of the text so
    far that begins some pattern; characters that start no pattern loop on the empty state
    through one character-class star."""
    prefixes = {p[:i] for p in patterns for i in range(len(p))}
    alphabet = sorted({c for p in patterns for c in p})

    def step(state: str, ch: str) -> str | None:
        text = state + ch
        if any(text.endswith(p) for p in patterns):
            return None
        return next(text[i:] for i in range(len(text) + 1) if text[i:] in prefixes)

    names: dict[str, str] = {}
    todo = [""]
    while todo:
        state = todo.pop()
        if state in names:
            continue
        names[state] = rules.reserve("text")
        todo += [nxt for ch in alphabet if (nxt := step(state, ch)) is not None and nxt not in names]
    for state, name in names.items():
        dest = {ch: step(state, ch) for ch in alphabet}
        # Characters that neither complete a pattern nor extend a partial one restart the scan;
        # one class covers them all.
        restart = f"[^{''.join(_class_char(ch) for ch, nxt in dest.items() if nxt != '')}]"
        moves = [end, *(f"{_lit(ch)} {names[nxt]}" for ch, nxt in dest.items() if nxt)]
        if state:
            rules.define(name, " | ".join([*moves, f"{restart} {names['']}"]))
        else:
            rules.define(name, f"{restart}* (" + " | ".join(moves) + ")")
    return names[""]


# --- JSON schema -> rules ---------------------------------------------------------------------


class _SchemaError(ChatError):
    pass


def _types(schema: Mapping[str, Any]) -> set[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list) and all(isinstance(t, str) for t in declared):
        return set(declared)
    if declared is not None:
        raise _SchemaError(f"'type' must be a string or a list of strings, not {declared!r}")
    return set()


_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
# Keywords that say nothing about the value's shape, or that we do not enforce.
_ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs", "definitions",
    "deprecated", "readOnly", "writeOnly", "format", "pattern", "minLength", "maxLength", "maximum",
    "exclusiveMaximum", "multipleOf", "minProperties", "maxProperties", "patternProperties",
    "propertyNames", "prefixItems", "contains", "minContains", "maxContains", "uniqueItems", "not", "if",
    "then", "else", "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems",
    "strict", "nullable",
}


class _SchemaConverter:
    """Writes rules for the values a JSON schema allows, in one syntax."""

    def __init__(self, syntax: _Syntax, rules: _Rules, root: Mapping[str, Any]) -> None:
        self._syntax = syntax
        self._rules = rules
        self._root = root
        self._refs: dict[str, str] = {}
        self._depth = 0
        self._properties = 0
        self._inlined = 0  # references being inlined (refined by siblings, or in an allOf) around this value

    def value(self, schema: Any) -> str:
        """An EBNF expression (usually a rule name) for the values `schema` allows."""
        if self._depth >= MAX_SCHEMA_DEPTH:
            raise _SchemaError("the schema refers to itself without end" if self._inlined else
                               f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        self._depth += 1
        try:
            return self._value(schema)
        finally:
            self._depth -= 1

    def _inline(self, schema: Mapping[str, Any]) -> str:
        self._inlined += 1
        try:
            return self.value(schema)
        finally:
            self._inlined -= 1

    def _value(self, schema: Any) -> str:
        if schema is True or schema == {}:
            return self._syntax.any_value()
        if schema is False:
            raise _SchemaError("a schema of false allows no value")
        if not isinstance(schema, Mapping):
            raise _SchemaError(f"a schema must be an object, not {type(schema).__name__}")
        if "$ref" in schema:
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            if set(rest) - _ANNOTATIONS:  # a reference refined by siblings: inline it
                return self._inline(_merge(self._resolve(schema["$ref"]), rest))
            return self._ref(schema["$ref"])
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list):
                raise _SchemaError("'allOf' must be a list")
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            referred = False
            for part in parts:
                referred |= isinstance(part, Mapping) and "$ref" in part
                merged = _merge(merged, self._resolve(part["$ref"]) if isinstance(part, Mapping) and "$ref" in part
                                else part)
            return self._inline(merged) if referred else self.value(merged)
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                options = schema[keyword]
                if not isinstance(options, list) or not options:
                    raise _SchemaError(f"'{keyword}' must be a non-empty list")
                rest = {k: v for k, v in schema.items() if k != keyword}
                return self._alternatives([self.value(_merge(rest, option)) for option in options], "one-of")
        if "const" in schema:
            return self._literal(schema["const"])
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise _SchemaError("'enum' must be a non-empty list")
            return self._alternatives([self._literal(v) for v in values], "enum")
        types = _types(schema)
        unknown = types - set(_TYPES)
        if unknown:
            raise _SchemaError(f"unsupported type {min(unknown)!r}")
        if not types:
            # Untyped: shaped by whichever keywords are present, else anything.
            if "properties" in schema or "additionalProperties" in schema or "required" in schema:
                types = {"object"}
            elif "items" in schema:
                types = {"array"}
            else:
                return self._syntax.any_value()
        if schema.get("nullable") is True:
            types.add("null")
        return self._alternatives([self._typed(t, schema) for t in _TYPES if t in types], "value")

    def _typed(self, kind: str, schema: Mapping[str, Any]) -> str:
        syntax = self._syntax
        if kind == "string":
            return syntax.string()
        if kind in ("integer", "number"):
            bounds = _bounds(schema)
            if bounds is not None:
                return self._rules.add(_bounded_number(kind == "integer", *bounds), f"{kind}-in-range")
            return syntax.integer() if kind == "integer" else syntax.number()
        if kind == "boolean":
            return syntax.boolean()
        if kind == "null":
            return syntax.null()
        if kind == "array":
            return self._array(schema)
        return self._object(schema)

    def _literal(self, value: Any) -> str:
        return self._syntax.literal(value)

    def _alternatives(self, options: list[str], hint: str) -> str:
        unique = list(dict.fromkeys(options))
        return unique[0] if len(unique) == 1 else self._rules.add(" | ".join(unique), hint)

    def _ref(self, ref: Any) -> str:
        """A named rule per reference, so recursive schemas become recursive rules."""
        if ref not in self._refs:
            target = self._resolve(ref)
            name = self._refs[ref] = self._rules.reserve("ref")
            self._rules.define(name, self.value(target))
        return self._refs[ref]

    def _resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise _SchemaError(f"only local references ('#/$defs/...') are supported, not {ref!r}")
        node: Any = self._root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, Mapping) or part not in node:
                raise _SchemaError(f"reference {ref!r} points nowhere")
            node = node[part]
        return node

    def _array(self, schema: Mapping[str, Any]) -> str:
        items = schema.get("items", True)
        item = self.value(items if isinstance(items, (Mapping, bool)) else True)
        low = _count(schema.get("minItems"), 0)
        high = _count(schema.get("maxItems"), None)
        if high is not None and high > MAX_COUNTED_ITEMS:
            high = None
        low = min(low, MAX_COUNTED_ITEMS)
        if high is not None and high < low:
            raise _SchemaError(f"maxItems {high} is below minItems {low}")
        if high == 0:
            return self._rules.add('"[" "]"', "arr")
        # The first item, then the others each after a separator.
        more = f"({self._syntax.member_sep} {item})"
        if high is None:
            more += "*" if low <= 1 else f"{{{low - 1},}}"
        else:
            more = "" if high == 1 else more + f"{{{max(low - 1, 0)},{high - 1}}}"
        items = f"{item} {more}".strip()
        return self._rules.add(f'"[" {items} "]"' if low else f'"[" ({items})? "]"', "arr")

    def _object(self, schema: Mapping[str, Any]) -> str:
        syntax = self._syntax
        properties = schema.get("properties")
        required = schema.get("required", [])
        if not isinstance(required, list):
            raise _SchemaError("'required' must be a list")
        if properties is None:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return self._rules.add('"{" "}"', "obj")
            value = self.value(extra if isinstance(extra, (Mapping, bool)) else True)
            member = f"{syntax.free_key()} {value}"
            return self._rules.add(f'"{{" ({member} ({syntax.member_sep} {member})*)? "}}"', "obj")
        if not isinstance(properties, Mapping):
            raise _SchemaError("'properties' must be an object")
        self._properties += len(properties)
        if self._properties > MAX_SCHEMA_PROPERTIES:
            raise _SchemaError(f"the schema has more than {MAX_SCHEMA_PROPERTIES} object properties in all, the most "
                               f"a constrained call or format takes (this one has {len(properties)} in one object)")
        missing = [name for name in required if name not in properties]
        if missing:
            raise _SchemaError(f"required property {missing[0]!r} is not among the properties")
        names = sorted(properties, key=str.lower) if syntax.sort_keys else list(properties)
        members = [f"{syntax.key(name)} {syntax.key_sep} {self.value(properties[name])}" for name in names]
        needed = [name in required for name in names]
        return self._rules.add(f'"{{" {self._members(members, needed)} "}}"', "obj")

    def _members(self, members: list[str], needed: list[bool]) -> str:
        """Members in order, each optional one present or not, joined by separators.

        Built from the last member back, two rules a member, so a schema of thousands of properties makes a
        grammar linear in their count and no deep recursion: `rest` is what may follow member i-1 once some
        member was written (member i, required or optional, then the rest), `first` what may be written when
        none before i was (member i and the rest after it, or, where i is optional, the first of those after)."""
        sep = self._syntax.member_sep
        rest, first = "", '""'  # past the last member: nothing more; no member at all (every one optional)
        for member, required in zip(reversed(members), reversed(needed)):
            written = f"{member} {rest}".strip()
            first = self._rules.add(written if required else f"{written} | {first}", "members")
            mine = f"{sep} {member}"
            rest = self._rules.add(f"{mine} {rest}".strip() if required else f"({mine})? {rest}".strip(),
                                   "rest")
        return first if members else ""


# --- numeric bounds ---------------------------------------------------------------------------

_MAX_DIGITS = 16
_MAX_INT = 10**_MAX_DIGITS - 1  # the 16-digit cap every number has anyway
_FRACTION = f'"." [0-9]{{1,{_MAX_DIGITS}}}'


def _bounds(schema: Mapping[str, Any]) -> tuple[int, int, int, int] | None:
    """(lowest integer, highest integer, lowest and highest integer part a number with a fraction
    may have, as a distance from zero on its own side) allowed by minimum / maximum /
    exclusiveMinimum / exclusiveMaximum (numbers, or draft 4's booleans), within 16 digits; None
    when the schema has no bound."""
    def number(key: str) -> float | None:
        value = schema.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return value if ok else None

    lo, hi = number("minimum"), number("maximum")
    lo_excl = schema.get("exclusiveMinimum") is True and lo is not None
    hi_excl = schema.get("exclusiveMaximum") is True and hi is not None
    if (value := number("exclusiveMinimum")) is not None and (lo is None or value >= lo):
        lo, lo_excl = value, True
    if (value := number("exclusiveMaximum")) is not None and (hi is None or value <= hi):
        hi, hi_excl = value, True
    if lo is None and hi is None:
        return None
    low = -_MAX_INT if lo is None else max(-_MAX_INT, math.ceil(lo) + (1 if lo_excl and lo == math.ceil(lo) else 0))
    high = _MAX_INT if hi is None else min(_MAX_INT, math.floor(hi) - (1 if hi_excl and hi == math.floor(hi) else 0))
    # "i.f" lies in [i, i + 1): it needs i >= low and i + 1 <= hi. "-k.f" lies in (-k - 1, -k]: it
    # needs -k <= high and -k - 1 >= lo.
    frac_high = _MAX_INT if hi is None else min(_MAX_INT, math.floor(hi) - 1)
    frac_neg_high = _MAX_INT if lo is None else min(_MAX_INT, math.floor(-lo) - 1)
    return low, high, frac_high, frac_neg_high


def _bounded_number(integer: bool, low: int, high: int, frac_high: int, frac_neg_high: int) -> str:
    """EBNF for the numbers in the bounds `_bounds` computed: integers exactly; with a fraction,
    those whose whole range of fractions fits (so a bound of 2.5 allows 2 but not 2.3). No exponent."""
    alternatives = _integer_range(low, high)
    if not integer:
        part = _digits_range(max(0, low), frac_high)
        alternatives += [f"({' | '.join(part)}) {_FRACTION}"] if part else []
        negative = _digits_range(max(1, -high), frac_neg_high)
        if negative:
            alternatives.append(f'"-" ({" | ".join(negative)}) {_FRACTION}')
    if not alternatives:
        raise _SchemaError(f"no {'integer' if integer else 'number'} satisfies minimum/maximum (a number with a "
                           "fraction is only forced where a whole unit fits between the bounds)")
    return " | ".join(alternatives)


def _integer_range(low: int, high: int) -> list[str]:
    """EBNF alternatives for the integers in [low, high], written without leading zeros or '-0'."""
    out = _digits_range(max(0, low), high)
    negative = _digits_range(max(1, -high), -low)
    if negative:
        out.append(f'"-" ({" | ".join(negative)})')
    return out


def _digits_range(low: int, high: int) -> list[str]:
    """EBNF alternatives for the decimal numerals of [low, high], 0 <= low."""
    out = []
    if low == 0 <= high:
        out.append('"0"')
        low = 1
    while low <= high:
        n = len(str(low))
        whole = len(str(high + 1)) - 1  # the longest length all of whose numerals are <= high
        if low == 10 ** (n - 1) and whole >= n:
            # Every numeral of lengths n..whole: one rule, as `[1-9] [0-9]{0,15}` for "any".
            out.append("[1-9]" + _repeat(n - 1, whole - 1))
            low = 10 ** whole
            continue
        top = min(high, 10 ** n - 1)  # one length at a time
        out += _same_length(str(low), str(top))
        low = top + 1
    return out


def _repeat(least: int, most: int) -> str:
    """` [0-9]` repeated least..most times, in EBNF."""
    if most == 0:
        return ""
    return f" [0-9]{{{least}}}" if least == most else f" [0-9]{{{least},{most}}}"


def _same_length(x: str, y: str) -> list[str]:
    """Digit strings of x's length from x to y (x <= y): the classic split into prefix + classes."""
    n = len(x)
    if n == 1:
        return [_digit_class(int(x), int(y))]
    if x[0] == y[0]:
        return [f'"{x[0]}" ({" | ".join(_same_length(x[1:], y[1:]))})']
    out = []
    first, last = int(x[0]), int(y[0])
    if x[1:] != "0" * (n - 1):
        out.append(f'"{x[0]}" ({" | ".join(_same_length(x[1:], "9" * (n - 1)))})')
        first += 1
    if y[1:] != "9" * (n - 1):
        out.append(f'"{y[0]}" ({" | ".join(_same_length("0" * (n - 1), y[1:]))})')
        last -= 1
    if first <= last:
        out.append(f"{_digit_class(first, last)} [0-9]{{{n - 1}}}")
    return out


def _digit_class(first: int, last: int) -> str:
    return f'"{first}"' if first == last else f"[{first}-{last}]"


def _count(value: Any, default: int | None) -> int | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _SchemaError(f"an item count must be a non-negative integer, not {value!r}")
    return value


def _merge(base: Mapping[str, Any], extra: Any) -> dict[str, Any]:
    """Two schemas that must both hold, approximated by one: properties and required lists are
    united, any other keyword of `extra` wins."""
    if extra is True:
        return dict(base)
    if not isinstance(extra, Mapping):
        raise _SchemaError(f"a schema must be an object, not {type(extra).__name__}")
    merged = {**base, **extra}
    if "properties" in base and "properties" in extra:
        merged["properties"] = {**base["properties"], **extra["properties"]}
    if "required" in base and "required" in extra:
        merged["required"] = list(dict.fromkeys([*base["required"], *extra["required"]]))
    return merged
