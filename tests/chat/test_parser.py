"""Unit tests for the output parsers and the Gemma 4 tool-call serializer."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from dflash_agent.chat import gemma3_tools
from dflash_agent.chat.constraints import MAX_PARALLEL_CALLS
from dflash_agent.chat.gemma4_syntax import format_tool_call, format_value
from dflash_agent.chat.parser import (
    FencedToolCallParser,
    Gemma4OutputParser,
    ParsedOutput,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallStart,
    make_parser,
)
from dflash_agent.chat.types import ToolCall


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def run(family: str, text: str, chunk: int | None = None) -> tuple[list, ParsedOutput]:
    parser = make_parser(family, id_factory=_ids())
    pieces = [text] if chunk is None else [text[i : i + chunk] for i in range(0, len(text), chunk)]
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
    return deltas, parser.result()


def parse(family: str, text: str) -> ParsedOutput:
    return run(family, text)[1]


def arguments_json(deltas: list, index: int) -> str:
    return "".join(
        d.fragment for d in deltas if isinstance(d, ToolCallArgsDelta) and d.index == index
    )


# --- serializer -------------------------------------------------------------------------------

# (name, arguments, rendering) from tests/fixtures/gemma4_chat.json: the spans that Google's
# template (tests/fixtures/google_gemma4_chat_template.jinja) rendered for these calls.
TEMPLATE_RENDERINGS = [
    ("read_file", {"path": "README.md", "limit": 20}, '<|tool_call>call:read_file{limit:20,path:<|"|>README.md<|"|>}<tool_call|>'),
    ("read_file", {"path": "a.py"}, '<|tool_call>call:read_file{path:<|"|>a.py<|"|>}<tool_call|>'),
    ("read_file", {"path": "b.py", "offset": 3}, '<|tool_call>call:read_file{offset:3,path:<|"|>b.py<|"|>}<tool_call|>'),
    ("bash", {"command": "pytest -q", "timeout": 60}, '<|tool_call>call:bash{command:<|"|>pytest -q<|"|>,timeout:60}<tool_call|>'),
    ("edit_file", {"path": "m.py", "old_string": "a-b", "new_string": "a+b"}, '<|tool_call>call:edit_file{new_string:<|"|>a+b<|"|>,old_string:<|"|>a-b<|"|>,path:<|"|>m.py<|"|>}<tool_call|>'),
    ("edit_file", {"path": "src/a \"quoted\" {brace}.py", "old_string": "if x:\n    return '\\\\n'\n", "new_string": "if x:\n    return été  # café ☃\n", "replace_all": False}, '<|tool_call>call:edit_file{new_string:<|"|>if x:\n    return été  # café ☃\n<|"|>,old_string:<|"|>if x:\n    return \'\\\\n\'\n<|"|>,path:<|"|>src/a "quoted" {brace}.py<|"|>,replace_all:false}<tool_call|>'),
    ("bash", {"command": "make test", "env": {"name": "CI", "value": "1"}, "files": ["Makefile", "src/x.c"], "timeout": 2.5, "mode": "foreground"}, '<|tool_call>call:bash{command:<|"|>make test<|"|>,env:{name:<|"|>CI<|"|>,value:<|"|>1<|"|>},files:[<|"|>Makefile<|"|>,<|"|>src/x.c<|"|>],mode:<|"|>foreground<|"|>,timeout:2.5}<tool_call|>'),
    ("bash", {"command": "make"}, '<|tool_call>call:bash{command:<|"|>make<|"|>}<tool_call|>'),
]


@pytest.mark.parametrize(("name", "arguments", "rendered"), TEMPLATE_RENDERINGS)
def test_format_tool_call_matches_template_fixtures(name, arguments, rendered):
    assert format_tool_call(name, arguments) == rendered


@pytest.mark.parametrize(("name", "arguments", "rendered"), TEMPLATE_RENDERINGS)
def test_fixture_renderings_parse_back(name, arguments, rendered):
    result = parse("gemma4", rendered)
    assert result.tool_calls == [ToolCall("call_0", name, arguments)]
    assert result.content == "" and result.reasoning is None


def test_format_value_follows_jinja():
    # dictsort compares keys lower-cased and keeps ties in order; Jinja prints floats with
    # str(); None is null, as in Google's July template and ours.
    value = {"b": None, "B": 1, "_": [1e16, 0.1, -0.0, 2.0], "a": {"z": True, "Y": []}, "c": {}}
    assert format_value(value) == "{_:[1e+16,0.1,-0.0,2.0],a:{Y:[],z:true},b:null,B:1,c:{}}"
    assert format_tool_call("f", {}) == "<|tool_call>call:f{}<tool_call|>"


# --- Gemma 4 parser ---------------------------------------------------------------------------

REASONING_CONTENT_TWO_CALLS = (
    "<|channel>thought\nThe user wants a < b and {x}.<channel|>"
    "Let me look.<|tool_call>call:read_file{path:<|\"|>a.py<|\"|>}<tool_call|>"
    "<|tool_call>call:bash{command:<|\"|>ls -l<|\"|>,timeout:2.5}<tool_call|>"
)


def test_reasoning_content_and_two_calls():
    deltas, result = run("gemma4", REASONING_CONTENT_TWO_CALLS)
    assert result == ParsedOutput(
        content="Let me look.",
        reasoning="The user wants a < b and {x}.",
        tool_calls=[
            ToolCall("call_0", "read_file", {"path": "a.py"}),
            ToolCall("call_1", "bash", {"command": "ls -l", "timeout": 2.5}),
        ],
    )
    assert [d for d in deltas if isinstance(d, ToolCallStart)] == [
        ToolCallStart(0, "call_0", "read_file"),
        ToolCallStart(1, "call_1", "bash"),
    ]
    assert arguments_json(deltas, 0) == '{"path":"a.py"}'
    assert arguments_json(deltas, 1) == '{"command":"ls -l","timeout":2.5}'
    # The order of the stream: reasoning, then text, then each call's start before its args.
    kinds = [type(d).__name__ for d in deltas]
    assert kinds.index("ReasoningDelta") < kinds.index("TextDelta") < kinds.index("ToolCallStart")


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 13])
def test_any_chunking_gives_the_same_result(chunk):
    assert run("gemma4", REASONING_CONTENT_TWO_CALLS, chunk)[1] == parse(
        "gemma4", REASONING_CONTENT_TWO_CALLS
    )


def test_markers_split_at_every_point():
    text = 'Hi<|channel>thought\nhm<channel|>ok<|tool_call>call:f{a:<|"|>x<|"|>}<tool_call|>'
    expected = parse("gemma4", text)
    for cut in range(len(text) + 1):
        parser = Gemma4OutputParser(id_factory=_ids())
        parser.feed(text[:cut])
        parser.feed(text[cut:])
        parser.finish()
        assert parser.result() == expected, cut
    assert expected.content == "Hiok" and expected.reasoning == "hm"


def test_arguments_stream_before_the_call_ends():
    parser = Gemma4OutputParser(id_factory=_ids())
    text = '<|tool_call>call:write_file{path:<|"|>a.txt<|"|>,content:<|"|>' + "line\n" * 20
    deltas = [d for i in range(0, len(text), 8) for d in parser.feed(text[i : i + 8])]
    fragments = [d.fragment for d in deltas if isinstance(d, ToolCallArgsDelta)]
    assert deltas[0] == ToolCallStart(0, "call_0", "write_file")
    assert len(fragments) > 10
    assert "".join(fragments) == '{"path":"a.txt","content":"' + "line\\n" * 20
    parser.feed('<|"|>}<tool_call|>')
    parser.finish()
    assert parser.result().tool_calls[0].arguments["content"] == "line\n" * 20


def test_text_with_angle_brackets_is_content():
    text = "Use a <div> or List<int> when x<y, a <|b> or <eos token>; |> and <|| too <"
    deltas, result = run("gemma4", text, 1)
    assert result.content == text
    assert all(isinstance(d, TextDelta) for d in deltas)


def test_empty_thought_channel_is_dropped():
    result = parse("gemma4", "<|channel>thought\n<channel|>Hello<channel|>.")
    assert result == ParsedOutput("Hello.", None, [])
    assert parse("gemma4", "<|channel><channel|>Hi").content == "Hi"
    assert parse("gemma4", "<|channel>thought<channel|>Hi") == ParsedOutput("Hi", None, [])


def test_channel_without_label_is_all_reasoning():
    assert parse("gemma4", "<|channel>Let me see.<channel|>Yes").reasoning == "Let me see."


def test_prompt_ending_inside_the_thought_channel():
    parser = Gemma4OutputParser(id_factory=_ids(), in_reasoning=True)
    assert parser.feed("plan<chan") == [ReasoningDelta("plan")]
    assert parser.feed("nel|>done") == [TextDelta("done")]
    parser.finish()
    assert parser.result() == ParsedOutput("done", "plan", [])


@pytest.mark.parametrize("end", ["<turn|>", "<|tool_response>", "<eos>"])
def test_end_token_in_place_of_tool_call_close(end):
    result = parse("gemma4", '<|tool_call>call:f{a:1,b:<|"|>x<|"|>}' + end + "response:f{}")
    assert result == ParsedOutput("", None, [ToolCall("call_0", "f", {"a": 1, "b": "x"})])


def test_end_token_inside_the_arguments_closes_the_call():
    result = parse("gemma4", "<|tool_call>call:f{a:{b:[1,2<turn|>trailing")
    assert result.tool_calls[0].arguments == {"a": {"b": [1, 2]}}
    assert result.content == ""


@pytest.mark.parametrize(
    ("tail", "arguments"),
    [
        ('a:<|"|>hel', {"a": "hel"}),
        ("a:12", {"a": 12}),
        ("a:1,b", {"a": 1}),
        ("a:1,b:", {"a": 1}),
        ("a:[1,{c:tru", {"a": [1, {"c": "tru"}]}),
        ("a:[1,{c:true", {"a": [1, {"c": True}]}),
        ("", {}),
    ],
)
def test_end_of_stream_mid_call_closes_it(tail, arguments):
    deltas, result = run("gemma4", "<|tool_call>call:f{" + tail, 1)
    assert result.tool_calls == [ToolCall("call_0", "f", arguments)]
    assert json.loads(arguments_json(deltas, 0)) == arguments


def test_text_after_calls_and_between_them():
    text = 'A<|tool_call>call:f{}<tool_call|>B<|tool_call>call:g{x:<|"|><|"|>}<tool_call|>C'
    result = parse("gemma4", text)
    assert result.content == "ABC"
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", {}), ("g", {"x": ""})]


def test_text_after_an_end_token_is_ignored():
    assert parse("gemma4", "Done.<turn|>\n<|turn>user\nmore") == ParsedOutput("Done.", None, [])


def test_string_values_keep_other_markers_verbatim():
    value = "x}<tool_call|><turn|><|channel>\\n\"{a:b}\"\n\ttab"
    result = parse("gemma4", format_tool_call("write", {"s": value}))
    assert result.tool_calls[0].arguments == {"s": value}


def test_bare_values():
    text = (
        "<|tool_call>call:f{a:null,b:None,c:,d: 7 ,e:-0.5e3,f:007,g:hello world,h:1e999,"
        "i:123456789012345678901234567890,j:True,k:[],l:[1,]}<tool_call|>"
    )
    assert parse("gemma4", text).tool_calls[0].arguments == {
        "a": None, "b": None, "c": None, "d": 7, "e": -500.0, "f": "007", "g": "hello world",
        "h": "1e999", "i": 123456789012345678901234567890, "j": True, "k": [], "l": [1],
    }


def test_tolerated_variants_of_the_syntax():
    text = '<|tool_call> f{ <|"|>quoted key<|"|> : 1 , b : [ 2 , 3 ] , }<tool_call|>'
    arguments = {"quoted key": 1, "b": [2, 3]}
    assert parse("gemma4", text).tool_calls == [ToolCall("call_0", "f", arguments)]


def test_a_bad_header_is_content(caplog):
    text = '<|tool_call>call:search(query: "x")<tool_call|>ok'
    with caplog.at_level(logging.DEBUG, logger="dflash_agent.chat.parser"):
        result = parse("gemma4", text)
    assert result == ParsedOutput('<|tool_call>call:search(query: "x")ok', None, [])
    assert "not a tool call header" in caplog.text



@pytest.mark.parametrize("family, text", [
    ("gemma4", "see <|tool_call>"),
    ("gemma4", "see <|tool_call>call:read_fi"),
    ("gemma3", 'see\n```tool_call\n{"name": "read_f'),
])
def test_a_call_cut_by_the_token_limit_never_reaches_content(family, text):
    """The output ends inside a call's opening (max_tokens): the partial call is dropped, not shown as text."""
    assert parse(family, text) == ParsedOutput("see" + (" " if family == "gemma4" else "\n"), None, [])


FORCED_TWO_CALLS = (gemma3_tools.format_tool_call(ToolCall("a", "bash", {"command": "ls"})) + "\n\n"
                    + gemma3_tools.format_tool_call(ToolCall("b", "read_file", {"path": "a.py"})))


@pytest.mark.parametrize("cut", range(len(FORCED_TWO_CALLS) + 1))
def test_a_forced_turn_cut_anywhere_leaves_no_tool_syntax_in_content(cut):
    """A forced turn (the grammar writes blocks and their separators) cut by max_tokens at any character: the
    next call's opening fence (```tool) was shown as content."""
    result = parse("gemma3", FORCED_TWO_CALLS[:cut])
    assert result.content == ""
    names = [c.name for c in result.tool_calls]
    assert names == ["bash", "read_file"][: len(names)] and (cut < len(FORCED_TWO_CALLS) or len(names) == 2)


@pytest.mark.parametrize("tail", ["`", "``", "```", "```t", "```tool", "```tool_cal", "  ~~~tool"])
def test_the_end_inside_an_opening_fence_is_dropped_after_text_too(tail):
    assert parse("gemma3", "Let me look.\n" + tail) == ParsedOutput("Let me look.\n", None, [])


def test_blank_lines_after_a_call_are_content_only_before_text():
    call = gemma3_tools.format_tool_call(ToolCall("a", "ls", {}))
    # (the first newline ends the closing fence's line)
    assert parse("gemma3", f"{call}\n\n \nDone.\n").content == "\n \nDone.\n"
    assert parse("gemma3", f"{call}\n\n```python\nx\n```").content == "\n```python\nx\n```"
    assert parse("gemma3", f"{call}\n\n").content == ""
    assert parse("gemma3", "Start.\n\n```python\n").content == "Start.\n\n```python\n"  # an opened block stays


def test_bad_arguments_close_the_call_and_the_rest_is_content():
    deltas, result = run("gemma4", '<|tool_call>call:f{a:1]x}<tool_call|>Then text.')
    assert result.tool_calls == [ToolCall("call_0", "f", {"a": 1})]
    assert result.content == "]x}Then text."
    assert json.loads(arguments_json(deltas, 0)) == {"a": 1}


def test_a_repeated_key_is_malformed():
    deltas, result = run("gemma4", "<|tool_call>call:f{a:1,a:2}<tool_call|>")
    assert result.tool_calls[0].arguments == {"a": 1}
    assert arguments_json(deltas, 0) == '{"a":1}'
    assert result.content == ":2}"


def test_default_ids_are_unique():
    parser = make_parser("gemma4")
    parser.feed("<|tool_call>call:f{}<tool_call|>" * 3)
    parser.finish()
    ids = [c.id for c in parser.result().tool_calls]
    assert len(set(ids)) == 3 and all(i.startswith("call_") for i in ids)


def test_api_misuse():
    parser = make_parser("gemma4")
    with pytest.raises(RuntimeError):
        parser.result()
    parser.finish()
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("x")
    with pytest.raises(ValueError, match="llama"):
        make_parser("llama")


# --- Gemma 3 fenced JSON ----------------------------------------------------------------------

FENCED = (
    "I'll read it.\n"
    "```tool_call\n"
    '{"name": "read_file", "arguments": {"path": "a.py", "limit": 5}}\n'
    "```\n"
    "```tool_call\n"
    "{\n"
    '  "name": "bash",\n'
    '  "arguments": {\n'
    '    "command": "echo \\"```\\""\n'
    "  }\n"
    "}\n"
    "```\n"
    "Done.\n"
)


def test_fenced_calls():
    deltas, result = run("gemma3", FENCED)
    assert result == ParsedOutput(
        "I'll read it.\nDone.\n",
        None,
        [
            ToolCall("call_0", "read_file", {"path": "a.py", "limit": 5}),
            ToolCall("call_1", "bash", {"command": 'echo "```"'}),
        ],
    )
    assert arguments_json(deltas, 0) == '{"path":"a.py","limit":5}'
    assert arguments_json(deltas, 1) == '{"command":"echo \\"```\\""}'


def test_fenced_calls_as_gemma3_history_writes_them():
    calls = [
        ToolCall("call_0", "grep", {"pattern": "a\n```", "glob": "*.py"}),
        ToolCall("call_1", "ls", {}),
    ]
    text = "Searching.\n" + "\n".join(gemma3_tools.format_tool_call(c) for c in calls)
    assert parse("gemma3", text) == ParsedOutput("Searching.\n", None, calls)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_fenced_chunking(chunk):
    assert run("gemma3", FENCED, chunk)[1] == parse("gemma3", FENCED)


def test_other_code_blocks_are_text():
    text = (
        "```python\nprint('```tool_call')\n```\n"
        "````markdown\n```tool_call\n{\"name\": \"f\", \"arguments\": {}}\n```\n````\n"
        "~~~\n```tool_call\n~~~\n"
        "Inline ```tool_call``` is not a fence.\n"
        "    ```tool_call\n"
    )
    deltas, result = run("gemma3", text, 3)
    assert result == ParsedOutput(text, None, [])
    assert all(isinstance(d, TextDelta) for d in deltas)


def test_plain_lines_stream_without_waiting_for_the_newline():
    parser = FencedToolCallParser(id_factory=_ids())
    assert parser.feed("Hello wor") == [TextDelta("Hello wor")]
    assert parser.feed("ld\n``") == [TextDelta("ld\n")]  # a fence may be starting: held
    assert parser.feed("`python\n") == [TextDelta("```python\n")]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "f", "arguments": {"a": 1}',  # truncated JSON
        '{"arguments": {"a": 1}}',  # no name
        '{"name": "f", "arguments": [1]}',  # arguments not an object
        '{"name": "f", "arguments": {"a": NaN}}',  # not representable as JSON
        "[]",
        "",
    ],
)
def test_invalid_fenced_call_is_text(body):
    text = f"Before\n```tool_call\n{body}\n```\nAfter"
    assert parse("gemma3", text) == ParsedOutput(text, None, [])


def test_fenced_variants():
    text = (
        '``` tool_call \n{"name": "f", "arguments": "{\\"a\\": 1}"}\n````\n'
        '~~~tool_call\n{"name": "g"}\n~~~\n'
        '  ```tool_call\n{"name": "h", "arguments": {}}'  # unclosed at the end of the stream
    )
    result = parse("gemma3", text)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [
        ("f", {"a": 1}),
        ("g", {}),
        ("h", {}),
    ]
    assert result.content == ""


@pytest.mark.parametrize("family", ["gemma4", "gemma3"])
@pytest.mark.parametrize("parallel, kept", [(False, 1), (True, MAX_PARALLEL_CALLS)])
def test_calls_past_the_cap_are_dropped(family, parallel, kept):
    from dflash_agent.chat.chat_format import PreparedChat

    calls = [ToolCall(f"c{i}", "bash", {"command": f"echo {i}"}) for i in range(MAX_PARALLEL_CALLS + 5)]
    if family == "gemma4":
        text = "".join(format_tool_call(c.name, c.arguments) for c in calls)
    else:
        text = "\n\n".join(gemma3_tools.format_tool_call(c) for c in calls)
    prepared = PreparedChat("", [], None, frozenset(), family, 1 if not parallel else MAX_PARALLEL_CALLS)
    parser = prepared.parser()
    deltas = parser.feed(text) + parser.finish()
    result = parser.result()
    assert [c.arguments for c in result.tool_calls] == [c.arguments for c in calls[:kept]]
    assert max(d.index for d in deltas if hasattr(d, "index")) == kept - 1
