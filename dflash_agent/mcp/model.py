"""The model an MCP server speaks for: the engine in this process (through the chat layer), or a
running OpenAI-compatible server (through its HTTP API). The MCP tools call either the same way:
`backend()` for chat turns and the agent, `complete()` for raw text, `status()` for the resource."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import httpx
import openai

from ..agent.backend import AssistantTurn, Backend, BackendError, OnDelta, TurnOptions
from ..agent.engine_backend import EngineBackend
from ..agent.remote import RemoteBackend, listed_context
from ..chat.chat_format import LoadedModel
from ..chat.prompt_size import check_prompt_chars
from ..chat.types import Conversation
from ..engine import GenerateRequest, SamplingParams, Usage

log = logging.getLogger(__name__)

# Admission of one request to a server's engine (api.service.Admission behind `serve`'s /mcp): returns the call that
# releases it, or raises BackendError when the queue is full. MCP calls and HTTP requests then share one queue.
Admit = Callable[[], Callable[[], None]]

LOAD_POLL_S = 0.05  # how often a call waiting for the model checks whether it has loaded


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str
    usage: Usage
    timings: dict[str, Any] | None  # llama.cpp's names, when the model reports them


class ModelAccess(Protocol):
    name: str

    async def backend(self, temperature: float | None = None) -> Backend:
        """A chat backend (for `chat` and the agent); waits for the model to load. `temperature` None: the
        model's recommended sampling, else greedy."""
        ...

    async def complete(self, prompt: str, max_tokens: int, temperature: float | None = None) -> Completion:
        """Raw text completion of `prompt`, no chat template; waits for the model to load."""
        ...

    async def status(self) -> dict[str, Any]:
        """What the status resource shows; never waits for the model."""
        ...

    async def aclose(self) -> None: ...


class LastRequest:
    """Speed and speculation figures of the last generation made through this server, from the
    llama.cpp `timings` every backend reports."""

    def __init__(self) -> None:
        self.timings: dict[str, Any] | None = None
        self.requests = 0

    def record(self, timings: dict[str, Any] | None) -> None:
        self.requests += 1
        self.timings = timings or None

    def as_dict(self) -> dict[str, Any] | None:
        t = self.timings
        if t is None:
            return None
        out = {
            "prompt_tokens": t.get("prompt_n", 0) + t.get("cache_n", 0),
            "cached_tokens": t.get("cache_n", 0),
            "generated_tokens": t.get("predicted_n", 0),
            "prefill_tokens_per_second": round(t.get("prompt_per_second", 0.0), 2),
            "decode_tokens_per_second": round(t.get("predicted_per_second", 0.0), 2),
        }
        drafted, accepted, generated = t.get("draft_n", 0), t.get("draft_n_accepted", 0), t.get("predicted_n", 0)
        if drafted:
            out["draft_tokens"] = drafted
            out["draft_accepted"] = accepted
            out["draft_acceptance_rate"] = round(accepted / drafted, 3)
            # Every target forward of a decode commits its accepted drafts plus one token of its own, so
            # forwards = generated - accepted; the ratio is the speed-up over one token per forward.
            if generated > accepted:
                out["acceptance_length"] = round(generated / (generated - accepted), 3)
        return out


def _always() -> Callable[[], None]:
    """Admission where there is no queue to share (the stdio server, a remote model)."""
    return lambda: None


class _Recording:
    """A backend whose turns are counted in the status resource."""

    def __init__(self, inner: Backend, last: LastRequest, admit: Admit = _always) -> None:
        self.inner = inner
        self.last = last
        self.admit = admit

    async def turn(self, conversation: Conversation, options: TurnOptions, on_delta: OnDelta) -> AssistantTurn:
        release = self.admit()
        try:
            turn = await self.inner.turn(conversation, options, on_delta)
        finally:
            release()
        self.last.record(turn.timings)
        return turn


class LocalModel:
    """The engine in this process. `poll` returns the model once it has loaded, None while it is
    loading, and raises what the load raised; so the server answers at once and calls that need the
    model wait for it."""

    def __init__(self, poll: Callable[[], LoadedModel | None], name: str, admit: Admit | None = None) -> None:
        self._poll = poll
        self.name = name
        self.admit = admit if admit is not None else _always
        self.last = LastRequest()
        self._ids = itertools.count()

    async def model(self) -> LoadedModel:
        while (model := self._poll()) is None:
            await asyncio.sleep(LOAD_POLL_S)
        return model

    async def backend(self, temperature: float | None = None) -> Backend:
        model = await self.model()
        sampling = model.engine.sampling_defaults.resolve(SamplingParams(), temperature)
        return _Recording(EngineBackend(model.engine, model.chat, sampling), self.last, self.admit)

    async def complete(self, prompt: str, max_tokens: int, temperature: float | None = None) -> Completion:
        engine = (await self.model()).engine
        sampling = engine.sampling_defaults.resolve(SamplingParams(), temperature)
        # refused by its length first, then tokenized in a thread: the event loop serves every other client
        check_prompt_chars(len(prompt), engine.tokenizer, engine.n_ctx)
        ids = await asyncio.to_thread(engine.tokenizer.encode, prompt)
        request = GenerateRequest(ids, sampling, max_tokens=max_tokens,
                                  request_id=f"mcp-{id(self):x}-{next(self._ids)}")
        release = self.admit()
        try:
            result = await engine.complete(request)  # the client's MCP cancel cancels the request with this task
        finally:
            release()
        timings = asdict(result.final.timings)
        self.last.record(timings)
        return Completion(result.text, result.final.finish_reason, result.final.usage, timings)

    async def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.name, "backend": "in-process engine"}
        try:
            model = self._poll()
        except Exception as exc:  # the load's failure, whatever it was, is what the status shows
            return {**out, "state": "failed", "error": str(exc)}
        if model is None:
            return {**out, "state": "loading"}
        engine = model.engine
        out.update(model=model.name, state="ready", n_ctx=engine.n_ctx, family=engine.model.config.family,
                   device=str(engine.model.device))
        out["drafter"] = ({"block_size": engine.drafter.config.block_size} if engine.drafter is not None else None)
        out["speculation"] = {"enabled": engine.spec.enabled, "prompt_lookup": engine.spec.ngram,
                              "block": engine.spec.block or "adaptive"}
        stats = engine.prefix_stats
        out["prefix_cache"] = None if stats is None else {
            "requests": stats.requests, "hits": stats.hits, "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens, "hit_ratio": round(stats.hit_ratio, 3), "entries": stats.entries,
        }
        out["requests"] = self.last.requests
        out["last_request"] = self.last.as_dict()
        return out

    async def aclose(self) -> None:
        pass  # the engine belongs to whoever loaded it


# Prometheus samples of each server, by the name status gives them
SERVER_METRICS = {
    "dflash_prompt_cache_hits_total": "prefix_cache_hits",
    "dflash_prompt_tokens_cached_total": "prefix_cached_tokens",
    "dflash_spec_draft_tokens_total": "draft_tokens",
    "dflash_spec_accepted_tokens_total": "draft_accepted",
    "dflash_decode_tokens_per_second": "decode_tokens_per_second",
    "dflash_requests_processing": "requests_running",
    "dflash_requests_queued": "requests_waiting",
    # vLLM (V1 engine): the prefix cache counts tokens, queried and hit
    "vllm:prefix_cache_hits_total": "prefix_cached_tokens",
    "vllm:prefix_cache_queries_total": "prefix_queried_tokens",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "draft_accepted",
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generated_tokens",
    # SGLang
    "sglang:num_running_reqs": "requests_running",
    "sglang:num_queue_reqs": "requests_waiting",
    "sglang:cache_hit_rate": "prefix_cache_hit_rate",
    "sglang:spec_accept_length": "spec_accept_length",
    "sglang:prompt_tokens_total": "prompt_tokens",
    "sglang:generation_tokens_total": "generated_tokens",
}


class RemoteModel:
    """A running OpenAI-compatible server (`dflash-agent serve`, llama.cpp, vLLM): chat through the
    agent's RemoteBackend, completions through its `openai` client, and status from the server's
    /v1/models and Prometheus /metrics where it has them."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None) -> None:
        """`base_url`: the OpenAI API root, e.g. http://127.0.0.1:8080/v1 (a URL without a path gets
        /v1). `model`: the id to ask for (None: the first one the server lists)."""
        self._api_key = api_key
        # One backend (one connection pool) per sampling temperature, all kept for the session.
        self._backends = {0.0: RemoteBackend(base_url, model, 0.0, api_key)}
        self.base_url = self._backends[0.0].base_url
        self.name = model or "the served model"
        self._http = httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"} if api_key else {}, timeout=5)
        self.last = LastRequest()

    async def _model_id(self) -> str:
        self.name = await self._backends[0.0].model_id()
        return self.name

    async def _backend(self, temperature: float | None) -> RemoteBackend:
        model = await self._model_id()
        if temperature not in self._backends:
            self._backends[temperature] = RemoteBackend(self.base_url, model, temperature, self._api_key)
        return self._backends[temperature]

    async def backend(self, temperature: float | None = None) -> Backend:
        return _Recording(await self._backend(temperature), self.last)

    async def complete(self, prompt: str, max_tokens: int, temperature: float | None = None) -> Completion:
        backend = await self._backend(temperature)
        sampling = await backend.sampling()
        try:
            out = await backend.retried(lambda: backend.client.completions.create(
                model=backend.model, prompt=prompt, max_tokens=max_tokens, **sampling))
        except openai.APIError as exc:
            raise backend.error(exc) from None
        if not out.choices:
            raise BackendError(f"the server at {self.base_url} sent a completion without choices")
        timings = (out.model_extra or {}).get("timings")
        self.last.record(timings)
        usage = Usage(out.usage.prompt_tokens, out.usage.completion_tokens) if out.usage else Usage(0, 0)
        return Completion(out.choices[0].text, out.choices[0].finish_reason or "stop", usage, timings)

    async def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.name, "backend": f"server at {self.base_url}"}
        try:
            listed = (await self._http.get(f"{self.base_url}/models")).json()
            card = next((m for m in listed.get("data", []) if m.get("id") == self.name), None) \
                or (listed.get("data") or [None])[0]
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            return {**out, "state": "unreachable", "error": f"{type(exc).__name__}: {exc}"}
        if card:
            meta = card.get("meta") if isinstance(card.get("meta"), dict) else {}
            out.update(model=card.get("id", self.name), state="ready", n_ctx=listed_context(card),
                       family=meta.get("family"), drafter=meta.get("draft"))
        out["server_metrics"] = await self._metrics()
        out["requests"] = self.last.requests
        out["last_request"] = self.last.as_dict()
        return out

    async def _metrics(self) -> dict[str, float] | None:
        """Prefix-cache, speculation and queue figures from the server's Prometheus /metrics, in one set of names
        whichever server it is (ours, vLLM's, SGLang's; None where it has none). A figure with labels (vLLM's
        model_name, engine) is their sum."""
        from prometheus_client.parser import text_string_to_metric_families

        root = self.base_url.removesuffix("/v1")
        try:
            response = await self._http.get(f"{root}/metrics")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        found: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(response.text):
                for sample in family.samples:
                    if sample.name in SERVER_METRICS:
                        name = SERVER_METRICS[sample.name]
                        found[name] = found.get(name, 0.0) + sample.value
        except ValueError:
            return None
        return found or None

    async def aclose(self) -> None:
        for backend in self._backends.values():
            await backend.close()
        await self._http.aclose()
