"""Property tests: random tool-call arguments survive serializer -> streaming parser, in any
chunking, and the argument fragments spell out the parsed arguments as JSON.

What the Gemma 4 syntax cannot carry is excluded here, and only that (see format_tool_call):
strings containing `<|"|>` (no escape exists), keys that are ambiguous as bare keys, and
non-finite floats (the template prints `inf`/`nan`, which are not JSON).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import dflash_agent.templates
from dflash_agent.chat.gemma4_syntax import (
    FRAME_MARKERS,
    STRING_DELIM,
    format_tool_call,
)
from dflash_agent.chat.parser import (
    ParsedOutput,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallStart,
    make_parser,
)

PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

MARKERS = (STRING_DELIM, *FRAME_MARKERS)
# Pieces that stress the syntax: delimiters, marker look-alikes, JSON escapes.
TRICKY = ["<", ">", "|", '"', "'", "{", "}", "[", "]", ":", ",", "\\", "\n", "\t", " ", "<|",
          "|>", '<|"', '"|>', "<tool_call|>", "<|tool_call>", "<turn|>", "<|channel>",
          "<channel|>", "<eos>", "null", "true", "1e5", "é", "☃", "\u2028", "\x00"]


def _text(max_size: int = 6) -> st.SearchStrategy[str]:
    piece = st.one_of(st.text(max_size=4), st.sampled_from(TRICKY))
    return st.lists(piece, max_size=max_size).map("".join)


gemma4_strings = _text().filter(lambda s: STRING_DELIM not in s)
# Bare keys end at ":" and may not hold structure characters, markers or outer whitespace.
gemma4_keys = (
    _text(4)
    .map(lambda s: "".join(c for c in s if c not in ":{}[],").strip())
    .filter(lambda k: not any(m in k for m in MARKERS))
)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**80), 2**80), finite_floats, gemma4_strings
)


def json_values(keys: st.SearchStrategy[str], leaves: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
        max_leaves=12,
    )


gemma4_arguments = st.dictionaries(gemma4_keys, json_values(gemma4_keys, scalars), max_size=5)
tool_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,20}", fullmatch=True)
# Content and reasoning: anything without a special token in it.
plain_text = _text().filter(lambda s: not any(m in s for m in FRAME_MARKERS))


def canonical(value) -> str:
    """JSON with sorted keys: tells True from 1 and 1.0 from 1, unlike ==."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def feed_in_chunks(family: str, text: str, cuts: list[int]) -> tuple[list, ParsedOutput]:
    counter = itertools.count()
    parser = make_parser(family, id_factory=lambda: f"call_{next(counter)}")
    bounds = [0, *sorted(set(cuts)), len(text)]
    deltas = [d for a, b in itertools.pairwise(bounds) for d in parser.feed(text[a:b])]
    deltas += parser.finish()
    return deltas, parser.result()


def assert_deltas_fold_to(deltas: list, result: ParsedOutput) -> None:
    """The stream says what the result says: text, reasoning, and per call the start first,
    then fragments that concatenate to the compact JSON of the arguments."""
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == result.content
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    assert (reasoning or None) == result.reasoning
    starts = [d for d in deltas if isinstance(d, ToolCallStart)]
    assert [(s.index, s.id, s.name) for s in starts] == [
        (i, c.id, c.name) for i, c in enumerate(result.tool_calls)
    ]
    for i, call in enumerate(result.tool_calls):
        start = deltas.index(starts[i])
        positions = [
            p for p, d in enumerate(deltas) if isinstance(d, ToolCallArgsDelta) and d.index == i
        ]
        assert all(p > start for p in positions)
        assert "".join(deltas[p].fragment for p in positions) == compact(call.arguments)


# --- Gemma 4 ----------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(name=tool_names, arguments=gemma4_arguments)
def test_gemma4_round_trip(name, arguments):
    result = feed_in_chunks("gemma4", format_tool_call(name, arguments), [])[1]
    assert [c.name for c in result.tool_calls] == [name]
    assert canonical(result.tool_calls[0].arguments) == canonical(arguments)
    assert result.content == "" and result.reasoning is None


@PROPERTY_SETTINGS
@given(
    calls=st.lists(st.tuples(tool_names, gemma4_arguments), min_size=1, max_size=3),
    before=plain_text,
    thought=plain_text,
    after=plain_text,
    data=st.data(),
)
def test_gemma4_streaming_in_any_chunking(calls, before, thought, after, data):
    text = (
        f"<|channel>thought\n{thought}<channel|>{before}"
        + "".join(format_tool_call(name, arguments) for name, arguments in calls)
        + after
    )
    whole_deltas, whole = feed_in_chunks("gemma4", text, [])
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=25))
    deltas, result = feed_in_chunks("gemma4", text, cuts)

    assert result == whole
    assert result.content == before + after
    assert result.reasoning == (thought or None)
    assert [(c.name, canonical(c.arguments)) for c in result.tool_calls] == [
        (name, canonical(arguments)) for name, arguments in calls
    ]
    assert_deltas_fold_to(deltas, result)
    assert_deltas_fold_to(whole_deltas, whole)


@PROPERTY_SETTINGS
@given(
    text=st.lists(
        st.sampled_from([*MARKERS, *TRICKY, "call:f{", "thought\n", "a", "1"]), max_size=30
    ).map("".join),
    data=st.data(),
)
def test_gemma4_never_raises_on_junk(text, data):
    """Arbitrary marker soup: no exception, chunking does not matter, and the deltas are still
    well-formed JSON per call."""
    prefix = data.draw(st.sampled_from(["", "<|tool_call>call:f{", "<|channel>"]))
    cuts = data.draw(st.lists(st.integers(0, len(prefix + text)), max_size=10))
    deltas, result = feed_in_chunks("gemma4", prefix + text, cuts)
    assert result == feed_in_chunks("gemma4", prefix + text, [])[1]
    assert_deltas_fold_to(deltas, result)


def _contains_none(value) -> bool:
    if isinstance(value, dict):
        return any(_contains_none(v) for v in value.values())
    if isinstance(value, list):
        return any(_contains_none(v) for v in value)
    return value is None


# The templates format_tool_call must agree with: ours, and Google's (May 2026) reference where
# this checkout has it. Google's prints a null as Jinja's `None`; ours, like Google's July
# template, prints `null`, and so does format_tool_call.
TEMPLATES = {
    "ours": (Path(dflash_agent.templates.__file__).parent / "gemma4.jinja", True),
    "google": (Path(__file__).resolve().parents[1] / "fixtures" / "google_gemma4_chat_template.jinja", False),
}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def gemma4_template(request):
    path, renders_null = TEMPLATES[request.param]
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(path.read_text(encoding="utf-8")), renders_null


@settings(max_examples=40, deadline=None)
@given(name=tool_names, arguments=gemma4_arguments)
def test_format_tool_call_matches_the_template(gemma4_template, name, arguments):
    template, renders_null = gemma4_template
    assume(renders_null or not _contains_none(arguments))
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [call]}]
    rendered = template.render(messages=messages, bos_token="<bos>")
    start = rendered.index("<|tool_call>")
    end = rendered.rindex("<tool_call|>") + len("<tool_call|>")
    assert format_tool_call(name, arguments) == rendered[start:end]


# --- Gemma 3 fenced JSON ----------------------------------------------------------------------

json_keys = st.text(max_size=6)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**80), 2**80), finite_floats, _text()
)
json_arguments = st.dictionaries(json_keys, json_values(json_keys, json_scalars), max_size=5)
# Prose lines that cannot open a fence, and ordinary code blocks.
prose_lines = st.lists(
    _text(4).map(lambda s: s.replace("\n", " ").lstrip(" `~") + "\n"), max_size=3
)
code_blocks = st.builds(
    lambda info, body: f"```{info}\n{body}\n```\n",
    st.sampled_from(["", "python", "json", "bash"]),
    _text(4).map(lambda s: s.replace("`", "'")),
)
gemma3_text = st.lists(prose_lines.map("".join) | code_blocks, max_size=3).map("".join)


@PROPERTY_SETTINGS
@given(
    calls=st.lists(st.tuples(tool_names, json_arguments), min_size=1, max_size=3),
    texts=st.lists(gemma3_text, min_size=4, max_size=4),
    indent=st.sampled_from([None, 2]),
    ascii_only=st.booleans(),
    data=st.data(),
)
def test_gemma3_fenced_round_trip_in_any_chunking(calls, texts, indent, ascii_only, data):
    blocks = [
        "```tool_call\n"
        + json.dumps({"name": name, "arguments": arguments}, indent=indent, ensure_ascii=ascii_only)
        + "\n```\n"
        for name, arguments in calls
    ]
    text = "".join(t + b for t, b in zip(texts, blocks, strict=False)) + texts[-1]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=25))
    deltas, result = feed_in_chunks("gemma3", text, cuts)

    assert result == feed_in_chunks("gemma3", text, [])[1]
    # Blank lines after a call are the separator before the next block (or the end), not content.
    after_calls = [*texts[1 : len(blocks)], texts[-1]]
    assert result.content == texts[0] + "".join(t for t in after_calls if t.strip(" \t\r\n"))
    assert [(c.name, canonical(c.arguments)) for c in result.tool_calls] == [
        (name, canonical(arguments)) for name, arguments in calls
    ]
    assert_deltas_fold_to(deltas, result)


@PROPERTY_SETTINGS
@given(
    text=st.lists(
        st.sampled_from(["```", "~~~", "tool_call", "python", "\n", " ", "{", "}", '"name"', ":",
                         '"f"', ",", '"arguments"', "{}", "x", "`"]),
        max_size=40,
    ).map("".join),
    data=st.data(),
)
def test_gemma3_never_raises_on_junk(text, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    deltas, result = feed_in_chunks("gemma3", text, cuts)
    assert result == feed_in_chunks("gemma3", text, [])[1]
    assert_deltas_fold_to(deltas, result)
