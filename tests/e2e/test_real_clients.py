"""Real coding assistants against a live server with the embedded model: Codex CLI (`@openai/codex`, the
Responses API) and Claude Code (`@anthropic-ai/claude-code`, the Messages API). The model is a tiny base
model, so these check that each client's protocol cycle completes, not the answer.

They run when the client is installed (`npm install -g @openai/codex @anthropic-ai/claude-code`) and
DFLASH_AGENT_REAL_CLIENTS=1 is set: on a 2-core CPU a run prefills Codex's 8K-token or Claude Code's 27K-token
first prompt and takes several minutes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from dflash_agent.api.background import live_server
from dflash_agent.engine.engine import Engine

TIMEOUT_S = 1800


def _wanted(binary: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(shutil.which(binary) is None or os.environ.get("DFLASH_AGENT_REAL_CLIENTS") != "1",
                              reason=f"{binary} not installed or DFLASH_AGENT_REAL_CLIENTS not 1")


@pytest.fixture(scope="module")
def server_url():
    with live_server(lambda: Engine.load(progress=False)) as url:
        yield url


@pytest.fixture
def repo(tmp_path):
    work = tmp_path / "repo"
    work.mkdir()
    (work / "hello.py").write_text("print('hi')\n")
    (work / "README.md").write_text("# demo\n")
    return work


@_wanted("codex")
def test_codex_exec_completes(server_url, repo, tmp_path):
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "gemma"\nmodel_provider = "dflash"\n\n[model_providers.dflash]\nname = "dflash-agent"\n'
        f'base_url = "{server_url}/v1"\nwire_api = "responses"\nstream_idle_timeout_ms = 3600000\n')
    result = subprocess.run(["codex", "exec", "--skip-git-repo-check", "list the files here"], check=False, cwd=repo,
                            env={**os.environ, "CODEX_HOME": str(home)}, capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ERROR" not in result.stderr


@_wanted("claude")
def test_claude_code_print_mode_is_not_an_error(server_url, repo, tmp_path):
    config = tmp_path / "claude-config"
    config.mkdir()
    env = {**os.environ, "ANTHROPIC_BASE_URL": server_url, "ANTHROPIC_AUTH_TOKEN": "unused",
           "CLAUDE_CONFIG_DIR": str(config), "CLAUDE_CODE_ATTRIBUTION_HEADER": "0", "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "API_TIMEOUT_MS": str(TIMEOUT_S * 1000)}
    result = subprocess.run(["claude", "-p", "list the files here", "--output-format", "json"], check=False,
                            cwd=repo, env=env,
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=TIMEOUT_S)
    answer = json.loads(result.stdout)
    assert answer["is_error"] is False, answer
