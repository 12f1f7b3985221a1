"""OpenAI Responses API input items into the canonical conversation (what Codex CLI sends)."""

from __future__ import annotations

import pytest

from dflash_agent.chat.responses_input import (
    conversation_from_responses,
    tool_namespaces,
    tools_from_responses,
)
from dflash_agent.chat.types import ChatError, Message, TextPart, ToolCall

CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "close_agent", "parameters": {"type": "object", "properties": {}}}]},
    {"type": "web_search", "external_web_access": False},
]


def test_items_become_one_assistant_turn_per_run():
    conv = conversation_from_responses([
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
        {"role": "user", "content": "list the files here"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "ls"}],
         "encrypted_content": None},
        {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "a.py", "annotations": []}]},
    ], instructions="You are Codex.", tools=CODEX_TOOLS)
    assert conv.messages == [
        Message(role="system", content=[TextPart("You are Codex.")]),
        Message(role="developer", content=[TextPart("Sandbox: read-only.")]),
        Message(role="user", content=[TextPart("list the files here")]),
        Message(role="assistant", reasoning="ls", tool_calls=[ToolCall("c1", "exec_command", {"cmd": "ls"})]),
        Message(role="tool", content=[TextPart("a.py")], tool_call_id="c1", name="exec_command"),
        Message(role="assistant", content=[TextPart("a.py")]),
    ]
    # Namespaced functions are offered by their own names; hosted tools (web_search) are left out.
    assert [t.name for t in conv.tools] == ["exec_command", "close_agent"]
    assert tool_namespaces(CODEX_TOOLS) == {"close_agent": "multi_agent_v1"}


def test_history_of_a_previous_response_comes_first_and_instructions_lead():
    history = [Message(role="user", content=[TextPart("go")]),
               Message(role="assistant", tool_calls=[ToolCall("c1", "f", {})])]
    conv = conversation_from_responses([{"type": "function_call_output", "call_id": "c1", "output": "ok"}],
                                       "I", None, history)
    assert [m.role for m in conv.messages] == ["system", "user", "assistant", "tool"]
    assert conversation_from_responses("hi").messages == [Message(role="user", content=[TextPart("hi")])]


@pytest.mark.parametrize("input, tools, param, fragment", [
    ([{"type": "function_call_output", "call_id": "x", "output": "o"}], None, "input[0].call_id", "matches no"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}], None, "input[0].content[0]",
     "images are not supported"),
    ([{"type": "item_reference", "id": "msg_1"}], None, "input[0].type", "item references are not supported"),
    ([{"type": "local_shell_call", "id": "x"}], None, "input[0].type", "'local_shell_call' are not supported"),
    ([{"role": "tool", "content": "x"}], None, "input[0].role", "unknown role 'tool'"),
    ("x", [{"type": "custom", "name": "apply_patch"}], "tools[0].type", "only 'function' tools"),
    ("x", [{"type": "function"}], "tools[0].name", "is required"),
    ([], None, "input", "must not be empty"),
])
def test_errors_name_the_field(input, tools, param, fragment):
    with pytest.raises(ChatError) as info:
        conversation_from_responses(input, None, tools)
    assert info.value.param == param and fragment in str(info.value)


def test_tools_without_parameters_take_none():
    (tool,) = tools_from_responses([{"type": "function", "name": "now"}])
    assert tool.parameters == {"type": "object", "properties": {}}
