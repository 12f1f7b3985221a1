"""Engines for the tests, over a model loaded once per set of weight options: an Engine.load of the embedded model
repacks its weights (and, on VNNI machines, builds the LM head's screen), which is most of what a test that serves
a few requests costs."""

from __future__ import annotations

import inspect

from dflash_agent.engine.decode.speculative import SpecConfig
from dflash_agent.engine.engine import DEFAULT_PREFIX_CACHE, Engine, pick_device, pick_dtype, set_threads
from dflash_agent.engine.memory_plan import cpu_context_size

# Engine.load's options that make the model and its drafter; the others are the engine's own
WEIGHT_OPTIONS = ("model", "draft", "device", "dtype", "weights", "draft_quant", "threads", "sampling_defaults",
                  "prefill")
_DEFAULTS = {name: inspect.signature(Engine.load).parameters[name].default for name in WEIGHT_OPTIONS}


class EngineFactory:
    """`factory(ctx_size, spec=..., parallel=..., **weights)` is `Engine.load(ctx_size=ctx_size, spec=spec,
    parallel=parallel, ..., **weights)`, weights being WEIGHT_OPTIONS. Each call returns an Engine of its own
    (worker, slots, KV and prefix caches, speculation controllers), which the caller closes; the engines share the
    model and the drafter, which nothing a request does changes. Off the CPU every call loads: a GPU's context and
    CUDA graphs are planned for the engine's slots and memory. A test that changes how Engine.load chooses (a
    monkeypatched CPU, memory plan) calls Engine.load itself."""

    def __init__(self) -> None:
        self._loaded: dict[tuple, Engine] = {}

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
        key = tuple(options.items())
        if key not in self._loaded:
            # with speculation left on, the model's bundled drafter loads too, for the engines that draft
            self._loaded[key] = Engine.load(ctx_size=ctx_size, progress=False, **options)
            self._loaded[key].close()
        base = self._loaded[key]
        set_threads(options["threads"])  # as Engine.load sets them, whatever a test before set
        # Engine.load's rule: the bundled drafter where speculation is on, a named one always
        drafts = options["draft"] is not None or spec is None or spec.enabled
        n_ctx = cpu_context_size(base.model.config, {}, base.model.dtype, ctx_size)
        return Engine(base.model, base.tokenizer, n_ctx, base.model_name, drafter=base.drafter if drafts else None,
                      spec=spec, model_path=base.model_path,
                      prefix_cache=DEFAULT_PREFIX_CACHE if prefix_cache else None, kv_dtype=kv_dtype,
                      sampling_defaults=base.sampling_defaults, parallel=parallel)
