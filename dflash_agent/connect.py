"""`dflash-agent connect CLIENT`: the configuration a coding client needs for a running server, with the server's own
context and output cap read from its /v1/models, printed or (--write) written to a file of its own."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import click
import httpx

from .errors import UserError
from .options import server_api_key, user_errors

DEFAULT_SERVER = "http://127.0.0.1:8080"
# Claude Code ends a stream its idle timer finds silent; a CPU's prefill of its first prompt can outlast the default
CLAUDE_IDLE_TIMEOUT_MS = 1_200_000


@dataclass(frozen=True)
class ServedModel:
    """What the server says of its model (GET /v1/models)."""

    url: str  # the server's root, no /v1
    model: str
    n_ctx: int
    max_output_tokens: int | None  # the server's cap on an answer that sets none


@dataclass(frozen=True)
class ClientConfig:
    """A client's configuration: `text` to put at `path` (relative: to the working directory; ~: the home), and how to
    start the client with it."""

    path: str
    text: str
    run: str


def served_model(url: str, api_key: str | None = None) -> ServedModel:
    root = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{root}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise UserError(f"no dflash-agent server answers at {root} ({exc}); start one with `dflash-agent serve`, "
                        "or pass --server URL") from None
    if response.status_code == 503:
        raise UserError(f"the server at {root} is still loading its model; try again when /health answers 200")
    if response.status_code != 200:
        raise UserError(f"{root}/v1/models answered {response.status_code}: {response.text[:200]}")
    try:
        card = response.json()["data"][0]
        meta = card.get("meta") or {}
        # ours (and llama.cpp's) say the context in meta; vLLM's card says max_model_len
        context = meta.get("n_ctx") or card["max_model_len"]
        return ServedModel(root, card["id"], int(context), meta.get("max_output_tokens"))
    except (ValueError, KeyError, IndexError, TypeError):
        raise UserError(f"{root}/v1/models lists no model with its context length (dflash-agent's server says "
                        "meta.n_ctx, vLLM max_model_len)") from None


def claude_code(served: ServedModel) -> ClientConfig:
    """A project's local settings (`.claude/settings.local.json`, which Claude Code reads and git ignores): the
    `env` it starts with."""
    # no model names: the server serves its one model under whatever name a request gives
    env = {"ANTHROPIC_BASE_URL": served.url, "ANTHROPIC_AUTH_TOKEN": "unused",
           "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(CLAUDE_IDLE_TIMEOUT_MS)}
    return ClientConfig(".claude/settings.local.json", json.dumps({"env": env}, indent=2) + "\n", "claude")


def codex(served: ServedModel) -> ClientConfig:
    """A profile file of its own (`codex --profile dflash`), so nothing lands inside a table of config.toml; the
    context window is the server's, so Codex compacts before the server refuses a prompt."""
    lines = [f"model = {json.dumps(served.model)}", 'model_provider = "dflash"',
             f"model_context_window = {served.n_ctx}"]
    if served.max_output_tokens is not None:
        lines.append(f"model_max_output_tokens = {served.max_output_tokens}")
    lines += ["", "[model_providers.dflash]", 'name = "dflash-agent"', f"base_url = {json.dumps(served.url + '/v1')}",
              'wire_api = "responses"']
    return ClientConfig("~/.codex/dflash.config.toml", "\n".join(lines) + "\n", "codex --profile dflash")


def opencode(served: ServedModel) -> ClientConfig:
    """A project's opencode.json: an OpenAI-compatible provider whose model carries the server's limits."""
    limit = {"context": served.n_ctx, "output": served.max_output_tokens or served.n_ctx}
    config = {"$schema": "https://opencode.ai/config.json",
              "provider": {"dflash": {"npm": "@ai-sdk/openai-compatible", "name": "dflash-agent",
                                      "options": {"baseURL": served.url + "/v1"},
                                      "models": {served.model: {"name": f"{served.model} (dflash-agent)",
                                                                "limit": limit}}}},
              "model": f"dflash/{served.model}"}
    return ClientConfig("opencode.json", json.dumps(config, indent=2) + "\n", "opencode")


def aider(served: ServedModel) -> ClientConfig:
    """aider's model metadata (`.aider.model.metadata.json`, read from the git root): litellm then knows the
    context, so aider neither warns nor guesses; the server is the OpenAI-compatible one behind openai/."""
    name = f"openai/{served.model}"
    metadata = {name: {"max_input_tokens": served.n_ctx, "max_tokens": served.max_output_tokens or served.n_ctx,
                       "max_output_tokens": served.max_output_tokens or served.n_ctx, "input_cost_per_token": 0.0,
                       "output_cost_per_token": 0.0, "litellm_provider": "openai", "mode": "chat"}}
    run = f"OPENAI_API_BASE={served.url}/v1 OPENAI_API_KEY=unused aider --model {name}"
    return ClientConfig(".aider.model.metadata.json", json.dumps(metadata, indent=2) + "\n", run)


CLIENTS = {"claude": claude_code, "codex": codex, "opencode": opencode, "aider": aider}


def write_config(config: ClientConfig, cwd: Path) -> Path:
    """Write `config` where it goes; an existing file is left as it is (a UserError says so)."""
    path = Path(os.path.expanduser(config.path))
    path = path if path.is_absolute() else cwd / path
    if path.exists():
        raise UserError(f"{path} exists: not overwritten (merge what `dflash-agent connect` prints into it, or move "
                        "it away)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.text)
    return path


@click.command()
@click.argument("client", type=click.Choice(sorted(CLIENTS)))
@click.option("--server", envvar="DFLASH_AGENT_SERVER", default=DEFAULT_SERVER, show_default=True, metavar="URL",
              help="The running dflash-agent server. Env: DFLASH_AGENT_SERVER.")
@click.option("--write", is_flag=True, help="Write the file (never over an existing one) instead of printing it.")
@user_errors
def connect(client: str, server: str, write: bool) -> None:
    """Print (or --write) CLIENT's configuration for a running server, with the server's context and output cap."""
    served = served_model(server, server_api_key())
    config = CLIENTS[client](served)
    if write:
        path = write_config(config, Path.cwd())
        click.echo(f"wrote {path}; start the client with: {config.run}", err=True)
        return
    click.echo(f"# {config.path}  (context {served.n_ctx} tokens; then: {config.run})", err=True)
    click.echo(config.text, nl=False)
