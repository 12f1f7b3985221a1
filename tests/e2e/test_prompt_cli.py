"""`dflash-agent prompt` as a user runs it: a subprocess with the embedded model's tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash_agent.chat.openai_messages import conversation_from_openai
from dflash_agent.chat.template import RenderOptions, builtin_template
from dflash_agent.engine.load.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "README.md\nsrc"},
]
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def prompt_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_agent", "prompt", *args], capture_output=True, text=True,
                          timeout=300, env=os.environ.copy(), check=False)


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert fragment in lines[0] and proc.stdout == ""


@pytest.fixture(scope="module")
def request_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt") / "request.json"
    path.write_text(json.dumps({"model": "any", "messages": MESSAGES, "tools": TOOLS}))
    return path


def test_prints_the_embedded_models_prompt(request_file):
    proc = prompt_cli("--messages", str(request_file))
    assert proc.returncode == 0, proc.stderr
    # The embedded Gemma 3 ships no template: ours, with the tools written into the system turn.
    expected = builtin_template("gemma3").render(conversation_from_openai(MESSAGES, TOOLS))
    assert proc.stdout == expected
    assert '```tool_call\n{"name": "bash", "arguments": {"command": "ls"}}\n```' in proc.stdout


def test_json_with_separate_files_and_options(tmp_path, embedded_gguf):
    messages, tools = tmp_path / "messages.json", tmp_path / "tools.json"
    messages.write_text(json.dumps(MESSAGES[:2]))
    tools.write_text(json.dumps({"tools": TOOLS}))
    proc = prompt_cli("--messages", str(messages), "--tools", str(tools), "--template", "gemma4",
                      "--model", str(embedded_gguf), "--enable-thinking", "--no-generation-prompt", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"prompt", "token_ids"}
    expected = builtin_template("gemma4").render(conversation_from_openai(MESSAGES[:2], TOOLS),
                                                 RenderOptions(add_generation_prompt=False, enable_thinking=True))
    assert out["prompt"] == expected and expected.endswith("List the files.<turn|>\n")
    tokenizer = Tokenizer.from_gguf(embedded_gguf)
    ids = out["token_ids"]
    assert ids == tokenizer.encode(expected)
    assert ids[0] == tokenizer.bos_id and ids[1] != tokenizer.bos_id and ids.count(tokenizer.bos_id) == 1


@pytest.mark.parametrize("content, fragment", [
    (None, "cannot read"),
    ("{not json", "is not valid JSON"),
    ('[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]',
     "messages[0].content[0]: images are not supported"),
])
def test_bad_messages_file(tmp_path, content, fragment):
    path = tmp_path / "messages.json"
    if content is not None:
        path.write_text(content)
    assert_one_line_error(prompt_cli("--messages", str(path)), fragment)


def test_bad_template_option(request_file):
    assert_one_line_error(prompt_cli("--messages", str(request_file), "--template", "llama3"),
                          "template 'llama3' is neither gemma4 nor gemma3 nor a readable file")
