"""The server's output limit for requests that set none (`serve --max-tokens`): Codex CLI and aider send no limit,
and a model that does not stop wrote to the end of the context. Served live with the embedded model's tokenizer and
chat template and a model that never stops, asked through the official SDKs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace

import anthropic
import openai
import pytest

from dflash_agent.api.background import live_server
from dflash_agent.api.service import ServerSettings, max_new_tokens
from dflash_agent.engine import Engine, FinalEvent, GenerateRequest, SamplingDefaults, Timings, TokenEvent, Usage
from dflash_agent.engine.formats.config import ModelConfig
from dflash_agent.engine.formats.gguf import read_gguf
from dflash_agent.engine.load.tokenizer import Tokenizer

CAP = 5
N_CTX = 512
SAY = [{"role": "user", "content": "Write forever."}]


class EndlessEngine:
    """The embedded model's tokenizer and family, with a model that never stops: ' a' until the request's limit or
    the context ends it, as the engine ends it. Records the limit each request reached the engine with."""

    def __init__(self, path) -> None:
        gguf = read_gguf(path)
        self.tokenizer = Tokenizer.from_gguf(path, gguf=gguf)
        config = ModelConfig.from_gguf_fields(gguf.fields, set(gguf.tensors), source=str(path))
        self.model = SimpleNamespace(config=config)
        self.model_path, self.model_name, self.n_ctx = path, "endless", N_CTX
        self.sampling_defaults, self.drafter = SamplingDefaults(), None
        self.parallel, self.slots = 1, []
        self.limits: list[int | None] = []

    stream = Engine.stream

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
        self.limits.append(request.max_tokens)
        if request.on_prefix is not None:
            request.on_prefix(0)
        budget = self.n_ctx - len(request.prompt_ids)
        n = budget if request.max_tokens is None else min(request.max_tokens, budget)
        token = self.tokenizer.encode(" a", add_bos=False)
        for _ in range(n):
            yield TokenEvent(token, " a")
        yield FinalEvent("length", Usage(len(request.prompt_ids), n), Timings(predicted_n=n),
                         context_full=request.max_tokens is None or request.max_tokens > budget)

    def close(self, timeout: float | None = None) -> bool:
        return True


@pytest.fixture(scope="module")
def served(embedded_gguf):
    engine = EndlessEngine(embedded_gguf)
    with live_server(lambda: engine, ServerSettings(max_tokens=CAP)) as url:
        yield url, engine


def last_limit(engine: EndlessEngine, call) -> tuple[int | None, object]:
    before = len(engine.limits)
    result = call()
    assert len(engine.limits) == before + 1
    return engine.limits[-1], result


def test_chat_without_a_limit_stops_at_the_servers(served):
    url, engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    limit, whole = last_limit(engine, lambda: client.chat.completions.create(model="m", messages=SAY))
    assert limit == CAP and whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == CAP
    assert whole.choices[0].message.content == " a" * CAP
    limit, chunks = last_limit(engine, lambda: list(client.chat.completions.create(model="m", messages=SAY,
                                                                                    stream=True)))
    assert limit == CAP and [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_a_requests_own_limit_wins_above_the_servers_too(served):
    url, engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    limit, whole = last_limit(engine, lambda: client.chat.completions.create(model="m", messages=SAY, max_tokens=9))
    assert limit == 9 and whole.usage.completion_tokens == 9
    assert last_limit(engine, lambda: client.chat.completions.create(model="m", messages=SAY,
                                                                     max_completion_tokens=2))[0] == 2
    messages = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages
    limit, message = last_limit(engine, lambda: messages.create(model="m", messages=SAY, max_tokens=11))
    assert limit == 11 and message.stop_reason == "max_tokens" and message.usage.output_tokens == 11


def test_responses_and_completions_without_a_limit(served):
    url, engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    limit, response = last_limit(engine, lambda: client.responses.create(model="m", input="Write forever."))
    assert limit == CAP and response.status == "incomplete" and response.usage.output_tokens == CAP
    assert response.incomplete_details.reason == "max_output_tokens"
    # OpenAI's own default for the legacy endpoint (16) gives way to a lower server limit.
    limit, completion = last_limit(engine, lambda: client.completions.create(model="m", prompt="Once"))
    assert limit == CAP and completion.choices[0].finish_reason == "length"


def test_the_limit_is_the_requests_else_the_servers():
    assert max_new_tokens(None, None, default=8192) == 8192
    assert max_new_tokens(None, 20000, default=8192) == 20000
    assert max_new_tokens(None, default=None) is None  # serve --max-tokens 0: the context is the limit
    with pytest.raises(Exception, match="max_tokens must be at least 1"):
        max_new_tokens(0, default=8192)


def test_two_user_messages_in_a_row_are_one_turn(served):
    """opencode's title request: a system prompt and two user messages, no tools, got a 400 on Gemma 3
    ('messages[2] is user, expected assistant')."""
    url, engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    title = [{"role": "system", "content": "Generate a short title."},
             {"role": "user", "content": "The conversation so far:"}, {"role": "user", "content": "fix the parser"}]
    whole = client.chat.completions.create(model="m", messages=title, max_tokens=2)
    assert whole.choices[0].message.content == " a a"
    messages = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages
    assert messages.create(model="m", max_tokens=1, system="Title.",
                           messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]).content
