"""The loop against the real embedded model (Gemma 3 270M), tool calls forced by the chat layer's
grammar: it proves the wiring (render, force, parse, dispatch, append, the prefix cache), not
intelligence. Once in process, once through the HTTP server with the openai client."""

import asyncio

import pytest

from dflash_agent.agent.engine_backend import EngineBackend
from dflash_agent.agent.loop import Agent, AgentConfig, ToolEnd, TurnEnd
from dflash_agent.agent.prompt import system_prompt
from dflash_agent.agent.remote import RemoteBackend
from dflash_agent.api.background import live_server
from dflash_agent.chat.chat_format import ChatFormat
from dflash_agent.engine.engine import Engine
from dflash_agent.tools.registry import workspace_tools
from dflash_agent.tools.workspace import Workspace

# Greedy, the model writes a forced call in about 70 tokens (a long made-up path); it decodes ~10 tokens/s
# on a CPU.
FORCED = AgentConfig(max_steps=3, max_turn_tokens=128, tool_choice="required", parallel_tool_calls=False)


@pytest.fixture(scope="module")
def engine(embedded_engine):
    engine = embedded_engine(4096, device="cpu", dtype="float32")
    yield engine
    engine.close()


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "README.md").write_text("# calc\n")
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    return Workspace(tmp_path, read_only=True)


class RecordingFormat:
    """The engine's chat format, keeping every prompt it renders."""

    def __init__(self, chat: ChatFormat) -> None:
        self.chat = chat
        self.prompts: list[list[int]] = []

    def prepare(self, conversation, options):
        prepared = self.chat.prepare(conversation, options)
        self.prompts.append(prepared.prompt_ids)
        return prepared


def test_three_forced_steps_in_process(engine, workspace):
    chat = RecordingFormat(ChatFormat.for_engine(engine))
    events = []
    agent = Agent(EngineBackend(engine, chat), workspace_tools(workspace), system_prompt(workspace), FORCED,
                  events.append)
    result = asyncio.run(agent.run("Look at the files in this repository."))

    assert result.outcome == "max_steps" and result.steps == 3
    names = {"read_file", "list_dir", "glob", "grep"}
    calls = [e.call for e in events if isinstance(e, ToolEnd)]
    assert len(calls) == 3 and all(call.name in names for call in calls)
    # Every call was answered in the conversation, in order.
    assistant = [m for m in agent.messages if m.role == "assistant"]
    tool = [m for m in agent.messages if m.role == "tool"]
    assert [m.tool_calls[0].id for m in assistant] == [m.tool_call_id for m in tool] == [c.id for c in calls]
    # Append-only with the real turns: each prompt starts with the one before, token for token.
    for before, after in zip(chat.prompts, chat.prompts[1:]):
        assert after[:len(before)] == before
    if getattr(engine, "prefix_stats", None) is not None:
        # ... so the engine's prefix cache serves all of the previous prompt from its KV.
        cached = [e.turn.usage.cached_tokens for e in events if isinstance(e, TurnEnd)]
        assert all(hit >= len(before) for hit, before in zip(cached[1:], chat.prompts)), (cached, chat.prompts)
    assert result.usage.completion_tokens <= 3 * FORCED.max_turn_tokens


def test_a_forced_turn_through_the_http_server(engine, workspace):
    """The remote backend against `dflash-agent serve`'s app, sharing the loaded weights."""
    agent_tools = workspace_tools(workspace)
    served = Engine(engine.model, engine.tokenizer, engine.n_ctx, model_name="embedded", model_path=engine.model_path,
                    runner=engine.runner)
    with live_server(lambda: served) as url:
        async def one_turn():
            backend = RemoteBackend(f"{url}/v1")
            try:
                agent = Agent(backend, agent_tools, system_prompt(workspace),
                              AgentConfig(max_steps=1, max_turn_tokens=128, tool_choice="required",
                                          parallel_tool_calls=False))
                return agent, await agent.run("List the files.")
            finally:
                await backend.close()

        agent, result = asyncio.run(one_turn())
    assert result.outcome == "max_steps" and result.steps == 1
    call = agent.messages[2].tool_calls[0]
    assert call.name in agent_tools.names and agent.messages[3].tool_call_id == call.id
    assert result.usage.prompt_tokens > 500 and 0 < result.usage.completion_tokens <= 128
