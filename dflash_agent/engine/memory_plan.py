"""How much GPU memory a model, a drafter and a context length take, itemised, before anything is allocated.

`plan_memory` is a pure function of shapes and byte counts: target weights, drafter weights, the
target's KV cache (full-attention layers grow with the context, one tensor a layer where they keep V alone;
sliding layers keep a ring of window + slack slots), the drafter's context K/V (its full layers grow with the
context, its sliding ones keep rings), and a workspace for the largest step. The caches' figures come from
engine.cache.kv_cache / engine.cache.drafter_cache allocating them on the meta device, so they are the caches'
own whatever their layout. `fit_context` turns a
free-memory figure into a context length, or refuses one that does not fit and names the largest that does.

The workspace terms are estimates from the shapes of one prefill chunk and one verify block (activations,
logits, attention partials) plus a fixed allowance for CUDA libraries and allocator slack; they are not
measured on a GPU here.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..kernels.attention import KeysFromValues
from ..kernels.dispatch import KEYS_PER_CHUNK, RING_KEYS_PER_CHUNK, SPLIT_ROWS, VERIFY_ROWS
from .backends.cuda import MAX_GROUP_GRAPHS
from .cache.drafter_cache import DrafterCache
from .cache.kv_cache import KVCache, keeps_values_only
from .errors import MemoryPlanError, OptionError
from .formats.config import ModelConfig
from .formats.drafter_config import DrafterConfig
from .formats.quant import PackedTensor
from .host_memory import available_ram_bytes
from .limits import BUCKETS, DEFAULT_SLACK, PREFILL_CHUNK
from .model.drafter import DrafterError
from .model.packed import keeps_packed
from .model.quant_linear import GROUP

log = logging.getLogger(__name__)

GiB = 1 << 30
# A coding agent's first prompt (its system prompt and tool definitions) runs 7-21K tokens and its session grows
# from there: a context below this is named as too small for one.
AGENT_CONTEXT = 32768
RUNTIME_ALLOWANCE = 384 << 20  # cuBLAS / Triton workspaces, CUDA graph pools, allocator fragmentation


@dataclass(frozen=True)
class DrafterPlan:
    config: DrafterConfig
    quant: str | None  # None (the compute dtype), "q8" or "q4" (engine.model.quant_linear)


@dataclass(frozen=True)
class MemoryPlan:
    ctx_size: int
    items: dict[str, int]  # what -> bytes
    budget_bytes: int | None = None  # the GPU memory it must fit in, when known
    slots: int = 1  # concurrent requests, each with a ctx_size-token context of its own

    @property
    def total_bytes(self) -> int:
        return sum(self.items.values())

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.total_bytes <= self.budget_bytes

    def to_json(self) -> dict:
        return {
            "ctx_size": self.ctx_size,
            "slots": self.slots,
            "items": dict(self.items),
            "total_bytes": self.total_bytes,
            "total_gib": round(self.total_bytes / GiB, 3),
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
        }

    def describe(self) -> str:
        width = max(len(k) for k in self.items)
        lines = [f"memory plan for a {self.ctx_size}-token context" if self.slots == 1 else
                 f"memory plan for {self.slots} slots x a {self.ctx_size}-token context"]
        lines += [f"  {name:<{width}}  {n / GiB:8.3f} GiB" for name, n in self.items.items()]
        lines.append(f"  {'total':<{width}}  {self.total_bytes / GiB:8.3f} GiB")
        if self.budget_bytes is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {'budget':<{width}}  {self.budget_bytes / GiB:8.3f} GiB ({verdict})")
        return "\n".join(lines)


# --- weights -----------------------------------------------------------------------------------------------------


def weight_bytes(tensors: Iterable[tuple[tuple[int, ...], GGMLQuantizationType | None]], dtype: torch.dtype) -> int:
    """Bytes of (shape, type) tensors once loaded: a GGUF type means kept packed (its block bytes), None
    means converted to the compute dtype."""
    total = 0
    for shape, qtype in tensors:
        n = math.prod(shape)
        if qtype is None:
            total += n * dtype.itemsize
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            total += n // block * type_size
    return total


def checkpoint_weight_bytes(tensors: dict[str, torch.Tensor | PackedTensor], dtype: torch.dtype, packed: bool) -> int:
    """What engine.load.weights.build_model keeps: packed GGUF matrices (when `packed`) keep their blocks,
    everything else is converted to the compute dtype."""
    return weight_bytes(
        ((tuple(t.shape), t.qtype if isinstance(t, PackedTensor) and packed and keeps_packed(t) else None)
         for t in tensors.values()),
        dtype,
    )


def _linear_bytes(out_features: int, in_features: int, quant: str | None, dtype_bytes: int) -> int:
    # exactly what engine.model.quant_linear.QuantLinear stores
    if quant is None:
        return out_features * in_features * dtype_bytes
    if quant == "q8":
        return out_features * in_features + out_features * dtype_bytes
    if quant == "q4":  # Q4_0 blocks: a float16 scale and 16 bytes a group
        return out_features * -(-in_features // GROUP) * (GROUP // 2 + 2)
    raise OptionError(f"unknown drafter quantization {quant!r} (q8, q4)")


def drafter_weight_bytes(drafter: DrafterPlan, target_hidden: int, dtype: torch.dtype) -> int:
    c, quant, dtype_bytes = drafter.config, drafter.quant, dtype.itemsize
    h, d = c.hidden_size, c.head_dim
    linears = [(h, len(c.target_layer_ids) * target_hidden)]  # fc: (out, in)
    per_layer = [(c.num_heads * d, h), (c.num_kv_heads * d, h), (c.num_kv_heads * d, h), (h, c.num_heads * d),
                 (c.intermediate_size, h), (c.intermediate_size, h), (h, c.intermediate_size)]
    linears += per_layer * c.num_layers
    norms = 2 * h + c.num_layers * (2 * h + 2 * d)
    return sum(_linear_bytes(o, i, quant, dtype_bytes) for o, i in linears) + norms * dtype_bytes


# --- caches ------------------------------------------------------------------------------------------------------


def target_kv_bytes(config: ModelConfig, ctx_size: int, kv_dtype: str, dtype: torch.dtype,
                    values_only: bool = True) -> tuple[int, int]:
    """(full-attention layers, sliding rings with their slot map) of engine.cache.kv_cache.KVCache, built on the
    meta device so the figures are the cache's own, whatever its layout. values_only: in the model's dtype, the
    layers that may keep V alone do (GemmaModel.new_cache's)."""
    keys_from = {i: KeysFromValues(torch.empty(spec.head_dim, device="meta"),
                                   torch.empty(spec.head_dim // 2, device="meta"))
                 for i, spec in enumerate(config.layers) if keeps_values_only(spec, kv_dtype)} if values_only else None
    cache = KVCache(config, ctx_size, device="meta", dtype=dtype, kv_dtype=kv_dtype, keys_from=keys_from)
    full = sum(t.nbytes for layer in cache.owned if not layer.sliding for t in layer.storage())
    rings = sum(t.nbytes for layer in cache.owned if layer.sliding for t in layer.storage())
    return full, rings + (cache.ring_pos.nbytes if cache.has_rings else 0)


def drafter_kv_bytes(drafter: DrafterConfig, ctx_size: int, dtype: torch.dtype) -> int:
    cache = DrafterCache(drafter, ctx_size, torch.device("meta"), dtype)
    return sum(t.nbytes for t in (*cache.k, *cache.v, cache.ring_pos))


# --- workspace ---------------------------------------------------------------------------------------------------


def workspace_bytes(config: ModelConfig, ctx_size: int, dtype: torch.dtype,
                    drafter: DrafterConfig | None, slots: int = 1) -> dict[str, int]:
    """The largest transient tensors of a step, itemised (`slots`: concurrent requests, whose decode rows attend in
    one launch)."""
    T, h, V, dtype_bytes = PREFILL_CHUNK, config.hidden_size, config.vocab_size, dtype.itemsize
    heads = config.num_heads
    max_d = max(s.head_dim for s in config.layers)
    qkv = max(heads * s.head_dim + 2 * s.num_kv_heads * s.head_dim for s in config.layers)
    # a prefill chunk: residual stream and norms (~6 copies of [T, hidden]), q/k/v, the MLP's gate, up and product
    activations = T * (6 * h + qkv + 3 * config.intermediate_size) * dtype_bytes
    items = {"workspace: prefill activations": activations}
    sliding = any(s.sliding for s in config.layers)
    ring = min(ctx_size, config.sliding_window + DEFAULT_SLACK) if sliding else 0  # a sliding layer's slots
    if sliding:
        # sliding layers prefill through SDPA with a mask: float32 scores and probabilities over ring + chunk
        items["workspace: sliding prefill scores"] = 2 * heads * T * (ring + T) * 4
    # verify logits in float32 plus softcap / softmax temporaries, for every slot's block and the drafter's; on CUDA
    # the step graphs copy the target's into a buffer of a block a slot (engine.backends.cuda; the CPU's plan, this one
    # against RAM, counts it too, as it does the runtime allowance)
    rows = max(SPLIT_ROWS, slots * VERIFY_ROWS) + (drafter.block_size if drafter is not None else 0)
    items["workspace: logits"] = (3 * rows + slots * VERIFY_ROWS) * V * 4
    # flash-decoding partials of the attention kernel (float32 outputs + log-sum-exp per key chunk), for a verified
    # block's rows or every slot's decode row (model.JointAttention)
    # (a ring's chunks are shorter: kernels.dispatch)
    splits = max(-(-ctx_size // KEYS_PER_CHUNK), -(-ring // RING_KEYS_PER_CHUNK))
    items["workspace: attention partials"] = splits * max(SPLIT_ROWS, slots) * heads * (max_d + 1) * 4
    if drafter is not None:
        # captured target features of a prefill chunk, and the drafter's fc projection of them
        items["workspace: drafter features"] = T * (len(drafter.target_layer_ids) + 1) * h * dtype_bytes
        # every CUDA step graph keeps its rows' captured target layers, which its replays overwrite
        # (engine.backends.cuda): a slot's own graphs one a bucket, and up to MAX_GROUP_GRAPHS of several slots' rows,
        # a block a slot at most
        rows = slots * sum(BUCKETS) + (MAX_GROUP_GRAPHS * slots * VERIFY_ROWS if slots > 1 else 0)
        items["workspace: step graphs' captured features"] = rows * len(drafter.target_layer_ids) * h * dtype_bytes
    items["workspace: runtime allowance"] = RUNTIME_ALLOWANCE
    return items


# --- the plan ----------------------------------------------------------------------------------------------------


def plan_memory(
    config: ModelConfig,
    target_weight_bytes: int,
    ctx_size: int,
    dtype: torch.dtype = torch.bfloat16,
    kv_dtype: str = "model",
    drafter: DrafterPlan | None = None,
    budget_bytes: int | None = None,
    slots: int = 1,
    values_only: bool = True,
) -> MemoryPlan:
    """Itemised GPU memory of the target (+ drafter) with `slots` contexts of `ctx_size` tokens (one per
    concurrent request: engine.scheduler), computing in `dtype`, the KV stored as `kv_dtype` (engine.types'
    STORED_KV_DTYPES); values_only: the layers that may keep V alone do (engine.runner.StepRunner.new_cache)."""
    if ctx_size < 1:
        raise OptionError(f"context size must be positive, got {ctx_size}")
    if slots < 1:
        raise OptionError(f"slots must be >= 1, got {slots}")
    full, rings = (slots * n for n in target_kv_bytes(config, ctx_size, kv_dtype, dtype, values_only))
    items = {"target weights": target_weight_bytes}
    if drafter is not None:
        items["drafter weights"] = drafter_weight_bytes(drafter, config.hidden_size, dtype)
    items["target KV: full-attention layers"] = full
    items["target KV: sliding rings"] = rings
    if drafter is not None:
        items["drafter KV"] = slots * drafter_kv_bytes(drafter.config, ctx_size, dtype)
    items |= workspace_bytes(config, ctx_size, dtype, drafter.config if drafter is not None else None, slots)
    if drafter is not None and drafter.quant == "q8":
        # engine.model.quant_linear expands one q8 matrix at a time to the compute dtype (q4 ones only off CUDA, where
        # this plan's budget is the RAM); fc is the largest
        c = drafter.config
        items["workspace: drafter matrix expansion"] = (
            c.hidden_size * len(c.target_layer_ids) * config.hidden_size * dtype.itemsize)
    return MemoryPlan(ctx_size, items, budget_bytes, slots)


def largest_context(budget_bytes: int, config: ModelConfig, target_weight_bytes: int, **plan_args) -> int:
    """The longest context (<= the model's maximum) whose plan fits `budget_bytes`; 0 if none does."""
    def fits(n: int) -> bool:
        return plan_memory(config, target_weight_bytes, n, budget_bytes=budget_bytes, **plan_args).fits

    lo, hi = 0, config.max_position_embeddings
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo) or lo == 0; not fits(hi); every term grows with the context
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def fit_context(
    free_bytes: int,
    config: ModelConfig,
    target_weight_bytes: int,
    requested: int | None = None,
    memory: str = "GPU memory is free",
    **plan_args,
) -> MemoryPlan:
    """The plan for `requested` tokens if it fits in `free_bytes`, else a MemoryPlanError naming the largest
    context that does; without a request, the plan for the largest context that fits. memory: what free_bytes is,
    as the errors say it."""
    largest = largest_context(free_bytes, config, target_weight_bytes, **plan_args)
    if requested is None:
        if largest == 0:
            plan = plan_memory(config, target_weight_bytes, 1, budget_bytes=free_bytes, **plan_args)
            raise MemoryPlanError(
                f"the model does not fit: it needs {plan.total_bytes / GiB:.2f} GiB with a 1-token context "
                f"and {free_bytes / GiB:.2f} GiB of {memory}"
            )
        return plan_memory(config, target_weight_bytes, largest, budget_bytes=free_bytes, **plan_args)
    plan = plan_memory(config, target_weight_bytes, requested, budget_bytes=free_bytes, **plan_args)
    if not plan.fits:
        per_slot, slots_note = ((" per slot (or fewer slots: --parallel)", f" x {plan.slots} slots")
                                if plan.slots > 1 else ("", ""))
        hint = (f"the largest context that fits is {largest} tokens{per_slot} (--ctx-size {largest})" if largest
                else "no context fits: use a smaller model, quantization or drafter")
        raise MemoryPlanError(
            f"--ctx-size {requested}{slots_note} needs {plan.total_bytes / GiB:.2f} GiB but "
            f"{free_bytes / GiB:.2f} GiB of {memory}; {hint}"
        )
    return plan


# --- the engine on a GPU -----------------------------------------------------------------------------------------


def drafter_plan(path: Path, quant: str | None, context_window: int | None = None) -> DrafterPlan:
    """The drafter a checkpoint directory describes (its config.json only; the weights load later), reading at most
    the last `context_window` tokens of the context where one is given (Drafter.with_context_window)."""
    config_path = Path(path) / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DrafterError(f"{config_path}: cannot read the drafter config ({exc})") from None
    config = DrafterConfig.from_dict(raw, str(config_path))
    return DrafterPlan(config if context_window is None else config.with_context_window(context_window), quant)


def choose_kv_dtype(
    free_bytes: int,
    config: ModelConfig,
    target_weight_bytes: int,
    requested: int | None,
    kv_dtype: str,
    memory: str = "GPU memory is free",
    **plan_args,
) -> tuple[str, MemoryPlan]:
    """The stored KV dtype (engine.types.STORED_KV_DTYPES) and the plan `fit_context` makes with it. kv_dtype "auto":
    the model's dtype where the context asked for (without one, the model's whole) fits, else 8-bit where that fits
    the asked context or, without one, holds more than the model's dtype does (said in the log); a request that fits
    neither is refused with the largest 8-bit context."""
    if kv_dtype != "auto":
        return kv_dtype, fit_context(free_bytes, config, target_weight_bytes, requested, memory, kv_dtype=kv_dtype,
                                     **plan_args)
    wanted = requested or config.max_position_embeddings
    model = plan_memory(config, target_weight_bytes, wanted, budget_bytes=free_bytes, **plan_args)
    if model.fits:
        return "model", model
    if requested is not None:  # fits in 8 bits, or is refused naming the largest 8-bit context
        plan = fit_context(free_bytes, config, target_weight_bytes, requested, memory, kv_dtype="q8", **plan_args)
        log.info("8-bit KV cache: a %d-token context in the model's dtype needs %.2f GiB, %.2f GiB of %s "
                 "(--kv-cache model keeps it, with a shorter context)", requested, model.total_bytes / GiB,
                 free_bytes / GiB, memory)
        return "q8", plan
    in_model = largest_context(free_bytes, config, target_weight_bytes, **plan_args)
    in_q8 = largest_context(free_bytes, config, target_weight_bytes, kv_dtype="q8", **plan_args)
    if in_q8 <= in_model:
        return "model", fit_context(free_bytes, config, target_weight_bytes, None, memory, **plan_args)
    log.info("8-bit KV cache: %d tokens of context where the model's dtype holds %d (--kv-cache model keeps it)",
             in_q8, in_model)
    return "q8", fit_context(free_bytes, config, target_weight_bytes, None, memory, kv_dtype="q8", **plan_args)


def gpu_context_size(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor | PackedTensor],
    device: torch.device,
    dtype: torch.dtype,
    requested: int | None,
    kv_dtype: str = "auto",
    drafter: DrafterPlan | None = None,
    slots: int = 1,
) -> tuple[int, str]:
    """The context the engine allocates (per slot) on a CUDA device and the KV dtype it stores, from its free memory
    before the weights load: `requested` if it fits (a MemoryPlanError naming the largest that does if not), else
    the largest; kv_dtype "auto" as choose_kv_dtype picks it."""
    free, _ = torch.cuda.mem_get_info(device)
    if requested is not None:
        requested = min(requested, config.max_position_embeddings)
    stored, plan = choose_kv_dtype(free, config, checkpoint_weight_bytes(tensors, dtype, packed=True), requested,
                                   kv_dtype, dtype=dtype, drafter=drafter, slots=slots)
    log.info("%s", plan.describe())
    if requested is None and plan.ctx_size < min(AGENT_CONTEXT, config.max_position_embeddings):
        log.warning("context %d tokens, what %.1f GiB free on %s holds: coding agents need about %d (free memory "
                    "on the card%s, or a smaller model)", plan.ctx_size, free / GiB, device, AGENT_CONTEXT,
                    "" if stored == "q8" else ", --kv-cache q8")
    return plan.ctx_size, stored


# --- the engine on the CPU ---------------------------------------------------------------------------------------

# Of the RAM left beside the weights, what an unasked-for context takes: the rest is left to the prefix cache's stored
# conversations and the OS.
CPU_SHARE = 0.5
CPU_RESERVE = 1 << 30  # RAM no plan takes: the interpreter, torch's own buffers, the OS's working set


def cpu_weights(tensors: dict[str, torch.Tensor | PackedTensor], dtype: torch.dtype, c_kernels: bool,
                available_bytes: int | None = None) -> str:
    """What weights="auto" loads on the CPU, said in the log: "packed" (the GGUF's blocks) where a vector build of
    the C kernels runs (kernels.cpu.cpu_dot); without one, "exact" (dequantized to `dtype`: its GEMMs prefill faster
    than torch's int4 / int8 kernels, and the scalar C is slower than both) where that fits in the RAM share,
    else "packed" through torch's kernels, which a 31B model needs (~124 GB dequantized)."""
    if c_kernels:
        return "packed"
    packed = checkpoint_weight_bytes(tensors, dtype, packed=True)
    exact = checkpoint_weight_bytes(tensors, dtype, packed=False)
    if packed == exact:  # nothing packed (safetensors)
        return "exact"
    free = available_ram_bytes() if available_bytes is None else available_bytes
    if free is None or exact <= free * CPU_SHARE:
        log.info("weights dequantized to %s (%.2f GiB): no vector build of the CPU kernels here, and torch's "
                 "kernels prefill slower", str(dtype).removeprefix("torch."), exact / GiB)
        return "exact"
    log.info("weights kept packed for torch's int4 / int8 kernels (%.2f GiB): dequantized they would take %.2f GiB, "
             "more than half the %.2f GiB of RAM available, and this CPU has no vector build of the C kernels",
             packed / GiB, exact / GiB, free / GiB)
    return "packed"


def cpu_context_size(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor | PackedTensor],
    dtype: torch.dtype,
    requested: int | None,
    kv_dtype: str = "model",
    drafter: DrafterPlan | None = None,
    available_bytes: int | None = None,
    slots: int = 1,
    packed: bool = False,
) -> int:
    """The context the engine allocates (per slot) on the CPU, planned against the available RAM (less CPU_RESERVE)
    before any weight loads (weights, packed or dequantized as they will load, drafter, KV, workspace): `requested`
    (capped by the model) where it fits, else a MemoryPlanError naming the largest that does; without a request, the
    model's own context where the weights and CPU_SHARE of the RAM left beside them hold `slots` of it, else the
    largest that does (at least 4096 tokens where those fit), said in a warning. A model that fits with no context
    at all is refused with what it needs."""
    free = available_ram_bytes() if available_bytes is None else available_bytes
    if free is None:  # nothing to plan against
        return min(requested or config.max_position_embeddings, config.max_position_embeddings)
    usable = max(0, free - CPU_RESERVE)
    weights = checkpoint_weight_bytes(tensors, dtype, packed=packed)
    # the C layers' float32 caches keep K beside V (StepRunner.new_cache): planned so, whether or not they run
    plan_args = dict(dtype=dtype, kv_dtype=kv_dtype, drafter=drafter, slots=slots, values_only=False,
                     memory="RAM available "
                     f"(of {free / GiB:.2f} GiB, {CPU_RESERVE / GiB:.1f} GiB kept for the system)")
    if requested is not None:
        return fit_context(usable, config, weights, min(requested, config.max_position_embeddings),
                           **plan_args).ctx_size
    whole = fit_context(usable, config, weights, **plan_args).ctx_size  # refuses a model that does not fit at all
    shared = weights + int(max(0, usable - weights) * CPU_SHARE)
    largest = largest_context(shared, config, weights, **{k: v for k, v in plan_args.items() if k != "memory"})
    n_ctx = min(config.max_position_embeddings, max(largest, min(4096, whole)))
    if n_ctx < config.max_position_embeddings:
        log.warning("context %d tokens, not the model's %d: %.1f GiB of RAM available (--ctx-size sets it, up to %d "
                    "here)%s", n_ctx, config.max_position_embeddings, free / GiB, whole,
                    f"; coding agents need about {AGENT_CONTEXT}: free memory, or a smaller model"
                    if n_ctx < AGENT_CONTEXT else "")
    else:
        log.info("context %d tokens (the model's; %.1f GiB of RAM available)", n_ctx, free / GiB)
    return n_ctx
