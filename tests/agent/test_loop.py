"""The agent loop driven by a scripted model, with the real tools on a real repository."""

import asyncio
import io
import json

import pytest
from rich.console import Console

from dflash_agent.agent.backend import ContextFull
from dflash_agent.agent.loop import (
    INTERRUPTED_RESULT,
    Agent,
    AgentConfig,
    ModelDelta,
    RunEnd,
    StepEnd,
    StepStart,
    ToolEnd,
    ToolStart,
    TurnEnd,
)
from dflash_agent.agent.prompt import system_prompt
from dflash_agent.agent.remote import openai_messages
from dflash_agent.agent.transcript import Transcript
from dflash_agent.agent.view import TerminalView
from dflash_agent.chat.openai_messages import conversation_from_openai
from dflash_agent.tools.registry import workspace_tools
from dflash_agent.tools.workspace import Workspace
from tests.agent.repos import PYTEST, git, repo_tests_pass
from tests.agent.scripted import Say, ScriptedModel, bash
from tests.tools.processes import running, unique_sleep


def make_agent(repo, script, config=AgentConfig(), transcript=None, read_only=False):
    events = []
    workspace = Workspace(repo, read_only=read_only)
    model = ScriptedModel(script)
    agent = Agent(model, workspace_tools(workspace), system_prompt(workspace), config, events.append, transcript)
    return agent, model, events


def last_tool_result(conversation):
    return conversation.messages[-1].text


def test_scripted_agent_fixes_a_failing_test(repo, tmp_path):
    assert not repo_tests_pass(repo)

    def after_failing_run(conversation):
        assert "1 failed" in last_tool_result(conversation)
        return Say("The test fails; let me read the code.", [("read_file", {"path": "calc.py"})])

    def after_read(conversation):
        assert "     2\t    return a - b" in last_tool_result(conversation)
        return Say(calls=[("edit_file", {"path": "calc.py", "old_string": "return a - b",
                                         "new_string": "return a + b"})])

    def after_passing_run(conversation):
        assert "1 passed" in last_tool_result(conversation)
        return Say("Fixed: add() subtracted instead of adding.")

    transcript = Transcript(tmp_path / "t.jsonl")
    agent, model, events = make_agent(repo, [
        Say("Running the tests first.", [bash(PYTEST)]),
        after_failing_run,
        after_read,
        Say(calls=[bash(PYTEST)]),
        after_passing_run,
    ], transcript=transcript)
    result = asyncio.run(agent.run("The test in this repository fails. Fix the code."))
    transcript.close()

    assert result.outcome == "answered" and result.exit_code == 0
    assert result.steps == 5 and result.answer == "Fixed: add() subtracted instead of adding."
    assert repo_tests_pass(repo)
    assert git(repo, "diff", "--stat").strip().startswith("calc.py | 2 +-")

    # Append-only: each prompt's messages start with the previous prompt's, and what was added is
    # the assistant turn and its tool results.
    for before, after in zip(model.conversations, model.conversations[1:]):
        assert after.messages[:len(before.messages)] == before.messages
        assert [m.role for m in after.messages[len(before.messages):]] == ["assistant", "tool"]
        assert after.tools == before.tools

    # One StepEnd per step: the MCP server's progress notifications.
    assert [e.step for e in events if isinstance(e, StepEnd)] == [1, 2, 3, 4, 5]
    kinds = [type(e) for e in events if not isinstance(e, ModelDelta)]
    assert kinds[:6] == [StepStart, TurnEnd, ToolStart, ToolEnd, StepEnd, StepStart]
    assert kinds[-4:] == [StepStart, TurnEnd, StepEnd, RunEnd]

    records = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert all("ts" in r for r in records)
    messages = [r for r in records if r["type"] == "message"]
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 4 + ["assistant"]
    assert messages[4]["tool_calls"] == [{"id": "call_2", "name": "read_file", "arguments": {"path": "calc.py"}}]
    assert messages[5]["tool_call_id"] == "call_2" and messages[5]["is_error"] is False
    assert records[-1]["type"] == "end" and records[-1]["outcome"] == "answered" and records[-1]["steps"] == 5


def test_step_limit(repo):
    agent, model, _ = make_agent(repo, [Say(calls=[("list_dir", {})])] * 3, AgentConfig(max_steps=2))
    result = asyncio.run(agent.run("look around"))
    assert result.outcome == "max_steps" and result.exit_code == 3 and result.steps == 2
    assert len(model.conversations) == 2


def test_token_budget_limits_each_turn_and_the_run(repo):
    config = AgentConfig(max_tokens=25, max_turn_tokens=20)
    agent, model, _ = make_agent(repo, [Say(calls=[("list_dir", {})], completion_tokens=10)] * 5, config)
    result = asyncio.run(agent.run("look around"))
    assert [o.max_tokens for o in model.options] == [20, 15, 5]
    assert result.outcome == "max_tokens" and result.exit_code == 4 and result.usage.completion_tokens == 30


def test_a_turn_cut_off_without_a_call_is_not_an_answer(repo):
    agent, _, _ = make_agent(repo, [Say("I will now explain at len", finish_reason="length")])
    assert asyncio.run(agent.run("explain")).outcome == "max_tokens"


def test_context_full(repo):
    class Full:
        async def turn(self, conversation, options, on_delta):
            raise ContextFull("the sequence needs 9000 tokens but the context holds 8192")

    workspace = Workspace(repo)
    agent = Agent(Full(), workspace_tools(workspace), system_prompt(workspace))
    result = asyncio.run(agent.run("anything"))
    assert result.outcome == "context_full" and result.exit_code == 4


def test_bad_calls_become_errors_the_model_reads(repo):
    agent, model, _ = make_agent(repo, [
        Say(calls=[("run_shell", {"cmd": "ls"}), ("read_file", {"path": 7}), ("read_file", {"path": "../../etc"})]),
        Say("done"),
    ])
    result = asyncio.run(agent.run("go"))
    assert result.outcome == "answered"
    results = [m.text for m in model.conversations[1].messages if m.role == "tool"]
    assert results[0].startswith("Error: unknown tool 'run_shell'")
    assert results[1].startswith("Error: invalid arguments for read_file")
    assert results[2].startswith("Error: ") and "outside the workspace" in results[2]


def test_long_tool_output_is_cut_before_it_enters_the_context(repo):
    config = AgentConfig(tool_output_chars=1000)
    agent, model, _ = make_agent(repo, [Say(calls=[bash("seq 1 100000")]), Say("ok")], config)
    asyncio.run(agent.run("count"))
    text = model.conversations[1].messages[-1].text
    assert len(text) < 1200 and text.startswith("1\n2\n3\n") and "elided" in text
    assert text.endswith("100000\n[exit code 0]")


def test_interrupt_stops_a_running_command_and_the_conversation_can_go_on(repo, tmp_path):
    sleeper = unique_sleep()
    transcript = Transcript(tmp_path / "t.jsonl")
    agent, model, _ = make_agent(repo, [
        Say(calls=[bash(f"sleep {sleeper} & echo $! > sleeper.pid; wait"), ("list_dir", {})]),
        Say("Continuing after the interruption."),
    ], transcript=transcript)

    async def scenario():
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, agent.interrupt)
        first = await agent.run("sleep")
        second = await agent.run("go on")
        return first, second

    first, second = asyncio.run(asyncio.wait_for(scenario(), 30))
    transcript.close()
    assert first.outcome == "interrupted" and first.exit_code == 130
    assert not running(sleeper, grace=1.0)  # the command went with the run
    assert second.outcome == "answered"
    # Both calls of the interrupted turn have results, so the history is a valid conversation.
    history = model.conversations[1]
    tool_results = [m for m in history.messages if m.role == "tool"]
    assert [m.tool_call_id for m in tool_results] == ["call_1", "call_2"]
    assert all(m.text == f"Error: {INTERRUPTED_RESULT}" for m in tool_results)
    conversation_from_openai(openai_messages(history))  # raises on an unanswered call
    ends = [json.loads(line)["outcome"] for line in (tmp_path / "t.jsonl").read_text().splitlines()
            if json.loads(line)["type"] == "end"]
    assert ends == ["interrupted", "answered"]


def test_cancelling_the_task_propagates(repo, tmp_path):
    transcript = Transcript(tmp_path / "t.jsonl")
    agent, _, _ = make_agent(repo, [Say("thinking hard", delay=30)], transcript=transcript)

    async def scenario():
        task = asyncio.create_task(agent.run("x"))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    transcript.close()
    last = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[-1])
    assert last["type"] == "end" and last["outcome"] == "cancelled"


def test_read_only_agent_gets_only_reading_tools(repo):
    agent, model, _ = make_agent(repo, [Say(calls=[bash("touch x")]), Say("ok")], read_only=True)
    asyncio.run(agent.run("try to write"))
    assert [t.name for t in model.conversations[0].tools] == ["read_file", "list_dir", "glob", "grep"]
    assert "read-only" in model.conversations[0].messages[0].text
    assert "read-only" in model.conversations[1].messages[-1].text
    assert not (repo / "x").exists()


def _viewed_run(repo, script: list[Say], width: int = 100) -> str:
    """What the terminal view prints for an agent run of the scripted model."""
    out = io.StringIO()
    view = TerminalView(Console(file=out, width=width, force_terminal=False))
    workspace = Workspace(repo)
    agent = Agent(ScriptedModel(script), workspace_tools(workspace), system_prompt(workspace), on_event=view)
    asyncio.run(agent.run("check"))
    return out.getvalue()


def test_terminal_view_shows_steps_calls_and_outcome(repo):
    text = _viewed_run(repo, [Say("Reading.", [("read_file", {"path": "calc.py"})]), Say("All good.")])
    assert "step 1" in text and "step 2" in text and "Reading." in text
    assert "▶ read_file calc.py" in text
    assert any(line.startswith("  │") and line.endswith("def add(a, b):") for line in text.splitlines())
    assert "answered after 2 steps" in text


def test_terminal_view_shows_control_characters_as_escapes(repo):
    """A repository's text, a command's output and the model's reach the terminal without their escape sequences
    (clearing the screen, writing the clipboard by OSC 52); newlines stay."""
    (repo / "evil.txt").write_text("fine\tline\n\x1b[2J\x1b]52;c;ZWNobyBwd25lZA==\x07cleared\n")
    text = _viewed_run(repo, [Say("Look\x1b[1A.", [("read_file", {"path": "evil.txt"})]), Say("Done.")], width=200)
    assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b[2J\\x1b]52;c;ZWNobyBwd25lZA==\\x07cleared" in text and "Look\\x1b[1A." in text
    assert "fine" in text and "line" in text
