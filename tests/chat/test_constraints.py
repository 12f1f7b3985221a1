"""Grammars that force tool calls and response formats.

Gemma 3 runs for real (the embedded 270M model, sampling at temperature 1). There is no Gemma 4
model here, so its grammar is checked on a tokenizer that has Gemma 4's special tokens: calls
rendered by Google's template must pass, broken ones must stop at the right token, and random
logits sampled through the mask must give calls our parser reads back valid."""

import copy
import json
from pathlib import Path

import jinja2
import jsonschema
import pytest
import torch

from dflash_agent.chat.constraints import (
    MAX_PARALLEL_CALLS,
    MAX_SCHEMA_PROPERTIES,
    response_format_grammar,
    tool_call_grammar,
)
from dflash_agent.chat.gemma3_tools import format_tool_call as gemma3_call
from dflash_agent.chat.gemma3_tools import tools_prompt
from dflash_agent.chat.gemma4_syntax import format_tool_call as gemma4_call
from dflash_agent.chat.parser import make_parser
from dflash_agent.chat.types import ChatError, Tool, ToolCall
from dflash_agent.engine.decode.grammar import GrammarCompiler
from dflash_agent.engine.decode.sampling import Sampler, SamplingParams
from tests.helpers.tokenizers import EMBEDDED_VOCAB as VOCAB

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "google_gemma4_chat_template.jinja"
TOOL_RESPONSE = 50

READ_FILE = Tool("read_file", "Read a text file.", {
    "type": "object",
    "properties": {
        "path": {"type": "string", "description": "File path."},
        "offset": {"type": "integer", "minimum": 0},
        "limit": {"type": "integer", "minimum": 0},
    },
    "required": ["path"],
})
EDIT_FILE = Tool("edit_file", "Replace text in a file.", {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "old_string": {"type": "string"},
        "new_string": {"type": "string"},
        "replace_all": {"type": "boolean"},
    },
    "required": ["path", "old_string", "new_string"],
})
BASH = Tool("bash", "Run a shell command.", {
    "type": "object",
    "properties": {
        "command": {"type": "string"},
        "timeout": {"type": ["number", "null"]},
        "mode": {"enum": ["foreground", "background"]},
        "env": {"type": "object", "additionalProperties": {"type": "string"}},
        "files": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["command"],
})
THREE_TOOLS = [READ_FILE, EDIT_FILE, BASH]
# For the real model: a free-form map invites a 270M base model to ramble past any token budget.
MODEL_TOOLS = [READ_FILE, EDIT_FILE, Tool("bash", "Run a shell command.", {
    "type": "object",
    "properties": {
        "command": {"type": "string"},
        "timeout": {"type": ["number", "null"]},
        "mode": {"enum": ["foreground", "background"]},
    },
    "required": ["command"],
})]
# Schema features beyond flat objects: nesting, $ref recursion, anyOf, const, counted arrays,
# mixed-case keys, untyped values.
TREE = Tool("plant", "", {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"label": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["label"],
        },
    },
    "type": "object",
    "properties": {
        "root": {"$ref": "#/$defs/node"},
        "Weight": {"anyOf": [{"type": "integer"}, {"type": "string", "enum": ["light", "heavy"]}]},
        "kind": {"const": "tree"},
        "point": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
        "options": {
            "type": "object",
            "properties": {"deep": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["deep"],
        },
        "note": {},
    },
    "required": ["root", "kind"],
})
SCHEMA_TOOLS = [*THREE_TOOLS, TREE]


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_compiler(gemma3_tokenizer):
    return GrammarCompiler(gemma3_tokenizer, VOCAB)


@pytest.fixture(scope="module")
def gemma4_compiler(gemma4_tokenizer):
    return GrammarCompiler(gemma4_tokenizer, VOCAB)


@pytest.fixture(scope="module")
def engine(embedded_engine):
    eng = embedded_engine(1024, device="cpu", dtype="float32")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prefilled():
    """KV cache and first logits per prompt, shared by the seeds that sample from it."""
    return {}


@pytest.fixture(scope="module")
def random_bias():
    """Per tokenizer: logit offsets for a random 'model' that prefers short printable pieces
    and, more strongly, closing punctuation and the stop tokens, so values stay short."""
    biases = {}

    def get(tokenizer):
        if id(tokenizer) not in biases:
            bias = torch.zeros(VOCAB)
            short = [token_id for piece, token_id in tokenizer.backend.get_vocab().items()
                     if len(piece) <= 2 and all(32 <= ord(c) < 127 for c in piece.replace("▁", " "))]
            bias[short] = 8.0
            closers = [i for i in map(tokenizer.token_id, ['"', "}", "]", ":", '<|"|>', "<tool_call|>"]) if i is not None]
            bias[[*closers, *tokenizer.stop_ids]] = 14.0
            biases[id(tokenizer)] = bias
        return biases[id(tokenizer)]

    return get


# --- helpers ------------------------------------------------------------------------------------


def accepted_prefix(grammar, tokenizer, text):
    """Feed text's tokens through mask + accept; (decoded accepted prefix, rejected piece or
    None, matcher)."""
    matcher = grammar.matcher()
    ids = tokenizer.encode(text, add_bos=False)
    for i, token in enumerate(ids):
        logits = torch.zeros(VOCAB)
        matcher.mask(logits)
        allowed = bool(torch.isfinite(logits[token]))
        assert matcher.accept(token) == allowed
        if not allowed:
            return tokenizer.decode(ids[:i]), tokenizer.decode([token]), matcher
    return text, None, matcher


def parse(family, text):
    parser = make_parser(family)
    parser.feed(text)
    parser.finish()
    return parser.result()


def assert_valid_calls(result, tools, parallel):
    schemas = {tool.name: tool.parameters for tool in tools}
    assert result.content.strip() == ""
    assert len(result.tool_calls) == 1 or (parallel and result.tool_calls)
    for call in result.tool_calls:
        jsonschema.validate(call.arguments, schemas[call.name])


def render_gemma4_calls(tools, calls):
    """The model's part of an assistant turn holding `calls`, as Google's template writes it."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(TEMPLATE.read_text())
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}}
                                             for n, a in calls]},
    ]
    declared = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in tools]
    text = template.render(messages=messages, tools=declared, bos_token="<bos>", add_generation_prompt=False)
    start, end = text.index("<|tool_call>"), text.rindex("<tool_call|>") + len("<tool_call|>")
    return text[start:end]


def random_logits_sample(grammar, tokenizer, bias, seed, max_steps=600):
    """Sample through the mask from random logits plus `bias`; the generated ids, stop excluded."""
    generator = torch.Generator().manual_seed(seed)
    matcher = grammar.matcher()
    out = []
    for _ in range(max_steps):
        logits = torch.randn(VOCAB, generator=generator) + bias
        matcher.mask(logits)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert matcher.accept(token)
        if matcher.is_terminated:
            return out
        out.append(token)
    pytest.fail(f"seed {seed}: no complete output in {max_steps} tokens: {tokenizer.decode(out)[:200]!r}")


def sample_model(engine, prefilled, prompt_ids, grammar, seed, max_tokens):
    """Sample from the model at temperature 1 through the grammar, after the prompt's prefill
    (done once per prompt); the generated ids, stop excluded, and whether the grammar finished."""
    model = engine.model
    key = tuple(prompt_ids)
    if key not in prefilled:
        cache = model.new_cache(len(prompt_ids) + max_tokens + 1)
        prefilled[key] = (cache, model(torch.tensor(prompt_ids), cache).logits[0])
    cache, logits = copy.deepcopy(prefilled[key])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    matcher = grammar.matcher()
    out = []
    for _ in range(max_tokens):
        matcher.mask(logits)
        token = sampler(logits)
        assert matcher.accept(token)
        if token in grammar.stop_ids:
            break
        out.append(token)
        logits = model(torch.tensor([token]), cache).logits[0]
    return out, matcher.is_terminated


def gemma3_prompt(tokenizer, tools, request):
    text = f"<start_of_turn>user\n{tools_prompt(tools)}\n\n{request}<end_of_turn>\n<start_of_turn>model\n"
    return tokenizer.encode(text)


# --- Gemma 3 with the embedded model --------------------------------------------------------------


def test_gemma3_required_call_validates_for_ten_seeds(engine, prefilled, gemma3_compiler):
    grammar = tool_call_grammar(gemma3_compiler, "gemma3", MODEL_TOOLS, "required", parallel=False)
    prompt = gemma3_prompt(engine.tokenizer, MODEL_TOOLS, "Show me what README.md says.")
    for seed in range(10):
        ids, finished = sample_model(engine, prefilled, prompt, grammar, seed, max_tokens=96)
        text = engine.tokenizer.decode(ids)
        assert finished, (seed, text)
        assert text.startswith("```tool_call\n{\"name\": ") and text.endswith("}\n```"), text
        assert_valid_calls(parse("gemma3", text), MODEL_TOOLS, parallel=False)


def test_json_schema_response_format_validates(engine, prefilled, gemma3_compiler):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["name", "age"],
    }
    grammar = response_format_grammar(
        gemma3_compiler, {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    )
    prompt = engine.tokenizer.encode(
        "<start_of_turn>user\nDescribe a programmer as JSON with name, age and languages.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    for seed in range(3):
        ids, finished = sample_model(engine, prefilled, prompt, grammar, seed, max_tokens=120)
        text = engine.tokenizer.decode(ids)
        assert finished, text
        jsonschema.validate(json.loads(text), schema)


# --- Gemma 4 on a tokenizer with its special tokens -------------------------------------------------


def test_gemma4_markers_are_single_tokens(gemma4_tokenizer):
    call = gemma4_call("read_file", {"path": "a"})
    ids = gemma4_tokenizer.encode(call, add_bos=False)
    assert ids[0] == 48 and ids[-1] == 49 and ids.count(52) == 2


TEMPLATE_CASES = [
    ([READ_FILE], [("read_file", {"path": "README.md", "limit": 20})]),
    ([READ_FILE], [("read_file", {"path": "a", "offset": 0, "limit": 3})]),
    ([BASH], [("bash", {"command": 'grep -n "x{1}" *.py | sort\n', "timeout": 2.5, "mode": "background",
                        "env": {"LANG": "C", "PATH": "/bin"}, "files": ["a.py", "b c.py"]})]),
    ([BASH], [("bash", {"command": "echo '}<tool_call|>' \\ done", "files": []})]),
    ([EDIT_FILE, READ_FILE], [("edit_file", {"path": "x", "old_string": "", "new_string": "ü → ∀",
                                            "replace_all": False}),
                              ("read_file", {"path": "x"})]),
    ([TREE], [("plant", {"root": {"label": "a", "kids": [{"label": "b", "kids": []}, {"label": "c"}]},
                         "Weight": "heavy", "kind": "tree", "point": [1, -2.5e-05],
                         "options": {"deep": True, "tags": ["x", "y"]}, "note": {"any": [1, "two", {"k": False}]}})]),
    ([TREE], [("plant", {"root": {"label": ""}, "kind": "tree", "Weight": 12})]),
]


@pytest.mark.parametrize("tools, calls", TEMPLATE_CASES)
def test_gemma4_accepts_calls_rendered_by_googles_template(gemma4_compiler, gemma4_tokenizer, tools, calls):
    text = render_gemma4_calls(tools, calls)
    assert text == "".join(gemma4_call(name, args) for name, args in calls)
    grammar = tool_call_grammar(gemma4_compiler, "gemma4", tools, "required", parallel=len(calls) > 1)
    prefix, rejected, matcher = accepted_prefix(grammar, gemma4_tokenizer, text)
    assert rejected is None, (prefix, rejected)
    assert matcher.accept(TOOL_RESPONSE) and matcher.is_terminated
    parsed = parse("gemma4", text)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls


REJECTED = [
    # (tool_choice, parallel, text, accepted prefix, first refused piece)
    ("required", False, '<|tool_call>call:read_file{limit:20}<tool_call|>',
     "<|tool_call>call:read_file{limit:20", "}"),
    ("required", False, '<|tool_call>call:bash{command:<|"|>ls<|"|>,mode:<|"|>fast<|"|>}<tool_call|>',
     '<|tool_call>call:bash{command:<|"|>ls<|"|>,mode:<|"|>', "fast"),
    ("required", False, '<|tool_call>call:read_file{limit:<|"|>20<|"|>,path:<|"|>a<|"|>}<tool_call|>',
     "<|tool_call>call:read_file{limit:", '<|"|>'),
    ("required", False, '<|tool_call>call:read_file{path:<|"|>a<|"|>,limit:2}<tool_call|>',
     '<|tool_call>call:read_file{path:<|"|>a<|"|>', ","),
    ("required", False, '<|tool_call>call:read_file{path:<|"|>a<|"|>,size:2}<tool_call|>',
     '<|tool_call>call:read_file{path:<|"|>a<|"|>', ","),
    ("required", False, '<|tool_call>call:write_file{path:<|"|>a<|"|>}<tool_call|>',
     "<|tool_call>call:", "write"),
    ("required", False, '<|tool_call>call:read_file{"path": "a"}<tool_call|>',
     "<|tool_call>call:read_file", '{"'),
    ("required", False, '<|tool_call>call:read_file{limit:-1,path:<|"|>a<|"|>}<tool_call|>',
     "<|tool_call>call:read_file{limit", ":-"),
    ("required", False, 'Sure!<|tool_call>call:read_file{path:<|"|>a<|"|>}<tool_call|>', "", "Sure"),
    ("required", False, gemma4_call("read_file", {"path": "a"}) * 2, gemma4_call("read_file", {"path": "a"}),
     "<|tool_call>"),
    # A named function is called exactly once, whatever parallel_tool_calls says.
    ({"type": "function", "function": {"name": "bash"}}, True,
     gemma4_call("bash", {"command": "ls"}) + gemma4_call("bash", {"command": "pwd"}),
     gemma4_call("bash", {"command": "ls"}), "<|tool_call>"),
    ({"type": "tool", "name": "plant"}, False,
     '<|tool_call>call:plant{kind:<|"|>tree<|"|>,point:[1],root:{label:<|"|>a<|"|>}}<tool_call|>',
     '<|tool_call>call:plant{kind:<|"|>tree<|"|>,point:[1', "],"),
    ({"type": "tool", "name": "plant"}, False,
     '<|tool_call>call:plant{kind:<|"|>bush<|"|>,root:{label:<|"|>a<|"|>}}<tool_call|>',
     '<|tool_call>call:plant{kind:<|"|>', "bush"),
]


@pytest.mark.parametrize("tool_choice, parallel, text, prefix, refused", REJECTED)
def test_gemma4_refuses_invalid_calls_at_the_right_token(gemma4_compiler, gemma4_tokenizer, tool_choice,
                                                         parallel, text, prefix, refused):
    grammar = tool_call_grammar(gemma4_compiler, "gemma4", SCHEMA_TOOLS, tool_choice, parallel)
    got_prefix, got_refused, _ = accepted_prefix(grammar, gemma4_tokenizer, text)
    assert (got_prefix, got_refused) == (prefix, refused)


def test_gemma4_string_cannot_contain_the_delimiter_text(gemma4_compiler, gemma4_tokenizer):
    grammar = tool_call_grammar(gemma4_compiler, "gemma4", [READ_FILE], "required", parallel=False)
    matcher = grammar.matcher()
    prefix = '<|tool_call>call:read_file{path:<|"|>a<|"'
    for token in gemma4_tokenizer.encode(prefix, add_bos=False):
        assert matcher.accept(token)
    # `<|"` spelled in ordinary pieces may go on, but not into `|>`: that would end the string
    # for every text-level parser.
    assert matcher.accept(gemma4_tokenizer.encode("|", add_bos=False)[0])
    assert not matcher.accept(gemma4_tokenizer.encode(">", add_bos=False)[0])
    assert matcher.accept(gemma4_tokenizer.encode("x", add_bos=False)[0])


@pytest.mark.parametrize("family", ["gemma4", "gemma3"])
@pytest.mark.parametrize("parallel", [False, True])
def test_random_sampling_through_the_mask_gives_valid_calls(family, parallel, random_bias, request):
    compiler = request.getfixturevalue(f"{family}_compiler")
    tokenizer = request.getfixturevalue(f"{family}_tokenizer")
    grammar = tool_call_grammar(compiler, family, SCHEMA_TOOLS, "required", parallel)
    names = set()
    for seed in range(8):
        text = tokenizer.decode(random_logits_sample(grammar, tokenizer, random_bias(tokenizer), seed))
        result = parse(family, text)
        assert_valid_calls(result, SCHEMA_TOOLS, parallel)
        names |= {call.name for call in result.tool_calls}
    assert len(names) >= 3  # the choice between tools is really open


# --- Gemma 3 grammar shape ---------------------------------------------------------------------------


def test_gemma3_accepts_the_history_format(gemma3_compiler, gemma3_tokenizer):
    calls = [ToolCall("1", "read_file", {"path": "README.md", "limit": 20}),
             ToolCall("2", "bash", {"command": "ls \"a b\"\n", "timeout": None, "mode": "foreground",
                                    "env": {"A": "1"}, "files": ["x", "y"]})]
    text = "\n\n".join(gemma3_call(call) for call in calls)
    grammar = tool_call_grammar(gemma3_compiler, "gemma3", THREE_TOOLS, "required", parallel=True)
    prefix, refused, matcher = accepted_prefix(grammar, gemma3_tokenizer, text)
    assert refused is None, prefix
    assert matcher.accept(gemma3_tokenizer.eos_id)
    single = tool_call_grammar(gemma3_compiler, "gemma3", THREE_TOOLS, "required", parallel=False)
    prefix, refused, _ = accepted_prefix(single, gemma3_tokenizer, text)
    assert prefix == gemma3_call(calls[0]) and refused is not None


def test_gemma3_named_choice(gemma3_compiler, gemma3_tokenizer):
    grammar = tool_call_grammar(gemma3_compiler, "gemma3", THREE_TOOLS,
                                {"type": "function", "function": {"name": "bash"}}, parallel=False)
    text = gemma3_call(ToolCall("1", "read_file", {"path": "a"}))
    prefix, refused, _ = accepted_prefix(grammar, gemma3_tokenizer, text)
    assert prefix == '```tool_call\n{"name": "' and refused == "read"


# --- choices, formats and errors ----------------------------------------------------------------------


@pytest.mark.parametrize("choice", [None, "auto", "none", {"type": "auto"}, {"type": "none"}])
def test_nothing_forced(gemma3_compiler, choice):
    assert tool_call_grammar(gemma3_compiler, "gemma3", THREE_TOOLS, choice, parallel=True) is None


@pytest.mark.parametrize("choice, message", [
    ("required", "no tools"),
    ({"type": "any"}, "no tools"),
])
def test_required_without_tools(gemma3_compiler, choice, message):
    with pytest.raises(ChatError, match=message) as err:
        tool_call_grammar(gemma3_compiler, "gemma3", [], choice, parallel=False)
    assert err.value.param == "tool_choice"


@pytest.mark.parametrize("choice, message", [
    ({"type": "function", "function": {"name": "rm"}}, "'rm', which is not among the tools"),
    ({"type": "tool", "name": "rm"}, "not among the tools"),
    ({"type": "function"}, "must name the function"),
    ({"type": "web_search"}, "not supported"),
    ("always", "not supported"),
])
def test_bad_tool_choice(gemma3_compiler, choice, message):
    with pytest.raises(ChatError, match=message) as err:
        tool_call_grammar(gemma3_compiler, "gemma3", THREE_TOOLS, choice, parallel=False)
    assert err.value.param == "tool_choice"


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
@pytest.mark.parametrize("parameters, message", [
    ({"type": "object", "properties": {"a": {"type": "nonsense"}}}, "unsupported type 'nonsense'"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, "'b' is not among"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "points nowhere"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "only local references"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "non-empty list"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 2}}}, "below minItems"),
    ({"type": "object", "properties": {"a": False}}, "allows no value"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}},
     "refers to itself"),
])
def test_bad_tool_schema(family, parameters, message, request):
    compiler = request.getfixturevalue(f"{family}_compiler")
    tools = [READ_FILE, Tool("broken", "", parameters)]
    with pytest.raises(ChatError, match=message) as err:
        tool_call_grammar(compiler, family, tools, "required", parallel=False)
    assert err.value.param == "tools[1]"
    assert "broken" in str(err.value)


def test_gemma4_keys_must_be_bare(gemma4_compiler, gemma3_compiler):
    tool = Tool("t", "", {"type": "object", "properties": {"a:b": {"type": "string"}}})
    with pytest.raises(ChatError, match="bare Gemma 4 key"):
        tool_call_grammar(gemma4_compiler, "gemma4", [tool], "required", parallel=False)
    assert tool_call_grammar(gemma3_compiler, "gemma3", [tool], "required", parallel=False) is not None


def test_parameters_that_are_not_an_object_schema_get_any_object(gemma3_compiler, gemma3_tokenizer):
    grammar = tool_call_grammar(gemma3_compiler, "gemma3", [Tool("t", "", {"type": "string"})], "required", False)
    assert accepted_prefix(grammar, gemma3_tokenizer, gemma3_call(ToolCall("1", "t", {"x": [1]})))[1] is None


def test_family_and_tokenizer_must_fit(gemma3_compiler):
    with pytest.raises(ValueError, match="no tool-call grammar for model family 'llama'"):
        tool_call_grammar(gemma3_compiler, "llama", THREE_TOOLS, "required", parallel=False)
    with pytest.raises(ValueError, match="not a Gemma 4 tokenizer"):
        tool_call_grammar(gemma3_compiler, "gemma4", THREE_TOOLS, "required", parallel=False)


def test_response_formats(gemma3_compiler, gemma3_tokenizer):
    assert response_format_grammar(gemma3_compiler, None) is None
    assert response_format_grammar(gemma3_compiler, {"type": "text"}) is None
    any_object = response_format_grammar(gemma3_compiler, {"type": "json_object"})
    assert accepted_prefix(any_object, gemma3_tokenizer, '{"a": [1, {"b": null}]}')[1] is None
    assert accepted_prefix(any_object, gemma3_tokenizer, "[1]")[1] == "["
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    typed = response_format_grammar(gemma3_compiler, {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert accepted_prefix(typed, gemma3_tokenizer, '{"n": 3}')[1] is None
    assert accepted_prefix(typed, gemma3_tokenizer, '{"n": 3, "m": 4}')[1] is not None  # strict
    unnamed = response_format_grammar(gemma3_compiler, {"type": "json_schema", "json_schema": {"name": "x"}})
    assert unnamed is any_object


@pytest.mark.parametrize("response_format, param", [
    ("json", "response_format"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "response_format.json_schema.schema"),
])
def test_malformed_response_format(gemma3_compiler, response_format, param):
    with pytest.raises(ChatError) as err:
        response_format_grammar(gemma3_compiler, response_format)
    assert err.value.param == param


# --- numeric bounds and the number of calls -------------------------------------------------------

BOUNDED = Tool("bash", "Run a shell command.", {
    "type": "object",
    "properties": {"command": {"type": "string"}, "timeout": {"type": "integer", "minimum": 1, "maximum": 600}},
    "required": ["command", "timeout"],
})


def can_stop(matcher, tokenizer):
    logits = torch.zeros(VOCAB)
    matcher.mask(logits)
    return any(bool(torch.isfinite(logits[i])) for i in tokenizer.stop_ids)


def gemma3_block(name, arguments):
    return f'```tool_call\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n```'


@pytest.mark.parametrize("timeout, allowed", [
    (1, True), (9, True), (60, True), (599, True), (600, True),
    (0, False), (-1, False), (601, False), (700, False), (6000, False), (9999999000000000, False),
])
def test_forced_call_respects_minimum_and_maximum(gemma3_compiler, gemma3_tokenizer, timeout, allowed):
    grammar = tool_call_grammar(gemma3_compiler, "gemma3", [BOUNDED], "required", parallel=False)
    text = gemma3_block("bash", {"command": "ls", "timeout": timeout})
    _, refused, matcher = accepted_prefix(grammar, gemma3_tokenizer, text)
    assert (refused is None and can_stop(matcher, gemma3_tokenizer)) == allowed, (timeout, refused)


BOUND_CASES = [
    ("integer", {"minimum": 1, "maximum": 600}),
    ("integer", {"minimum": -37, "maximum": 1234}),
    ("integer", {"exclusiveMinimum": 0, "exclusiveMaximum": 100}),
    ("integer", {"minimum": 5, "exclusiveMinimum": True, "maximum": 10.5}),
    ("integer", {"maximum": -3}),
    ("integer", {"minimum": 0}),
    ("number", {"minimum": -2.5, "maximum": 3}),
    ("number", {"exclusiveMinimum": -10, "maximum": 100}),
    ("number", {"minimum": 0.5}),
]


@pytest.mark.parametrize("kind, bounds", BOUND_CASES)
def test_bounded_numbers_are_exact_for_integers_and_sound_for_fractions(kind, bounds):
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from dflash_agent.chat.constraints import _bounded_number, _bounds

    grammar = xgr.Grammar.from_ebnf(f"root ::= {_bounded_number(kind == 'integer', *_bounds(bounds))}")
    schema = {"type": kind, **bounds}
    if bounds.get("exclusiveMinimum") is True:  # draft 4 spelling, which jsonschema's default draft rejects
        schema = {"type": kind, "exclusiveMinimum": bounds["minimum"], "maximum": bounds["maximum"]}

    def valid(text):
        return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))

    for n in [*range(-1300, 1300), 10**15, -(10**15), 9999999000000000]:
        assert _is_grammar_accept_string(grammar, str(n)) == valid(str(n)), n
    for text in ["-0", "007", "1e3", "+1"]:
        assert not _is_grammar_accept_string(grammar, text), text
    if kind == "number":
        for n in range(-120, 120):
            for fraction in (".0", ".25", ".5", ".999"):
                text = f"{'-' if n < 0 else ''}{abs(n)}{fraction}"
                if _is_grammar_accept_string(grammar, text):
                    assert valid(text), text


def test_bounds_nothing_can_satisfy_are_a_clear_error(gemma3_compiler):
    tool = Tool("t", "", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 4}}})
    with pytest.raises(ChatError, match=r"tools\[0\] \(t\): no integer satisfies minimum/maximum"):
        tool_call_grammar(gemma3_compiler, "gemma3", [tool], "required", parallel=False)


@pytest.mark.parametrize("parallel, most", [(False, 1), (True, MAX_PARALLEL_CALLS)])
def test_number_of_calls_is_capped(gemma3_compiler, gemma3_tokenizer, parallel, most):
    grammar = tool_call_grammar(gemma3_compiler, "gemma3", [BOUNDED], "required", parallel=parallel)
    block = gemma3_block("bash", {"command": "ls", "timeout": 5})
    _, refused, matcher = accepted_prefix(grammar, gemma3_tokenizer, "\n\n".join([block] * most))
    assert refused is None and can_stop(matcher, gemma3_tokenizer)
    _, refused, _ = accepted_prefix(grammar, gemma3_tokenizer, "\n\n".join([block] * (most + 1)))
    assert refused is not None


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_a_flat_object_of_many_properties_compiles_and_past_the_cap_is_refused_as_such(family, request):
    """5,000 properties were refused as "refers to itself without end": the members' grammar recursed once a
    property (and grew with their square). It is linear now, and a call naming a few of MAX_SCHEMA_PROPERTIES
    passes; past that cap xgrammar's compile would take minutes, and the refusal says so."""
    compiler = request.getfixturevalue(f"{family}_compiler")
    tokenizer = request.getfixturevalue(f"{family}_tokenizer")
    last = f"p{MAX_SCHEMA_PROPERTIES - 1}"
    wide = Tool("wide", "", {"type": "object", "required": [last],
                             "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_SCHEMA_PROPERTIES)}})
    grammar = tool_call_grammar(compiler, family, [wide], "required", parallel=False)
    def render(arguments):
        return gemma4_call("wide", arguments) if family == "gemma4" else gemma3_call(ToolCall("1", "wide", arguments))

    # in the order the grammar takes keys: Gemma 4's template sorts them, Gemma 3 keeps the schema's
    assert accepted_prefix(grammar, tokenizer, render({last: 2, "p7": 1} if family == "gemma4" else
                                                      {"p7": 1, last: 2}))[1] is None
    assert accepted_prefix(grammar, tokenizer, render({"p7": 1}))[1] is not None
    wider = Tool("wider", "", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}})
    with pytest.raises(ChatError, match=f"more than {MAX_SCHEMA_PROPERTIES} object properties in all") as err:
        tool_call_grammar(compiler, family, [wider], "required", parallel=False)
    assert err.value.param == "tools[0]" and "5000 in one object" in str(err.value)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_too_deep_a_schema_is_refused_for_what_it_is(family, request):
    compiler = request.getfixturevalue(f"{family}_compiler")
    deep = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ChatError, match="nests deeper than 64 levels"):
        tool_call_grammar(compiler, family, [Tool("deep", "", deep)], "required", parallel=False)
