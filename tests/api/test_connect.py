"""`dflash-agent connect CLIENT` against a live server: each client's file in its own format (JSON, TOML), with the
server's URL, context and cap, and the URL it names answering as that client would call it."""

from __future__ import annotations

import json
import socket
import tomllib

import httpx
import pytest
from click.testing import CliRunner

from dflash_agent.api.service import DEFAULT_MAX_TOKENS
from dflash_agent.cli import main


def connect(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["connect", *args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def n_ctx(server_url) -> int:
    return httpx.get(f"{server_url}/v1/models", timeout=60).json()["data"][0]["meta"]["n_ctx"]


def test_codex_profile_is_toml_with_the_servers_context(server_url, n_ctx):
    code, out, err = connect("codex", "--server", server_url)
    assert code == 0 and "~/.codex/dflash.config.toml" in err and "codex --profile dflash" in err
    profile = tomllib.loads(out)
    assert profile["model_provider"] == "dflash" and profile["model_context_window"] == n_ctx
    assert profile["model_max_output_tokens"] == DEFAULT_MAX_TOKENS
    provider = profile["model_providers"]["dflash"]
    assert provider["wire_api"] == "responses"
    assert httpx.get(f"{provider['base_url']}/models", timeout=60).json()["data"][0]["id"] == profile["model"]


def test_claude_codes_settings_carry_its_environment(server_url):
    code, out, _ = connect("claude", "--server", f"{server_url}/v1")  # a /v1 URL is the same server
    env = json.loads(out)["env"]
    assert env["ANTHROPIC_BASE_URL"] == server_url and int(env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"]) >= 600_000
    # where Claude Code sends its requests: the Messages API at the base URL
    reply = httpx.post(f"{env['ANTHROPIC_BASE_URL']}/v1/messages/count_tokens", timeout=60,
                       headers={"x-api-key": env["ANTHROPIC_AUTH_TOKEN"]},
                       json={"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200 and reply.json()["input_tokens"] > 0


def test_opencode_and_aider_know_the_models_limits(server_url, n_ctx):
    _, out, _ = connect("opencode", "--server", server_url)
    config = json.loads(out)
    provider = config["provider"]["dflash"]
    (name, model), = provider["models"].items()
    assert provider["npm"] == "@ai-sdk/openai-compatible" and config["model"] == f"dflash/{name}"
    assert model["limit"] == {"context": n_ctx, "output": DEFAULT_MAX_TOKENS}
    assert httpx.get(f"{provider['options']['baseURL']}/models", timeout=60).status_code == 200
    _, out, err = connect("aider", "--server", server_url)
    (name, metadata), = json.loads(out).items()
    assert name.startswith("openai/") and f"--model {name}" in err
    assert metadata["max_input_tokens"] == n_ctx and metadata["litellm_provider"] == "openai"


def test_write_puts_the_file_in_place_and_never_over_one(server_url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = connect("opencode", "--server", server_url, "--write")
    assert code == 0 and "wrote" in err and json.loads((tmp_path / "opencode.json").read_text())["provider"]
    code, _, err = connect("opencode", "--server", server_url, "--write")
    assert code == 1 and err.startswith("error: ") and "exists" in err
    code, _, _ = connect("claude", "--server", server_url, "--write")
    assert code == 0 and json.loads((tmp_path / ".claude" / "settings.local.json").read_text())["env"]


def test_no_server_is_one_line():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, out, err = connect("codex", "--server", f"http://127.0.0.1:{port}")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1 and "no dflash-agent server" in err


def test_a_vllm_server_is_read_by_its_max_model_len():
    from tests.agent.fake_openai import fake_server

    card = {"id": "google/gemma-4-31B-it", "object": "model", "created": 0, "owned_by": "vllm",
            "root": "google/gemma-4-31B-it", "max_model_len": 131072}
    with fake_server([], card=card) as fake:
        code, out, _ = connect("codex", "--server", fake.url)
    assert code == 0 and "model_context_window = 131072" in out and 'model = "google/gemma-4-31B-it"' in out
