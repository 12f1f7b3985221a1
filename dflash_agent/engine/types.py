"""The engine's contract types: requests, sampling, the events a generation yields, usage and timings.

Torch-free, so a client of a remote server (`run --server`) uses the same types without loading torch."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import OptionError, RequestError

# Where a request's omitted sampling fields come from (EngineConfig's `sampling_defaults`): model = the checkpoint's
# recommendation (generation_config.json, GGUF general.sampling.*), none = the interface's own defaults.
SAMPLING_DEFAULTS = ("model", "none")
# How GGUF matrices load (EngineConfig's `weights`): auto = packed where Triton runs (CUDA), exact elsewhere;
# packed = also torch's int4 / int8 kernels on the CPU; exact = dequantized at load.
WEIGHTS = ("auto", "exact", "packed")
# The GEMMs of prompt blocks on the CPU C kernels' path (EngineConfig's `prefill`): float32 on the rows dequantized
# exactly, bfloat16 (weights and activations rounded to bf16, float32 sums) or int8 (activations quantized to int8
# per block of 32 against the weights' own integers, VNNI's byte dots); auto = bfloat16 where the CPU multiplies bf16
# natively (AVX512_BF16 or AMX) and torch's bf16 GEMM measures faster, else int8 where the VNNI kernels run, else
# float32 (packed_linear.prefill_dtype).
PREFILL = ("auto", "float32", "bfloat16", "int8")
# What a KV cache stores (engine.cache.kv_cache): the model's dtype, or 8-bit keys and values.
STORED_KV_DTYPES = ("model", "q8")
# The KV caches' dtype (EngineConfig's `kv_dtype`): one of those, or auto = by the memory plan: the model's dtype
# where the asked context (without one, the model's whole) fits, else q8 where that holds more
# (engine.memory_plan.choose_kv_dtype).
KV_DTYPES = ("auto", *STORED_KV_DTYPES)


def check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise OptionError(f"unknown KV cache type {kv_dtype!r} ({', '.join(KV_DTYPES)})")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # nan and inf sample nothing
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling a checkpoint recommends (generation_config.json, a GGUF's general.sampling.* keys), as vLLM's
    `--generation-config auto` and llama.cpp read them. None: the checkpoint says nothing about that field."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    source: str = ""  # where they were read, for the startup log

    def resolve(self, base: SamplingParams, temperature: float | None = None, top_k: int | None = None,
                top_p: float | None = None, min_p: float | None = None, seed: int | None = None) -> SamplingParams:
        """The one rule every interface merges a request with: a field the request sets wins (an explicit 0 or 1
        too), else the checkpoint's default, else `base`'s (the interface's own: temperature 1 for the HTTP APIs,
        greedy for the CLI). Raises RequestError for a value out of range."""
        given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
        values = {name: next(v for v in (value, getattr(self, name), getattr(base, name)) if v is not None)
                  for name, value in given.items()}
        return SamplingParams(**values, seed=seed if seed is not None else base.seed)

    def fields(self) -> dict[str, float | int]:
        """The values the checkpoint sets, by name (what /v1/models lists)."""
        return {name: value for name in _SAMPLING_FIELDS if (value := getattr(self, name)) is not None}

    @classmethod
    def of(cls, fields: Any, source: str) -> SamplingDefaults:
        """From `fields()` as another process listed them; anything else there is ignored."""
        fields = fields if isinstance(fields, dict) else {}
        return cls(**{name: value for name in _SAMPLING_FIELDS if isinstance(value := fields.get(name), (int, float))
                      and not isinstance(value, bool)}, source=source)

    def describe(self, base: SamplingParams) -> str:
        """What a request that sets nothing gets, and where each value comes from: one line for a startup log."""
        p = self.resolve(base)
        values = ", ".join(f"{name} {getattr(p, name)}" for name in _SAMPLING_FIELDS)
        ours = list(self.fields())
        return f"{values} ({', '.join(ours)} from {self.source})" if ours else f"{values} (none from the model)"


@dataclass(frozen=True)
class StopCriteria:
    token_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()


@dataclass
class SpecStats:
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, kept
    steps: int = 0  # verify forwards that carried at least one draft token
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [steps, drafted, accepted]
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts per speculative step

    def record(self, source: str, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accept_lengths.append(accepted)
        row = self.by_source.setdefault(source, [0, 0, 0])
        row[0] += 1
        row[1] += drafted
        row[2] += accepted

    @property
    def acceptance_length_mean(self) -> float:
        """Tokens committed per speculative verify step (accepted drafts + the bonus token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopCriteria = field(default_factory=StopCriteria)
    max_tokens: int | None = None  # None: until a stop or the context is full
    grammar: Any = None  # an engine.decode.grammar.TokenGrammar (constrained decoding); .matcher() per request
    request_id: str = ""
    cache_prompt: bool = True  # False: neither reuse a cached prefix nor keep this request's KV
    # Called on the engine's thread, before any event, with the number of prompt tokens the prefix cache
    # serves (usage the API reports before the first token: Anthropic's message_start).
    on_prefix: Callable[[int], None] | None = None


@dataclass
class Timings:
    """llama.cpp's names, so clients that read its `timings` object read ours."""

    cache_n: int = 0  # prompt tokens served from the prefix cache
    prompt_n: int = 0  # prompt tokens prefilled (cache_n excluded)
    prompt_ms: float = 0.0
    prompt_per_second: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    predicted_per_second: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0


@dataclass
class SlotInfo:
    """What one slot of the engine is doing (Engine.slots; the API's GET /slots)."""

    id: int
    state: str  # idle, prefilling, decoding
    request_id: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, from the prefix cache
    prefilled_tokens: int = 0  # of the prompt, in the slot's caches so far (cached ones included)
    generated_tokens: int = 0
    tokens_per_second: float = 0.0  # generated, since decoding started
    prompt_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class Usage:
    prompt_tokens: int  # the whole prompt, cached or not
    completion_tokens: int
    cached_tokens: int = 0


@dataclass
class TokenEvent:
    ids: list[int]
    text_delta: str


@dataclass
class FinalEvent:
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: Usage
    timings: Timings
    stop: int | str | None = None  # the stop token id or stop string that ended generation
    spec: SpecStats = field(default_factory=SpecStats)
    context_full: bool = False  # "length" because the context filled up before max_tokens ran out


@dataclass
class ErrorEvent:
    error: Exception


@dataclass
class GenerateResult:
    """A whole generation, as `Engine.complete` returns it."""

    text: str
    ids: list[int]
    final: FinalEvent
