"""Append-only context, checked with the real chat templates: every prompt the loop renders starts
with the previous prompt's tokens, up to the re-rendered last assistant turn, so the engine's prefix
cache only prefills what is new."""

import asyncio
from pathlib import Path

import pytest

from dflash_agent.agent.loop import Agent, AgentConfig
from dflash_agent.agent.prompt import system_prompt
from dflash_agent.chat.chat_format import ChatFormat, ChatOptions
from dflash_agent.chat.prompt import load_tokenizer_and_template
from dflash_agent.chat.template import ChatTemplate
from dflash_agent.chat.types import Conversation
from dflash_agent.tools.registry import workspace_tools
from dflash_agent.tools.workspace import Workspace
from tests.agent.scripted import Say, ScriptedModel, bash
from tests.helpers.tokenizers import EMBEDDED_VOCAB as VOCAB

GOOGLE_GEMMA4 = Path(__file__).resolve().parents[1] / "fixtures" / "google_gemma4_chat_template.jinja"


class Rendering:
    """A scripted model that also renders each conversation it is sent, as the engine backend would."""

    def __init__(self, inner: ScriptedModel, chat: ChatFormat) -> None:
        self.inner, self.chat = inner, chat
        self.prompts: list[list[int]] = []  # with the generation prompt: what the engine prefills
        self.histories: list[list[int]] = []  # the conversation alone

    async def turn(self, conversation: Conversation, options, on_delta):
        self.prompts.append(self.chat.prepare(conversation, ChatOptions(tool_choice=options.tool_choice)).prompt_ids)
        self.histories.append(self.chat.prepare(conversation, ChatOptions(add_generation_prompt=False)).prompt_ids)
        return await self.inner.turn(conversation, options, on_delta)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_session(tmp_path, chat: ChatFormat) -> Rendering:
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    model = Rendering(ScriptedModel([
        Say("Let me look.", [("read_file", {"path": "calc.py"})]),
        Say(calls=[("edit_file", {"path": "calc.py", "old_string": "a - b", "new_string": "a + b"}),
                   bash("grep -n return calc.py")]),
        Say("Fixed: add() adds now."),
        Say(calls=[("glob", {"pattern": "**/*.py"})]),
        Say("Only calc.py."),
    ]), chat)
    workspace = Workspace(tmp_path)
    agent = Agent(model, workspace_tools(workspace), system_prompt(workspace), AgentConfig())
    asyncio.run(agent.run("Fix add()."))
    asyncio.run(agent.run("Which Python files are there?"))  # a chat: the same conversation goes on
    return model


def check_append_only(model: Rendering, exact: bool) -> None:
    assert len(model.prompts) == 5
    for n in range(len(model.prompts) - 1):
        prompt, history, following = model.prompts[n], model.histories[n], model.prompts[n + 1]
        shared = common_prefix(prompt, following)
        # Everything before the model's turn is reused; at most the generation prompt is rendered anew.
        assert following[:len(history)] == history, f"turn {n + 1}: the history changed"
        assert shared >= len(history)
        if exact:
            assert shared == len(prompt), f"turn {n + 1}: {len(prompt) - shared} tokens re-prefilled"


def test_gemma3_embedded_template_prompts_extend_each_other_exactly(tmp_path, gemma3_tokenizer):
    _, template = load_tokenizer_and_template("embedded")
    chat = ChatFormat(gemma3_tokenizer, template, "gemma3", VOCAB)
    check_append_only(run_session(tmp_path, chat), exact=True)


def test_google_gemma4_template_prompts_extend_each_other(tmp_path, gemma4_tokenizer):
    """Google's template opens the model's turn with an empty thought channel that a rendered
    assistant turn does not have, so those few tokens (and no more) are prefilled again."""
    template = ChatTemplate(GOOGLE_GEMMA4.read_text(), source="google", family="gemma4")
    model = run_session(tmp_path, ChatFormat(gemma4_tokenizer, template, "gemma4", VOCAB))
    check_append_only(model, exact=False)
    lost = [len(p) - common_prefix(p, q) for p, q in zip(model.prompts, model.prompts[1:])]
    assert max(lost) <= 4, lost


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_builtin_templates_keep_the_history(tmp_path, family, gemma3_tokenizer, gemma4_tokenizer):
    from dflash_agent.chat.template import builtin_template

    tokenizer = gemma3_tokenizer if family == "gemma3" else gemma4_tokenizer
    check_append_only(run_session(tmp_path, ChatFormat(tokenizer, builtin_template(family), family, VOCAB)),
                      exact=False)


# Claude Code's shape (2.1.x): a top-level system prompt, system entries inside `messages` (agent listings,
# reminders), tool results in user messages. Each request is the previous one plus the model's answer and
# what the client appends after it.
CLAUDE_CODE_TURNS = [
    [{"role": "user", "content": [{"type": "text", "text": "list the files here"}]},
     {"role": "system", "content": [{"type": "text", "text": "Available agents: general-purpose."}]}],
    [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}}]},
     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py\nb.py"}]},
     {"role": "system", "content": "Reminder: answer briefly."}],
    [{"role": "assistant", "content": [{"type": "text", "text": "a.py and b.py."}]},
     {"role": "system", "content": "The user is back."},
     {"role": "user", "content": "thanks"}],
]
CLAUDE_CODE_SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                      {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
CLAUDE_CODE_TOOLS = [{"name": "bash", "description": "Run a command.",
                      "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "google-gemma4"])
def test_mid_conversation_system_messages_keep_prompts_append_only(family, gemma3_tokenizer, gemma4_tokenizer):
    from dflash_agent.chat.anthropic_messages import conversation_from_anthropic
    from dflash_agent.chat.template import builtin_template

    if family == "gemma3":
        _, template = load_tokenizer_and_template("embedded")
        chat = ChatFormat(gemma3_tokenizer, template, "gemma3", VOCAB)
    elif family == "gemma4":
        chat = ChatFormat(gemma4_tokenizer, builtin_template("gemma4"), "gemma4", VOCAB)
    else:
        template = ChatTemplate(GOOGLE_GEMMA4.read_text(), source="google", family="gemma4")
        chat = ChatFormat(gemma4_tokenizer, template, "gemma4", VOCAB)
    messages: list = []
    prompts, histories = [], []
    for k, added in enumerate(CLAUDE_CODE_TURNS):
        messages = messages + added
        conversation = conversation_from_anthropic(messages, CLAUDE_CODE_SYSTEM, CLAUDE_CODE_TOOLS)
        prompts.append(chat.prepare(conversation).prompt_ids)
        if k + 1 < len(CLAUDE_CODE_TURNS):  # the history the next request re-renders: up to the model's answer
            answered = conversation_from_anthropic(messages + CLAUDE_CODE_TURNS[k + 1][:1], CLAUDE_CODE_SYSTEM,
                                                   CLAUDE_CODE_TOOLS)
            histories.append(chat.prepare(Conversation(answered.messages[:-1], answered.tools),
                                          ChatOptions(add_generation_prompt=False)).prompt_ids)
    for n in range(len(prompts) - 1):
        assert prompts[n + 1][:len(histories[n])] == histories[n], f"request {n + 2}: the history changed"
        lost = len(prompts[n]) - common_prefix(prompts[n], prompts[n + 1])
        # At most the generation prompt is rendered anew (exactly nothing with the Gemma 3 template).
        assert lost == 0 if family == "gemma3" else lost <= 4, (n, lost)
