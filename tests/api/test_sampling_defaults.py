"""The checkpoint's recommended sampling as the default of every interface: the embedded model copied with
general.sampling.* keys (by gguf-py's own metadata tool), served live and asked through the official SDKs, the
agent's remote backend and the CLI. The engine records the SamplingParams each request reached it with."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import anthropic
import httpx
import openai
import pytest
from click.testing import CliRunner

from dflash_agent.agent.backend import TurnOptions
from dflash_agent.agent.remote import RemoteBackend
from dflash_agent.api.background import live_server
from dflash_agent.chat.chat_format import LoadedModel
from dflash_agent.chat.types import Conversation, Message, TextPart
from dflash_agent.cli import main
from dflash_agent.engine import Engine, GenerateRequest, SamplingParams
from dflash_agent.mcp.model import LocalModel
from tests.engine.sampling_gguf import with_sampling

MODEL = SamplingParams(temperature=0.6, top_k=64, top_p=0.95, min_p=0.05)  # what the copy recommends
SAY = [{"role": "user", "content": "Say hi."}]


class RecordingEngine:
    """The real engine, noting the sampling of every request."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.sampling: list[SamplingParams] = []

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    stream = Engine.stream

    def close(self, timeout: float | None = None) -> bool:
        return True  # shared by the tests; the server's lifespan closes the real one

    async def generate(self, request: GenerateRequest) -> AsyncIterator:
        self.sampling.append(request.sampling)
        async for event in self._engine.generate(request):
            yield event


@pytest.fixture(scope="module")
def model_path(embedded_gguf, tmp_path_factory):
    return with_sampling(embedded_gguf, tmp_path_factory.mktemp("sampling") / "gemma3-sampling.gguf")


@pytest.fixture(scope="module")
def served(model_path):
    engines: list[RecordingEngine] = []

    def load() -> RecordingEngine:
        engines.append(RecordingEngine(Engine.load(str(model_path), progress=False, ctx_size=512)))
        return engines[0]

    with live_server(load) as url:
        yield url, engines[0]


def last(engine: RecordingEngine, call) -> SamplingParams:
    before = len(engine.sampling)
    call()
    assert len(engine.sampling) == before + 1
    return engine.sampling[-1]


def test_models_lists_the_defaults(served):
    url, _ = served
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["meta"]["sampling_defaults"] == {"temperature": 0.6, "top_k": 64, "top_p": 0.95, "min_p": 0.05}


def test_openai_chat_and_completions(served):
    url, engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def chat(**sampling):
        return lambda: client.chat.completions.create(model="m", messages=SAY, max_tokens=1, **sampling)

    assert last(engine, chat()) == MODEL
    assert last(engine, chat(temperature=0)) == SamplingParams(0.0, 64, 0.95, 0.05)
    assert last(engine, chat(temperature=1, top_p=1, extra_body={"top_k": 0, "min_p": 0})) == SamplingParams(1.0)
    assert last(engine, chat(seed=3, extra_body={"top_k": 5})) == SamplingParams(0.6, 5, 0.95, 0.05, seed=3)
    completion = lambda **s: lambda: client.completions.create(model="m", prompt="x", max_tokens=1, **s)  # noqa: E731
    assert last(engine, completion()) == MODEL
    assert last(engine, completion(temperature=1)) == SamplingParams(1.0, 64, 0.95, 0.05)


def test_a_bad_value_is_still_a_400(served):
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="top_p must be in"):
        client.chat.completions.create(model="m", messages=SAY, max_tokens=1, top_p=0)


def test_anthropic_messages(served):
    url, engine = served
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)

    def message(**extra):
        return lambda: client.messages.create(model="claude", max_tokens=1, messages=SAY, extra_body=extra)

    assert last(engine, message()) == MODEL
    assert last(engine, message(temperature=1.0)) == SamplingParams(1.0, 64, 0.95, 0.05)
    assert last(engine, message(temperature=0, top_k=0)) == SamplingParams(0.0, 0, 0.95, 0.05)


def test_responses_reports_the_sampling_it_used(served):
    url, engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    response = client.responses.create(model="m", input="Say hi.", max_output_tokens=1)
    assert engine.sampling[-1] == MODEL
    assert (response.temperature, response.top_p) == (0.6, 0.95)
    response = client.responses.create(model="m", input="Say hi.", max_output_tokens=1, temperature=0)
    assert engine.sampling[-1] == SamplingParams(0.0, 64, 0.95, 0.05)
    assert response.temperature == 0


def test_the_remote_agent_samples_as_the_model_loaded_here_would(served):
    url, engine = served
    conversation = Conversation(messages=[Message(role="user", content=[TextPart("Say hi.")])])

    async def turn(backend: RemoteBackend):
        try:
            await backend.turn(conversation, TurnOptions(max_tokens=1), lambda delta: None)
            return await backend.sampling()
        finally:
            await backend.close()

    sent = asyncio.run(turn(RemoteBackend(url, temperature=None)))
    assert sent == {"temperature": 0.6, "top_p": 0.95, "extra_body": {"top_k": 64, "min_p": 0.05}}
    assert engine.sampling[-1] == MODEL == engine.sampling_defaults.resolve(SamplingParams())
    assert asyncio.run(turn(RemoteBackend(url, temperature=0.0))) == {"temperature": 0.0}
    assert engine.sampling[-1] == SamplingParams(0.0, 64, 0.95, 0.05)  # the server fills in the rest


def _generate(model_path, *args: str) -> dict:
    result = CliRunner().invoke(main, ["generate", "Hi", "--model", str(model_path), "--ctx-size", "64",
                                       "--max-tokens", "1", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])["stats"]["sampling"]


def test_generate_cli(model_path):
    assert _generate(model_path) == {"temperature": 0.6, "top_k": 64, "top_p": 0.95, "min_p": 0.05, "seed": None}
    assert _generate(model_path, "--temperature", "0", "--seed", "1") == {
        "temperature": 0.0, "top_k": 64, "top_p": 0.95, "min_p": 0.05, "seed": 1}
    # Off: the CLI's own defaults (greedy, no truncation), as with a model that recommends nothing.
    assert _generate(model_path, "--sampling-defaults", "none", "--top-k", "5") == {
        "temperature": 0.0, "top_k": 5, "top_p": 1.0, "min_p": 0.0, "seed": None}


def test_mcp_tools_on_the_model_loaded_in_process(served):
    _, engine = served
    model = LocalModel(lambda: LoadedModel.of(engine), "m")
    conversation = Conversation(messages=[Message(role="user", content=[TextPart("Say hi.")])])

    async def calls():
        await model.complete("x", 1)
        await model.complete("x", 1, temperature=0.0)
        await (await model.backend()).turn(conversation, TurnOptions(max_tokens=1), lambda delta: None)
        await (await model.backend(1.0)).turn(conversation, TurnOptions(max_tokens=1), lambda delta: None)

    asyncio.run(calls())
    assert engine.sampling[-4:] == [MODEL, SamplingParams(0.0, 64, 0.95, 0.05), MODEL,
                                    SamplingParams(1.0, 64, 0.95, 0.05)]


@pytest.mark.parametrize(("args", "expected"), [
    ((), MODEL),
    (("--temperature", "0"), SamplingParams(0.0, 64, 0.95, 0.05)),
])
def test_agent_run_on_the_model_loaded_in_process(served, tmp_path, monkeypatch, args, expected):
    _, engine = served
    options: list[dict] = []
    monkeypatch.setattr("dflash_agent.agent.commands.load_engine", lambda **kw: options.append(kw) or engine)
    result = CliRunner().invoke(main, ["run", "Say hi.", "--repo", str(tmp_path), "--max-steps", "1",
                                       "--max-turn-tokens", "1", "--sampling-defaults", "none", *args])
    assert options[0]["sampling_defaults"] == "none"  # handed to the load (this engine has loaded already)
    assert result.exit_code in (0, 3, 4), result.output
    assert engine.sampling[-1] == expected
