"""What an engine is loaded with: `EngineConfig`, the one validated set of `Engine.from_config`'s options, and the
speculation settings it carries (`SpecConfig`).

Torch-free, like the rest of the contract: `options.load_engine` builds and checks it before torch loads."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import OptionError
from .types import PREFILL, SAMPLING_DEFAULTS, WEIGHTS, check_kv_dtype

EMBEDDED = "embedded"  # the model name of the bundled model (load.weights)


@dataclass
class SpecConfig:
    enabled: bool = True
    block: int | None = None  # fixed block size (anchor + drafts) for benchmarks; None = adaptive
    ngram: bool = True  # prompt-lookup proposals
    ngram_min: int = 2
    ngram_max: int = 4
    # A copy: once the last `copy_match` tokens occurred before, drafts run as far as that continuation goes (up to
    # NGRAM_MAX_DRAFT), measured by the controller apart from short matches (llama.cpp's ngram-mod matches 24).
    copy_match: int | None = 16


@dataclass(frozen=True)
class EngineConfig:
    """The options an engine loads with, checked here (OptionError) before any weight loads, which takes a while.

    draft: a DFlash drafter checkpoint, or a Gemma 4 assistant (MTP) one (engine.model.mtp); None takes the
    model's bundled one, if it has one and speculation is on (spec.enabled).
    prefix_cache: reuse the KV of earlier requests (PrefixCacheConfig's defaults: stored
    conversations in up to a quarter of RAM, at most 8 GiB, and at most 16 of them).
    kv_dtype: "model" (the model's dtype), "q8" (8-bit keys and values, about half the memory) or "auto" (the
    model's where the context fits, else q8 where that holds more: engine.memory_plan.choose_kv_dtype).
    draft_ctx: a DFlash drafter reads at most the last `draft_ctx` tokens of the context in every layer
    (DrafterConfig.with_context_window), so its cache stops growing with the context; None: the whole context.
    weights: "auto" (GGUF matrices stay packed: Triton kernels on CUDA, kernels.cpu.cpu_dot on the CPU where a
    vector build of it runs, else dequantized where that fits in RAM, else packed: memory_plan.cpu_weights),
    "packed" (also on the CPU without the C kernels, through torch's int4 / int8 kernels;
    engine.model.packed) or "exact"
    (dequantized at load to `dtype`: bit-exact against gguf-py, what the parity tests use). Safetensors
    checkpoints always load exactly.
    threads: CPU threads (default: the physical cores).
    sampling_defaults: "model" (the checkpoint's recommended sampling fills what a request leaves out:
    engine.load.generation_config) or "none".
    parallel: slots, requests served at once (engine.scheduler), each with a `ctx_size`-token context; None:
    AUTO_PARALLEL on the CPU, whose C layers batch the slots' rows, and 1 on CUDA, where the slots divide the
    card's memory and the batched steps have not yet been timed to earn it (README, GPU path).
    prefill: the dtype of prompt blocks' GEMMs on the CPU C kernels' path (engine.types.PREFILL): "float32"
    (exact on the dequantized weights), "bfloat16", or "auto" (bfloat16 where the CPU has native bf16 dots)."""

    model: str = EMBEDDED
    draft: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    ctx_size: int | None = None
    progress: bool = True
    spec: SpecConfig | None = None
    draft_quant: str | None = None
    prefix_cache: bool = True
    kv_dtype: str = "auto"
    weights: str = "auto"
    threads: int | None = None
    sampling_defaults: str = "model"
    parallel: int | None = 1
    prefill: str = "auto"
    draft_ctx: int | None = None

    def __post_init__(self) -> None:
        check_kv_dtype(self.kv_dtype)
        if self.draft_ctx is not None and self.draft_ctx < 1:
            raise OptionError(f"draft_ctx must be >= 1 token, got {self.draft_ctx}")
        if self.draft_ctx is not None and self.spec is not None and not self.spec.enabled:
            raise OptionError("draft_ctx bounds the drafter's context, but speculation is off")
        if self.parallel is not None and self.parallel < 1:
            raise OptionError(f"parallel must be >= 1 slot, got {self.parallel}")
        if self.weights not in WEIGHTS:
            raise OptionError(f"unknown weights mode {self.weights!r} ({', '.join(WEIGHTS)})")
        if self.prefill not in PREFILL:
            raise OptionError(f"unknown prefill dtype {self.prefill!r} ({', '.join(PREFILL)})")
        if self.sampling_defaults not in SAMPLING_DEFAULTS:
            raise OptionError(f"unknown sampling defaults {self.sampling_defaults!r} ({', '.join(SAMPLING_DEFAULTS)})")
