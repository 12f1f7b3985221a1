"""Real coding assistants against a live server: Codex CLI (`@openai/codex`, the Responses API), Claude Code
(`@anthropic-ai/claude-code`, the Messages API) and aider (`aider-chat`, streamed chat completions), each
unmodified, run as a user runs them.

- With a scripted model (tests/e2e/scripted_engine.py): the client's whole cycle of a tool call, the tool's
  result sent back, and a final answer, through the real tokenizer, template, tool syntax and routes. These run
  whenever the client is installed (`npm install -g @openai/codex @anthropic-ai/claude-code`; aider in a venv
  of its own, as .ci/run does) and take seconds.
- With the embedded model: the same first prompt prefilled and answered for real. They also need
  DFLASH_AGENT_REAL_CLIENTS=1: on a 2-core CPU a run prefills Codex's 8K-token or Claude Code's 19K-token first
  prompt and takes many minutes, and the 270M base model may not end its turn on such a prompt."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from dflash_agent.api.background import live_server
from dflash_agent.engine.engine import Engine
from tests.e2e.scripted_engine import ScriptedEngine, fenced_call

TIMEOUT_S = 1800
MARKER = "marker_7f3a.py"  # a file only a listing of the repo can tell the model about
ANSWER = f"The files here are README.md and {MARKER}."
RESULT = '```tool_result\n{"name": '  # a tool's result as chat/gemma3_tools.py writes it back


def _wanted(binary: str) -> Callable:
    """Real model runs: skipped unless asked for, and given the client's own TIMEOUT_S rather than the suite's 900 s
    (a base-model answer that runs to the end of a 32K context takes longer than that on 2 cores)."""
    skip = pytest.mark.skipif(shutil.which(binary) is None or os.environ.get("DFLASH_AGENT_REAL_CLIENTS") != "1",
                              reason=f"{binary} not installed or DFLASH_AGENT_REAL_CLIENTS not 1")
    return lambda test: skip(pytest.mark.timeout(TIMEOUT_S + 120)(test))


def _installed(binary: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(shutil.which(binary) is None, reason=f"{binary} not installed")


def _lister(prompt: str) -> str:
    """Lists the repo with the client's own shell tool, then answers from what came back."""
    if RESULT in prompt:
        return ANSWER
    if "## exec_command" in prompt:  # Codex
        return "Listing the files.\n" + fenced_call("exec_command", {"cmd": "ls"})
    if "## Bash" in prompt:  # Claude Code
        return "Listing the files.\n" + fenced_call("Bash", {"command": "ls", "description": "List files"})
    return "OK."  # a client's side request (a title, a quota probe)


@pytest.fixture(scope="module")
def scripted():
    engine = None

    def load():
        nonlocal engine
        engine = ScriptedEngine(Engine.load(progress=False), _lister)
        return engine

    with live_server(load) as url:
        yield url, engine


@pytest.fixture(scope="module")
def server_url():
    with live_server(lambda: Engine.load(progress=False)) as url:
        yield url


@pytest.fixture
def repo(tmp_path):
    work = tmp_path / "repo"
    work.mkdir()
    (work / MARKER).write_text("print('hi')\n")
    (work / "README.md").write_text("# demo\n")
    return work


def _codex(url: str, repo, timeout_s: float) -> subprocess.CompletedProcess:
    """Codex configured as README says: a profile file of its own, beside a user config that ends in a table
    (keys appended to that file would land inside the table). Its home is outside /tmp: where bubblewrap is installed
    Codex runs its tools under it with a fresh /tmp, which would hide the helper it keeps in its home."""
    with tempfile.TemporaryDirectory(prefix="codex-home-", dir="/var/tmp") as name:
        home = Path(name)
        (home / "config.toml").write_text('approval_policy = "never"\n\n[tui]\nnotifications = false\n')
        (home / "dflash.config.toml").write_text(
            'model = "gemma"\nmodel_provider = "dflash"\nmodel_context_window = 32768\n\n[model_providers.dflash]\n'
            f'name = "dflash-agent"\nbase_url = "{url}/v1"\nwire_api = "responses"\nstream_idle_timeout_ms = 3600000\n')
        return subprocess.run(["codex", "exec", "--profile", "dflash", "--skip-git-repo-check", "list the files here"],
                              check=False, cwd=repo, env={**os.environ, "CODEX_HOME": str(home)}, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=timeout_s)


def _claude(url: str, repo, config, timeout_s: float) -> subprocess.CompletedProcess:
    config.mkdir(exist_ok=True)
    env = {**os.environ, "ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": "unused",
           "CLAUDE_CONFIG_DIR": str(config), "CLAUDE_CODE_ATTRIBUTION_HEADER": "0", "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "API_TIMEOUT_MS": str(int(timeout_s * 1000))}
    return subprocess.run(["claude", "-p", "list the files here", "--output-format", "json"], check=False,
                          cwd=repo, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=timeout_s)


@_installed("codex")
def test_codex_exec_runs_a_tool_and_answers(scripted, repo):
    url, engine = scripted
    before = len(engine.prompts)
    result = _codex(url, repo, 300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ANSWER in result.stdout, result.stdout[-3000:]
    prompts = engine.prompts[before:]
    assert len(prompts) >= 2
    # ls ran in Codex's sandbox, and its output came back as a function_call_output the template rendered.
    assert MARKER in prompts[-1].split(RESULT, 1)[1], prompts[-1][-2000:]


@_installed("claude")
def test_claude_code_runs_a_tool_and_answers(scripted, repo, tmp_path):
    url, engine = scripted
    before = len(engine.prompts)
    result = _claude(url, repo, tmp_path / "claude-config", 300)
    answer = json.loads(result.stdout)
    assert answer["is_error"] is False, answer
    assert answer["result"] == ANSWER, answer
    # The tool_use went out, and its tool_result (run or refused by Claude Code's permissions) came back.
    assert any(RESULT in p for p in engine.prompts[before:])


@_installed("claude")
def test_a_second_claude_code_run_is_served_from_the_prefix_cache(repo, tmp_path):
    """Each prompt really prefilled (about 19K tokens on the first request, a minute or more on a CPU), the answers
    scripted: Claude Code's prompts must stay stable across runs for the cache to serve the second."""
    engine = None

    def load():
        nonlocal engine
        engine = ScriptedEngine(Engine.load(progress=False), _lister, prefill=True)
        return engine

    with live_server(load) as url:
        # One user's config for both runs: a fresh config is a first start, whose prompt differs from the start on.
        first = _claude(url, repo, tmp_path / "config", TIMEOUT_S)
        assert json.loads(first.stdout)["is_error"] is False, first.stdout
        before = len(engine.usages)
        second = _claude(url, repo, tmp_path / "config", TIMEOUT_S)
        assert json.loads(second.stdout)["result"] == ANSWER, second.stdout
    usages = engine.usages[before:]
    prompt, cached = sum(u.prompt_tokens for u in usages), sum(u.cached_tokens for u in usages)
    assert prompt > 10_000 and cached / prompt > 0.9, usages


def _reader(repo, n_files: int):
    """Reads f0.txt, f1.txt, ... one call per turn, then answers; summarises when Claude Code compacts."""
    def reply(prompt: str) -> str:
        done = max([int(k) for k in re.findall(r"file (\d+) line 29", prompt)]
                   + [int(k) for k in re.findall(r"READ_UP_TO=(\d+)", prompt)] + [-1])
        if "<summary> block" in prompt[-2000:]:  # Claude Code's compaction request
            return f"<analysis>Reading files.</analysis>\n<summary>Listing the files. READ_UP_TO={done}</summary>"
        if done == n_files - 1:
            return ANSWER
        return "Reading.\n" + fenced_call("Read", {"file_path": str(repo / f"f{done + 1}.txt")})
    return reply


@_installed("claude")
def test_claude_code_compacts_a_session_that_outgrows_the_context(repo, tmp_path):
    """Claude Code believes in a 1M-token window; ours is 32K. When a request no longer fits, the 400 says "prompt
    is too long: N tokens > M maximum", which Claude Code reads to compact the conversation and go on (with our
    earlier wording it stopped with is_error: true)."""
    for k in range(24):  # about 770 tokens of tool result each: 18.7K + 24 x 0.77K outgrows 32K once
        (repo / f"f{k}.txt").write_text("\n".join(f"file {k} line {i}: the quick brown fox" for i in range(30)))
    engine = None

    def load():
        nonlocal engine
        engine = ScriptedEngine(Engine.load(progress=False, ctx_size=32768), _reader(repo, 24))
        return engine

    with live_server(load) as url:
        result = _claude(url, repo, tmp_path / "claude-config", 600)
    answer = json.loads(result.stdout)
    assert answer["is_error"] is False and answer["result"] == ANSWER, answer
    compactions = [i for i, p in enumerate(engine.prompts) if "<summary> block" in p[-2000:]]
    assert compactions, "Claude Code never compacted"
    after = engine.usages[compactions[0] + 1].prompt_tokens
    assert after < engine.usages[compactions[0] - 1].prompt_tokens - 4000 and max(u.prompt_tokens for u in engine.usages) < 32768


@_installed("aider")
def test_aider_applies_an_edit(tmp_path):
    """aider (litellm's OpenAI client, streamed chat completions) with its default edit format for a model it does
    not know: the whole file back, which aider writes."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.py").write_text("print('hi')\n")
    engine = None

    def load():
        nonlocal engine
        engine = ScriptedEngine(Engine.load(progress=False),
                                lambda prompt: "hello.py\n```python\nprint('hello')\n```\n" if "hello.py" in prompt else "OK.")
        return engine

    with live_server(load) as url:
        env = {**os.environ, "HOME": str(tmp_path), "OPENAI_API_KEY": "unused", "OPENAI_API_BASE": f"{url}/v1"}
        result = subprocess.run(
            ["aider", "--model", "openai/gemma", "--no-git", "--yes-always", "--no-show-model-warnings",
             "--no-check-update", "--no-analytics", "--no-pretty", "--message", "Make hello.py say hello.", "hello.py"],
            check=False, cwd=work, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Applied edit to hello.py" in result.stdout, result.stdout[-3000:]
    assert (work / "hello.py").read_text() == "print('hello')\n"
    assert "Make hello.py say hello." in engine.prompts[-1]


@_wanted("codex")
def test_codex_exec_completes(server_url, repo):
    result = _codex(server_url, repo, TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ERROR" not in result.stderr


@_wanted("claude")
def test_claude_code_print_mode_is_not_an_error(server_url, repo, tmp_path):
    result = _claude(server_url, repo, tmp_path / "claude-config", TIMEOUT_S)
    answer = json.loads(result.stdout)
    assert answer["is_error"] is False, answer
