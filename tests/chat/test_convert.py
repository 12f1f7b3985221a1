"""OpenAI and Anthropic request bodies into the canonical conversation: what each field becomes, that
one conversation in both dialects converts (and renders) identically, and a specific ChatError for
every malformed input."""

from __future__ import annotations

import copy
import json

import pytest

from dflash_agent.chat.anthropic_messages import (
    conversation_from_anthropic,
    tools_from_anthropic,
)
from dflash_agent.chat.openai_messages import (
    conversation_from_openai,
    messages_from_openai,
    tools_from_openai,
)
from dflash_agent.chat.template import builtin_template
from dflash_agent.chat.types import (
    ChatError,
    Conversation,
    Message,
    TextPart,
    Tool,
    ToolCall,
)

READ_FILE_SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string", "description": "File path."}, "limit": {"type": "integer"}},
    "required": ["path"],
}
BASH_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}

# One agent session (system prompt, reasoning, text with parallel calls, results, a second round, a
# final answer and a follow-up), spelled the OpenAI way and the Anthropic way.
OPENAI_MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Why does the test fail?"},
    {
        "role": "assistant",
        "content": "Let me look at both files.",
        "reasoning_content": "I need the source and the test.",
        "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "m.py", "limit": 50}'}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "test_m.py"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "toolu_1", "content": "def add(a, b):\n    return a - b\n"},
    {"role": "tool", "tool_call_id": "toolu_2", "content": "assert add(1, 2) == 3"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "toolu_3", "type": "function",
                        "function": {"name": "bash", "arguments": '{"command": "pytest -q"}'}}],
    },
    {"role": "tool", "tool_call_id": "toolu_3", "content": "1 failed"},
    {"role": "assistant", "content": "`add` subtracts; it should use `+`."},
    {"role": "user", "content": "Fix it."},
]
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                      "parameters": READ_FILE_SCHEMA}},
    {"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": BASH_SCHEMA}},
]

ANTHROPIC_SYSTEM = [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]
ANTHROPIC_MESSAGES = [
    {"role": "user", "content": "Why does the test fail?"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "I need the source and the test.", "signature": ""},
            {"type": "text", "text": "Let me look at both files."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "m.py", "limit": 50}},
            {"type": "tool_use", "id": "toolu_2", "name": "read_file", "input": {"path": "test_m.py"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "def add(a, b):\n    return a - b\n"},
            {"type": "tool_result", "tool_use_id": "toolu_2",
             "content": [{"type": "text", "text": "assert add(1, 2) == 3"}]},
        ],
    },
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3", "name": "bash",
                                       "input": {"command": "pytest -q"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3", "content": "1 failed"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "`add` subtracts; it should use `+`."}]},
    {"role": "user", "content": [{"type": "text", "text": "Fix it."}]},
]
ANTHROPIC_TOOLS = [
    {"name": "read_file", "description": "Read a file.", "input_schema": READ_FILE_SCHEMA},
    {"name": "bash", "description": "Run a command.", "input_schema": BASH_SCHEMA},
]


def test_openai_conversation_in_canonical_form():
    conv = conversation_from_openai(OPENAI_MESSAGES, OPENAI_TOOLS)
    assert [m.role for m in conv.messages] == [
        "system", "user", "assistant", "tool", "tool", "assistant", "tool", "assistant", "user"]
    assistant = conv.messages[2]
    assert assistant.content == [TextPart("Let me look at both files.")]
    assert assistant.reasoning == "I need the source and the test."
    assert assistant.tool_calls == [
        ToolCall("toolu_1", "read_file", {"path": "m.py", "limit": 50}),
        ToolCall("toolu_2", "read_file", {"path": "test_m.py"}),
    ]
    # A result's function is named by the call it answers.
    assert conv.messages[4] == Message(role="tool", content=[TextPart("assert add(1, 2) == 3")],
                                       tool_call_id="toolu_2", name="read_file")
    assert conv.messages[5].content == []  # content: null beside tool calls
    assert conv.tools == [Tool("read_file", "Read a file.", READ_FILE_SCHEMA),
                          Tool("bash", "Run a command.", BASH_SCHEMA)]


def test_anthropic_and_openai_forms_are_one_conversation():
    from_openai = conversation_from_openai(OPENAI_MESSAGES, OPENAI_TOOLS)
    from_anthropic = conversation_from_anthropic(ANTHROPIC_MESSAGES, ANTHROPIC_SYSTEM, ANTHROPIC_TOOLS)
    assert from_anthropic == from_openai


@pytest.mark.parametrize("family", ["gemma4", "gemma3"])
@pytest.mark.parametrize("thinking", [False, True])
def test_both_forms_render_identically(family, thinking):
    from dflash_agent.chat.template import RenderOptions

    template = builtin_template(family)
    options = RenderOptions(enable_thinking=thinking)
    from_openai = template.render(conversation_from_openai(OPENAI_MESSAGES, OPENAI_TOOLS), options)
    from_anthropic = template.render(
        conversation_from_anthropic(ANTHROPIC_MESSAGES, ANTHROPIC_SYSTEM, ANTHROPIC_TOOLS), options)
    assert from_openai == from_anthropic
    assert "return a - b" in from_openai and "pytest -q" in from_openai


def test_tool_chain_reasoning_survives_both_forms():
    """The reasoning of the current tool chain (after the last user message) is rendered back, from
    `reasoning_content` as from a thinking block."""
    messages = OPENAI_MESSAGES[:5]
    anthropic = ANTHROPIC_MESSAGES[:3]
    template = builtin_template("gemma4")
    rendered = template.render(conversation_from_openai(messages, OPENAI_TOOLS))
    assert rendered == template.render(conversation_from_anthropic(anthropic, ANTHROPIC_SYSTEM, ANTHROPIC_TOOLS))
    assert "<|channel>thought\nI need the source and the test.\n<channel|>Let me look at both files." in rendered


# --- OpenAI details ---------------------------------------------------------------------------------------


def test_openai_content_parts_roles_and_reasoning_names():
    messages = messages_from_openai([
        {"role": "developer", "content": [{"type": "text", "text": "Be terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
                                     {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}], "reasoning": "vLLM's name"},
        {"role": "user", "content": ""},
    ])
    assert messages[0] == Message(role="developer", content=[TextPart("Be terse.")])
    assert messages[1].content == [TextPart("a"), TextPart("b")]  # empty parts carry nothing
    assert messages[2].content == [TextPart("No.")] and messages[2].reasoning == "vLLM's name"
    assert messages[3].content == []


@pytest.mark.parametrize("arguments, expected", [
    ('{"path": "a b", "n": [1, 2.5, null, true]}', {"path": "a b", "n": [1, 2.5, None, True]}),
    ({"already": "decoded"}, {"already": "decoded"}),
    ("", {}),
    (None, {}),
    ('{"nested": {"é": "☃"}}', {"nested": {"é": "☃"}}),
])
def test_openai_arguments(arguments, expected):
    message = messages_from_openai([{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}])[0]
    assert message.tool_calls == [ToolCall("c", "f", expected)]


def test_openai_tool_without_parameters_takes_none():
    assert tools_from_openai([{"type": "function", "function": {"name": "now"}}]) == [
        Tool("now", "", {"type": "object", "properties": {}})]
    assert tools_from_openai(None) == []


# --- Anthropic details ------------------------------------------------------------------------------------


def test_anthropic_tool_results_come_before_the_user_text():
    conv = conversation_from_anthropic([
        {"role": "user", "content": "Run it."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Here you go."},
            {"type": "tool_result", "tool_use_id": "t1", "content": "boom", "is_error": True},
        ]},
    ], system="Be careful.")
    assert conv.messages == [
        Message(role="system", content=[TextPart("Be careful.")]),
        Message(role="user", content=[TextPart("Run it.")]),
        Message(role="assistant", tool_calls=[ToolCall("t1", "bash", {})]),
        Message(role="tool", content=[TextPart("Error: "), TextPart("boom")], tool_call_id="t1", name="bash"),
        Message(role="user", content=[TextPart("Here you go.")]),
    ]


def test_anthropic_thinking_blocks():
    conv = conversation_from_anthropic([
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "first", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "thinking", "thinking": "second", "signature": "s"},
            {"type": "text", "text": "A"},
        ]},
    ])
    assert conv.messages[1] == Message(role="assistant", content=[TextPart("A")], reasoning="first\nsecond")
    assert conv.tools == [] and tools_from_anthropic(None) == []


def test_anthropic_empty_system_adds_no_message():
    conv = conversation_from_anthropic([{"role": "user", "content": "hi"}], system=[])
    assert conv == Conversation(messages=[Message(role="user", content=[TextPart("hi")])])


# --- errors ------------------------------------------------------------------------------------------------


def _assistant_call(call_id="c1", arguments='{"x": 1}'):
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "f", "arguments": arguments}}]}


OPENAI_ERRORS = [
    ("not a list", {"messages": "hi"}, "messages", "must be an array"),
    ("empty", {"messages": []}, "messages", "must not be empty"),
    ("message not object", {"messages": ["hi"]}, "messages[0]", "must be an object"),
    ("no role", {"messages": [{"content": "x"}]}, "messages[0].role", "is required"),
    ("unknown role", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "unknown role 'bot'"),
    ("role not string", {"messages": [{"role": 3, "content": "x"}]}, "messages[0].role", "must be a string"),
    ("missing content", {"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
    ("content wrong type", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "must be an array, not number"),
    ("image", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:..."}}]}]},
     "messages[0].content[1]", "images are not supported"),
    ("audio", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0]", "'input_audio' is not supported"),
    ("part without type", {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages[0].content[0].type", "is required"),
    ("text part without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "is required"),
    ("tool first", {"messages": [{"role": "tool", "tool_call_id": "c1", "content": "r"}]},
     "messages[0].role", "must follow an assistant message with tool_calls"),
    ("tool after user", {"messages": [_assistant_call(), {"role": "tool", "tool_call_id": "c1", "content": "r"},
                                      {"role": "user", "content": "u"},
                                      {"role": "tool", "tool_call_id": "c1", "content": "r"}]},
     "messages[3].role", "must follow an assistant message with tool_calls"),
    ("unknown tool_call_id", {"messages": [_assistant_call(), {"role": "tool", "tool_call_id": "zz", "content": "r"}]},
     "messages[1].tool_call_id", "'zz' matches no tool call"),
    ("missing tool_call_id", {"messages": [_assistant_call(), {"role": "tool", "content": "r"}]},
     "messages[1].tool_call_id", "is required"),
    ("bad arguments JSON", {"messages": [{"role": "user", "content": "u"}, _assistant_call(arguments='{"x": ')]},
     "messages[1].tool_calls[0].function.arguments", "is not valid JSON"),
    ("arguments not an object", {"messages": [_assistant_call(arguments="[1, 2]")]},
     "messages[0].tool_calls[0].function.arguments", "must encode a JSON object, not array"),
    ("arguments wrong type", {"messages": [_assistant_call(arguments=7)]},
     "messages[0].tool_calls[0].function.arguments", "must be an object, not number"),
    ("call without id", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].id", "is required"),
    ("call without function", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0].function", "is required"),
    ("tool_calls not a list", {"messages": [{"role": "assistant", "tool_calls": {}}]},
     "messages[0].tool_calls", "must be an array"),
    ("reasoning not a string", {"messages": [{"role": "assistant", "content": "a", "reasoning_content": 1}]},
     "messages[0].reasoning_content", "must be a string"),
    ("tools not a list", {"messages": [{"role": "user", "content": "u"}], "tools": {}}, "tools", "must be an array"),
    ("tool of other type", {"messages": [{"role": "user", "content": "u"}], "tools": [{"type": "web_search"}]},
     "tools[0].type", "only 'function' tools"),
    ("tool without name", {"messages": [{"role": "user", "content": "u"}],
                           "tools": [{"type": "function", "function": {"parameters": {}}}]},
     "tools[0].function.name", "is required"),
    ("parameters not an object", {"messages": [{"role": "user", "content": "u"}],
                                  "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", "must be an object"),
]


@pytest.mark.parametrize("body, param, fragment", [c[1:] for c in OPENAI_ERRORS], ids=[c[0] for c in OPENAI_ERRORS])
def test_openai_errors(body, param, fragment):
    with pytest.raises(ChatError) as info:
        conversation_from_openai(body["messages"], body.get("tools"))
    assert info.value.param == param
    assert fragment in str(info.value)


def _tool_use(call_id="t1"):
    return {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": "bash", "input": {}}]}


def _tool_result(call_id="t1", **extra):
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": "ok", **extra}]}


ANTHROPIC_ERRORS = [
    ("developer role in messages", {"messages": [{"role": "user", "content": "a"},
                                                 {"role": "developer", "content": "s"}]},
     "messages[1].role", "use 'system'"),
    ("mid-conversation tool change", {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": [
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "f"}}]}]},
     "messages[1].content[0]", "mid-conversation tool changes are not supported"),
    ("bad clear_at", {"messages": [{"role": "user", "content": "a"},
                                   {"role": "system", "content": "s", "clear_at": "soon"}]},
     "messages[1].clear_at", "must be 'next_user_message' or 'never'"),
    ("pdf document", {"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": ""}}]}]},
     "messages[0].content[0].source.type", "only text documents are supported"),
    ("unknown role", {"messages": [{"role": "tool", "content": "a"}]}, "messages[0].role", "unknown role 'tool'"),
    ("missing content", {"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
    ("image", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     "messages[0].content[0]", "images are not supported"),
    ("container upload", {"messages": [{"role": "user", "content": [{"type": "container_upload", "file_id": "f"}]}]},
     "messages[0].content[0]", "'container_upload' is not supported"),
    ("image in tool result", {"messages": [
        {"role": "user", "content": "go"}, _tool_use(),
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "image", "source": {}}]}]}]},
     "messages[2].content[0].content[0]", "images are not supported"),
    ("result without call", {"messages": [{"role": "user", "content": "go"}, _tool_result()]},
     "messages[1].content[0]", "right after an assistant message with tool_use"),
    ("result to an older call", {"messages": [
        {"role": "user", "content": "go"}, _tool_use(), _tool_result(),
        {"role": "assistant", "content": "done"}, _tool_result()]},
     "messages[4].content[0]", "right after an assistant message with tool_use"),
    ("unknown tool_use_id", {"messages": [{"role": "user", "content": "go"}, _tool_use(), _tool_result("t9")]},
     "messages[2].content[0].tool_use_id", "'t9' matches no tool_use"),
    ("is_error not boolean", {"messages": [{"role": "user", "content": "go"}, _tool_use(),
                                           _tool_result(is_error="yes")]},
     "messages[2].content[0].is_error", "must be a boolean"),
    ("tool_use input not object", {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "bash", "input": '{"a": 1}'}]}]},
     "messages[0].content[0].input", "must be an object, not string"),
    ("tool_use without id", {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "name": "bash", "input": {}}]}]},
     "messages[0].content[0].id", "is required"),
    ("thinking without text", {"messages": [{"role": "assistant", "content": [{"type": "thinking"}]}]},
     "messages[0].content[0].thinking", "is required"),
    ("unknown assistant block", {"messages": [{"role": "assistant", "content": [{"type": "server_tool_use"}]}]},
     "messages[0].content[0]", "'server_tool_use' is not supported"),
    ("system not text", {"messages": [{"role": "user", "content": "a"}], "system": [{"type": "image"}]},
     "system[0]", "images are not supported"),
    ("system wrong type", {"messages": [{"role": "user", "content": "a"}], "system": 3}, "system", "must be an array"),
    ("tool without schema", {"messages": [{"role": "user", "content": "a"}], "tools": [{"name": "f"}]},
     "tools[0].input_schema", "is required"),
    ("server tool", {"messages": [{"role": "user", "content": "a"}],
                     "tools": [{"type": "bash_20250124", "name": "bash"}]},
     "tools[0].type", "only custom tools"),
]


@pytest.mark.parametrize("body, param, fragment", [c[1:] for c in ANTHROPIC_ERRORS],
                         ids=[c[0] for c in ANTHROPIC_ERRORS])
def test_anthropic_errors(body, param, fragment):
    with pytest.raises(ChatError) as info:
        conversation_from_anthropic(body["messages"], body.get("system"), body.get("tools"))
    assert info.value.param == param
    assert fragment in str(info.value)


def test_converters_leave_the_request_untouched():
    openai, anthropic = copy.deepcopy(OPENAI_MESSAGES), copy.deepcopy(ANTHROPIC_MESSAGES)
    conversation_from_openai(openai, OPENAI_TOOLS)
    conversation_from_anthropic(anthropic, ANTHROPIC_SYSTEM, ANTHROPIC_TOOLS)
    assert openai == OPENAI_MESSAGES and anthropic == ANTHROPIC_MESSAGES
    assert json.dumps(openai)  # still plain JSON


def test_anthropic_mid_conversation_system_messages():
    """Claude Code 2.1 (beta mid-conversation-system-2026-04-07): system entries between the turns."""
    conv = conversation_from_anthropic([
        {"role": "user", "content": "go"},
        {"role": "system", "content": [{"type": "text", "text": "Agents: a, b", "cache_control": {"type": "ephemeral"}}]},
        _tool_use(),
        {"role": "system", "content": "Reminder: be brief."},  # before the results: moved after them
        _tool_result(),
        {"role": "system", "content": "cleared by the next user message", "clear_at": "next_user_message"},
        {"role": "assistant", "content": "done"},
        {"role": "system", "content": "cleared", "clear_at": "next_user_message"},
        {"role": "user", "content": "next"},
        {"role": "system", "content": "", "output_config": {"effort": "low"}},
    ], system="S")
    assert [(m.role, m.text) for m in conv.messages] == [
        ("system", "S"), ("user", "go"), ("system", "Agents: a, b"), ("assistant", ""), ("tool", "ok"),
        ("system", "Reminder: be brief."), ("assistant", "done"), ("user", "next"),
    ]
    # A message cleared at the next user message shows while it is the last user turn's.
    last = conversation_from_anthropic([{"role": "user", "content": "go"},
                                        {"role": "system", "content": "now", "clear_at": "next_user_message"}])
    assert [m.text for m in last.messages] == ["go", "now"]


def test_anthropic_text_documents_search_results_compaction_and_fallback():
    conv = conversation_from_anthropic([
        {"role": "user", "content": [
            {"type": "document", "title": "T", "source": {"type": "text", "media_type": "text/plain", "data": "D"}},
            {"type": "search_result", "title": "R", "source": "https://x", "content": [{"type": "text", "text": "C"}]},
        ]},
        {"role": "assistant", "content": [{"type": "compaction", "content": "summary"},
                                          {"type": "fallback", "from": {}, "to": {}}, {"type": "text", "text": "a"}]},
    ])
    assert [m.text for m in conv.messages] == ["T\nDR\nhttps://x\nC", "summarya"]
