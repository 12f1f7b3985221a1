"""Engines for the tests, over a model loaded once per set of weight options: an Engine.load of the embedded model
repacks its weights (and, on VNNI machines, builds the LM head's screen), which is most of what a test that serves
a few requests costs."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from dflash_agent.engine.decode.speculative import SpecConfig
from dflash_agent.engine.engine import DEFAULT_PREFIX_CACHE, Engine, pick_device, pick_dtype, set_threads
from dflash_agent.engine.engine_config import EngineConfig
from dflash_agent.engine.load.tokenizer import Tokenizer
from dflash_agent.engine.memory_plan import cpu_context_size
from dflash_agent.engine.model.drafter import Drafter
from dflash_agent.engine.model.gemma import GemmaModel
from dflash_agent.engine.model.mtp import MtpDrafter
from dflash_agent.engine.model.packed import cpu_dot
from dflash_agent.engine.runner import StepRunner
from dflash_agent.engine.types import SamplingDefaults

# Engine.load's options that make the model and its drafter; the others are the engine's own
WEIGHT_OPTIONS = ("model", "draft", "device", "dtype", "weights", "draft_quant", "threads", "sampling_defaults",
                  "prefill")
_DEFAULTS = {f.name: f.default for f in fields(EngineConfig) if f.name in WEIGHT_OPTIONS}


@dataclass(frozen=True)
class _Loaded:
    """What an Engine.load built that outlives its engine."""

    model: GemmaModel
    runner: StepRunner  # its C layers, built once with the model
    tokenizer: Tokenizer
    drafter: Drafter | MtpDrafter | None
    model_name: str
    model_path: Path | None
    sampling_defaults: SamplingDefaults


class EngineFactory:
    """`factory(ctx_size, spec=..., parallel=..., **weights)` is `Engine.load(ctx_size=ctx_size, spec=spec,
    parallel=parallel, ..., **weights)`, weights being WEIGHT_OPTIONS. Each call returns an Engine of its own
    (worker, slots, KV and prefix caches, speculation controllers), which the caller closes; the engines share the
    model and the drafter, which nothing a request does changes. Off the CPU every call loads: a GPU's context and
    CUDA graphs are planned for the engine's slots and memory. A test that changes how Engine.load chooses (a
    monkeypatched CPU, memory plan) calls Engine.load itself."""

    def __init__(self) -> None:
        self._loaded: dict[tuple, _Loaded] = {}

    def __call__(self, ctx_size: int, spec: SpecConfig | None = None, parallel: int = 1, prefix_cache: bool = True,
                 kv_dtype: str = "auto", **weights) -> Engine:
        if set(weights) - set(WEIGHT_OPTIONS):
            raise TypeError(f"not a weight option of Engine.load: {sorted(set(weights) - set(WEIGHT_OPTIONS))}")
        options = _DEFAULTS | weights
        device = pick_device(options["device"])
        if device.type != "cpu":
            return Engine.load(ctx_size=ctx_size, progress=False, spec=spec, parallel=parallel,
                               prefix_cache=prefix_cache, kv_dtype=kv_dtype, **weights)
        # "auto" and what it resolves to here load the same model
        options |= dict(device=str(device), dtype=str(pick_dtype(options["dtype"], device)).removeprefix("torch."))
        # and per kernels library: its thread counts are set per object, and a test that clears cpu_dot's cache
        # (a CPU without the vector builds) leaves models over the one before
        key = (*options.items(), cpu_dot())
        if key not in self._loaded:
            # with speculation left on, the model's bundled drafter loads too, for the engines that draft
            first = Engine.load(ctx_size=ctx_size, progress=False, **options)
            first.close()
            self._loaded[key] = _Loaded(first.model, first.runner, first.tokenizer, first.drafter, first.model_name,
                                        first.model_path, first.sampling_defaults)
        loaded = self._loaded[key]
        set_threads(options["threads"])  # as Engine.load sets them, whatever a test before set
        # Engine.load's rule: the bundled drafter where speculation is on, a named one always
        drafts = options["draft"] is not None or spec is None or spec.enabled
        n_ctx = cpu_context_size(loaded.model.config, {}, loaded.model.dtype, ctx_size)
        return Engine(loaded.model, loaded.tokenizer, n_ctx, loaded.model_name,
                      drafter=loaded.drafter if drafts else None, spec=spec, model_path=loaded.model_path,
                      prefix_cache=DEFAULT_PREFIX_CACHE if prefix_cache else None,
                      kv_dtype="model" if kv_dtype == "auto" else kv_dtype,  # as Engine.load resolves it on the CPU
                      sampling_defaults=loaded.sampling_defaults, parallel=parallel, runner=loaded.runner)
