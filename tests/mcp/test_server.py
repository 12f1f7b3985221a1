"""The MCP server through the official `mcp` client, in memory (JSON-RPC over memory streams, so
progress and cancel travel as real notifications), with a scripted model: the tools, run_task's
progress and cancellation, and every kind of bad input as an MCP tool error."""

from __future__ import annotations

import json
import os
import time

import anyio
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

from dflash_agent.agent.backend import BackendError
from dflash_agent.mcp.model import LastRequest
from dflash_agent.mcp.server import STATUS_URI, workspace_server
from dflash_agent.tools.registry import workspace_tools
from dflash_agent.tools.workspace import Workspace
from tests.agent.scripted import Say, ScriptedModel, bash
from tests.tools.processes import running, unique_sleep


class ScriptedAccess:
    """The model access of a server whose model is a script (the tools and the agent loop are real)."""

    name = "scripted"

    def __init__(self, script=(), backend=None) -> None:
        self.model = backend or ScriptedModel(list(script))
        self.temperatures: list[float] = []

    async def backend(self, temperature: float = 0.0):
        self.temperatures.append(temperature)
        return self.model

    async def complete(self, prompt, max_tokens, temperature=0.0):
        raise AssertionError("not scripted")

    async def status(self):
        return {"model": self.name, "requests": len(self.model.conversations)}

    async def aclose(self):
        pass


class FailingBackend:
    def __init__(self, error: Exception) -> None:
        self.error = error
        self.conversations = []

    async def turn(self, conversation, options, on_delta):
        raise self.error


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "app.py").write_text("print('hello from app')\n")
    (repo / "notes.txt").write_text("remember the milk\n")
    return repo


def serve(access, repo, **options):
    """Run `scenario(client)` against a fresh server; legacy mode is the JSON-RPC stream transport."""

    def run(scenario):
        async def main():
            async with Client(workspace_server(access, repo, **options), mode="legacy") as client:
                return await scenario(client)

        return anyio.run(main)

    return run


def text(result) -> str:
    return "\n".join(part.text for part in result.content)


def transcript_events(repo):
    (path,) = (repo / ".dflash-agent" / "transcripts").glob("*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tools_carry_the_registry_schemas_and_annotations(repo):
    registry = workspace_tools(Workspace(repo))

    async def scenario(client):
        return (await client.list_tools()).tools

    tools = {t.name: t for t in serve(ScriptedAccess(), repo, expose_tools=True)(scenario)}
    assert list(tools) == ["run_task", "complete", "chat", *registry.names]
    for spec in registry.tools:
        tool = tools[spec.name]
        assert tool.input_schema == spec.input_schema and tool.description == spec.description
        hints = tool.annotations
        assert (hints.read_only_hint, hints.destructive_hint, hints.idempotent_hint) == \
               (spec.read_only, spec.destructive, spec.idempotent)
    assert tools["read_file"].annotations.read_only_hint and tools["bash"].annotations.destructive_hint
    assert tools["run_task"].annotations.destructive_hint and not tools["run_task"].annotations.read_only_hint
    assert tools["complete"].annotations.read_only_hint and tools["chat"].annotations.read_only_hint
    assert tools["run_task"].input_schema["required"] == ["task"]


def test_without_expose_tools_only_the_agent_and_the_model(repo):
    async def scenario(client):
        listed = [t.name for t in (await client.list_tools()).tools]
        return listed, await client.call_tool("read_file", {"path": "notes.txt"})

    listed, result = serve(ScriptedAccess(), repo)(scenario)
    assert listed == ["run_task", "complete", "chat"]
    assert result.is_error and "unknown tool 'read_file'" in text(result)


def test_read_only_lists_only_reading_tools_and_refuses_the_others(repo):
    async def scenario(client):
        tools = {t.name: t for t in (await client.list_tools()).tools}
        return tools, await client.call_tool("write_file", {"path": "x.txt", "content": "x"})

    tools, result = serve(ScriptedAccess(), repo, expose_tools=True, read_only=True)(scenario)
    assert [name for name in tools if name not in ("run_task", "complete", "chat")] == \
           ["read_file", "list_dir", "glob", "grep"]
    assert tools["run_task"].annotations.read_only_hint and not tools["run_task"].annotations.destructive_hint
    assert result.is_error and "disabled" in text(result) and "read-only" in text(result)
    assert not (repo / "x.txt").exists()


def test_exposed_tools_run_in_the_workspace(repo):
    async def scenario(client):
        return (await client.call_tool("read_file", {"path": "notes.txt"}),
                await client.call_tool("list_dir", {"path": "src"}),
                await client.call_tool("read_file", {"path": "../outside.txt"}),
                await client.call_tool("read_file", {"path": 3}),
                await client.call_tool("read_file", {}))

    read, listed, outside, wrong_type, missing = serve(ScriptedAccess(), repo, expose_tools=True)(scenario)
    assert not read.is_error and "remember the milk" in text(read)
    assert not listed.is_error and "app.py" in text(listed)
    assert outside.is_error and "outside the workspace" in text(outside)
    assert wrong_type.is_error and "invalid arguments for read_file" in text(wrong_type)
    assert missing.is_error and "path" in text(missing)


def test_run_task_reports_one_progress_notification_per_step(repo):
    def after_read(conversation):
        assert "remember the milk" in conversation.messages[-1].text  # the real tool ran
        return Say("The note says: remember the milk.")

    access = ScriptedAccess([Say("Let me look.", [("list_dir", {})]),
                             Say(calls=[("read_file", {"path": "notes.txt"}), ("grep", {"pattern": "milk"})]),
                             after_read])
    progress = []

    async def scenario(client):
        async def on_progress(done, total, message):
            progress.append((done, total, message))

        return await client.call_tool("run_task", {"task": "What does the note say?", "max_steps": 5},
                                      progress_callback=on_progress)

    result = serve(access, repo)(scenario)
    assert not result.is_error
    assert progress == [(1, 5, "step 1/5: called list_dir"), (2, 5, "step 2/5: called read_file, grep"),
                        (3, 5, "step 3/5: answered")]
    assert text(result).startswith("The note says: remember the milk.")
    assert "answered after 3 steps, 3 tool calls" in text(result)
    summary = result.structured_content
    assert (summary["outcome"], summary["steps"], summary["tool_calls"]) == ("answered", 3, 3)
    assert summary["completion_tokens"] == 30 and summary["transcript"].startswith(str(repo))
    assert transcript_events(repo)[-1]["outcome"] == "answered"


def test_run_task_stops_at_its_step_limit_without_an_error(repo):
    access = ScriptedAccess([Say(calls=[("list_dir", {})]), Say(calls=[("list_dir", {})])])

    async def scenario(client):
        return await client.call_tool("run_task", {"task": "loop", "max_steps": 2})

    result = serve(access, repo)(scenario)
    assert not result.is_error and result.structured_content["outcome"] == "max_steps"
    assert "the step limit ran out after 2 steps" in text(result)


def test_run_task_limits_the_tokens_of_a_turn_and_of_the_task(repo):
    """On a slow shared server a run_task of 4,096 tokens a turn times its steps runs for many minutes: the caller
    may bound both; each turn asks for at most what is left."""
    access = ScriptedAccess([Say(calls=[("list_dir", {})]), Say(calls=[("list_dir", {})]), Say("done")])

    async def scenario(client):
        return await client.call_tool("run_task", {"task": "list", "max_turn_tokens": 64, "max_tokens": 100})

    result = serve(access, repo)(scenario)
    assert not result.is_error, text(result)
    asked = [options.max_tokens for options in access.model.options]
    assert asked[0] == 64 and all(0 < n <= 64 for n in asked), asked
    config = transcript_events(repo)[0]["config"]
    assert config["max_turn_tokens"] == 64 and config["max_tokens"] == 100


def test_run_task_in_a_subdirectory_works_there(repo):
    access = ScriptedAccess([Say(calls=[("list_dir", {})]), Say("done")])

    async def scenario(client):
        return await client.call_tool("run_task", {"task": "list", "repo": "src"})

    assert not serve(access, repo)(scenario).is_error
    assert "app.py" in access.model.conversations[1].messages[-1].text
    assert str(repo / "src") in access.model.conversations[0].messages[0].text  # the system prompt's root


def test_cancelling_run_task_stops_the_agent_and_its_command_and_the_server_keeps_serving(repo):
    sleeper = unique_sleep()
    access = ScriptedAccess([Say(calls=[("list_dir", {})]),
                             Say(calls=[bash(f"sleep {sleeper} & echo $! > sleeper.pid; wait")]),
                             Say("never reached"),
                             Say("Still here.")])
    progress = []

    async def scenario(client):
        with anyio.CancelScope() as scope:
            async def on_progress(done, total, message):
                progress.append(done)

            async def cancel_once_the_command_runs():
                while not (repo / "sleeper.pid").exists():
                    await anyio.sleep(0.05)
                await anyio.sleep(0.2)
                scope.cancel()  # the client sends notifications/cancelled

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(cancel_once_the_command_runs)
                await client.call_tool("run_task", {"task": "sleep"}, progress_callback=on_progress)
        assert scope.cancelled_caught
        deadline = time.monotonic() + 10
        while transcript_events(repo)[-1]["type"] != "end" and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        ended = transcript_events(repo)[-1]
        # The same session serves the next call (a new run with a fresh agent).
        after = await client.call_tool("run_task", {"task": "still there?"})
        return ended, after

    ended, after = serve(access, repo)(scenario)
    # Cancelled in step 2, in its command: step 1 was reported, step 2 never ended.
    assert ended["type"] == "end" and ended["outcome"] == "cancelled" and ended["steps"] == 2
    assert progress == [1]
    assert not running(sleeper, grace=2.0)  # the command went with the run
    assert not after.is_error and text(after).startswith("never reached")


@pytest.mark.parametrize("arguments, message", [
    ({"task": "x", "repo": ".."}, "outside the workspace"),
    ({"task": "x", "repo": "/"}, "outside the workspace"),
    ({"task": "x", "repo": "notes.txt"}, "is not a directory"),
    ({"task": "x", "repo": "missing"}, "is not a directory"),
    ({"task": ""}, "invalid arguments for run_task"),
    ({"task": "x", "max_steps": 0}, "invalid arguments for run_task"),
    ({"task": "x", "colour": "red"}, "invalid arguments for run_task"),
    ({}, "invalid arguments for run_task"),
])
def test_bad_run_task_calls_are_tool_errors(repo, arguments, message):
    access = ScriptedAccess()

    async def scenario(client):
        return await client.call_tool("run_task", arguments)

    result = serve(access, repo)(scenario)
    assert result.is_error and message in text(result)
    assert access.model.conversations == []  # no agent ran


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_an_unreadable_repo_is_a_tool_error(repo):
    locked = repo / "locked"
    locked.mkdir()
    locked.chmod(0)

    async def scenario(client):
        return await client.call_tool("run_task", {"task": "x", "repo": "locked"})

    try:
        result = serve(ScriptedAccess(), repo)(scenario)
    finally:
        locked.chmod(0o755)
    assert result.is_error and "not readable" in text(result)


def test_unknown_tool_is_a_tool_error_listing_the_tools(repo):
    async def scenario(client):
        return await client.call_tool("deploy", {})

    result = serve(ScriptedAccess(), repo)(scenario)
    assert result.is_error and "unknown tool 'deploy'" in text(result) and "run_task, complete, chat" in text(result)


def test_a_failing_model_is_a_tool_error_and_a_bug_does_not_end_the_session(repo):
    unreachable = ScriptedAccess(backend=FailingBackend(BackendError("cannot reach the server at http://x")))
    buggy = ScriptedAccess(backend=FailingBackend(KeyError("oops")))

    async def call(client):
        first = await client.call_tool("chat", {"messages": [{"role": "user", "content": "hi"}]})
        second = await client.call_tool("run_task", {"task": "x"})
        return first, second

    for chat, run in (serve(unreachable, repo)(call), serve(buggy, repo)(call)):
        assert chat.is_error and run.is_error
    assert text(chat) == "chat failed with an internal error: KeyError: 'oops'"


def test_chat_is_one_turn_of_the_model_with_its_tool_calls_as_json(repo):
    access = ScriptedAccess([Say("Going there.", [("goto_line", {"line": 12})])])
    tools = [{"type": "function", "function": {
        "name": "goto_line", "description": "Move the cursor.",
        "parameters": {"type": "object", "properties": {"line": {"type": "integer"}}, "required": ["line"]}}}]

    async def scenario(client):
        return await client.call_tool("chat", {"messages": [{"role": "system", "content": "Be brief."},
                                                            {"role": "user", "content": "Line 12 please."}],
                                               "tools": tools, "max_tokens": 20, "temperature": 0.5,
                                               "enable_thinking": True})

    result = serve(access, repo)(scenario)
    assert not result.is_error
    assert result.content[0].text == "Going there."
    calls = json.loads(result.content[1].text)["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("goto_line", {"line": 12})]
    assert result.structured_content["finish_reason"] == "tool_calls"
    seen = access.model.conversations[0]
    assert [m.role for m in seen.messages] == ["system", "user"] and [t.name for t in seen.tools] == ["goto_line"]
    assert access.model.options[0].max_tokens == 20 and access.model.options[0].enable_thinking
    assert access.temperatures == [0.5]


@pytest.mark.parametrize("arguments, message", [
    ({"messages": []}, "invalid arguments for chat"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "invalid arguments for chat"),
])
def test_bad_chat_calls_are_tool_errors(repo, arguments, message):
    access = ScriptedAccess()

    async def scenario(client):
        return await client.call_tool("chat", arguments)

    result = serve(access, repo)(scenario)
    assert result.is_error and message in text(result)
    assert access.model.conversations == []


def test_status_resource_and_an_unknown_resource(repo):
    async def scenario(client):
        listed = (await client.list_resources()).resources
        status = (await client.read_resource(STATUS_URI)).contents[0]
        with pytest.raises(MCPError, match="unknown resource"):
            await client.read_resource("dflash-agent://nope")
        return listed, status

    listed, status = serve(ScriptedAccess(), repo)(scenario)
    assert [r.uri for r in listed] == [STATUS_URI]
    assert status.mime_type == "application/json" and json.loads(status.text) == {"model": "scripted", "requests": 0}


def test_a_server_without_a_workspace_offers_only_the_model():
    async def main():
        async with Client(workspace_server(ScriptedAccess(), None), mode="legacy") as client:
            return [t.name for t in (await client.list_tools()).tools]

    assert anyio.run(main) == ["complete", "chat"]
    with pytest.raises(ValueError, match="needs a workspace"):
        workspace_server(ScriptedAccess(), None, expose_tools=True)


def test_last_request_figures_from_llama_cpp_timings():
    last = LastRequest()
    assert last.as_dict() is None
    last.record({"cache_n": 90, "prompt_n": 10, "prompt_per_second": 500.0, "predicted_n": 30,
                 "predicted_per_second": 42.123, "draft_n": 40, "draft_n_accepted": 20})
    figures = last.as_dict()
    assert figures["prompt_tokens"] == 100 and figures["cached_tokens"] == 90
    assert figures["decode_tokens_per_second"] == 42.12
    # 30 tokens from 10 target forwards (20 of them accepted drafts): 3 tokens per forward.
    assert figures["acceptance_length"] == 3.0 and figures["draft_acceptance_rate"] == 0.5
    last.record({"predicted_n": 5, "predicted_per_second": 9.0})
    assert "acceptance_length" not in last.as_dict() and last.requests == 2


VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="gemma3-270m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="gemma3-270m"} 2.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="gemma3-270m"} 1200.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="gemma3-270m"} 800.0
"""


def test_status_of_a_vllm_server_reads_its_card_and_metrics():
    from dflash_agent.mcp.model import RemoteModel
    from tests.agent.fake_openai import fake_server

    card = {"id": "gemma3-270m", "object": "model", "created": 0, "owned_by": "vllm",
            "root": "/models/gemma-3-270m-it", "max_model_len": 2048}

    async def status(url):
        model = RemoteModel(url)
        try:
            await model.backend()
            return await model.status()
        finally:
            await model.aclose()

    with fake_server([], card=card, metrics=VLLM_METRICS) as fake:
        got = anyio.run(status, fake.url)
    assert got["model"] == "gemma3-270m" and got["state"] == "ready" and got["n_ctx"] == 2048
    assert got["server_metrics"] == {"requests_running": 1.0, "requests_waiting": 2.0,
                                     "prefix_queried_tokens": 1200.0, "prefix_cached_tokens": 800.0}


def test_complete_on_a_server_whose_context_is_full_is_context_full():
    from dflash_agent.agent.backend import ContextFull
    from dflash_agent.mcp.model import RemoteModel
    from tests.agent.fake_openai import Failure, fake_server

    error = {"message": "This model's maximum context length is 2048 tokens. However, your request has 3100 input "
                        "tokens.", "type": "BadRequestError", "param": "input_tokens", "code": 400}

    async def complete(url):
        model = RemoteModel(url)
        try:
            return await model.complete("long", 8)
        finally:
            await model.aclose()

    with fake_server([Failure(400, error)]) as fake:
        with pytest.raises(ContextFull, match="maximum context length is 2048"):
            anyio.run(complete, fake.url)
