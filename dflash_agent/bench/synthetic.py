"""`bench --synthetic gemma4-31b`: the GPU path at the real 31B shapes, with random weights (nothing to download).

Builds Gemma 4 31B (60 layers, hidden 5376, head_dim 256 / 512) with random GGUF blocks in the layout of a
named quantization (Google's QAT Q4_0, or llama.cpp's Q4_K_M mix) kept packed on the GPU, a random
z-lab-shaped DFlash drafter quantized to 4 bits (engine.model.quant_linear "q4"), and measures in one run:
- the device's copy bandwidth (the roofline's denominator);
- autoregressive decode tok/s at 1K / 8K / 32K context, and bytes read per token, so the fraction of the
  bandwidth roofline (tok/s x bytes per token / copy bandwidth);
- a verify-16 step against a decode step at 8K (the price of checking a DFlash block);
- one drafter step (draft + LM head + argmax) and appending a block's features to the drafter's context;
- 1, 4 and 8 streams decoding in one step (the server's slots), and verifying a 16-token block each, with the
  default and the 8-bit KV cache;
- peak memory, against the memory plan;
- projected DFlash tok/s at acceptance lengths 4, 6, 8: tau / (draft + verify-16 + append) at 8K.
Steps run through CUDA graphs as the engine runs them; the eager (uncaptured) times are reported beside them.

`plan_only` prints the memory plan for the same shapes from a GPU-memory figure, without a GPU.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..engine.formats.config import ModelConfig
from ..engine.formats.drafter_config import DrafterConfig
from ..engine.memory_plan import (
    DrafterPlan,
    GiB,
    MemoryPlan,
    fit_context,
    largest_context,
    plan_memory,
    weight_bytes,
)
from ..engine.model.drafter import Drafter
from ..engine.model.gemma import GemmaModel
from ..engine.types import STORED_KV_DTYPES
from ..errors import UserError

log = logging.getLogger(__name__)

T = GGMLQuantizationType
QUANTS = ("Q4_0", "Q4_K_M")
CONTEXTS = (1024, 8192, 32768)
DEFAULT_CTX = 32768
REFERENCE_CTX = 8192  # verify / draft / projection figures are taken at this context
DRAFT_QUANT = "q4"
ACCEPTANCE_LENGTHS = (4, 6, 8)
STREAMS = (1, 4, 8)  # concurrent requests decoding in one batched step (the server's slots)
STREAMS_GOAL = 3.5  # 4 streams' aggregate tok/s over one stream's, with the default KV cache
# The streams' KV caches: the model's dtype (the default), and 8-bit, which a 24 GB card's slots need for their
# contexts; each stream's KV is read apart from the others', so halving it raises what several streams can reach
STREAMS_KV = STORED_KV_DTYPES
PLAN_BUDGET = 23 * GiB  # the goal: the 32K plan within 23 GiB of a 24 GB card


def _gemma4_large(**shape) -> ModelConfig:
    """The text config.json keys Gemma 4's two large members share, plus `shape`."""
    return ModelConfig.from_hf_dict(dict(
        model_type="gemma4_text", vocab_size=262144, head_dim=256, global_head_dim=512, attention_k_eq_v=True,
        sliding_window=1024, rms_norm_eps=1e-6, final_logit_softcapping=30.0, tie_word_embeddings=True,
        hidden_size_per_layer_input=0, max_position_embeddings=262144,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * (shape["num_hidden_layers"] // 6),
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1_000_000.0},
        },
        **shape,
    ))


def _dflash_drafter(**shape) -> DrafterConfig:
    """The config.json keys z-lab's Gemma 4 DFlash drafters share, plus `shape`."""
    return DrafterConfig.from_dict(dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=5, num_key_value_heads=8,
        head_dim=128, vocab_size=262144, rms_norm_eps=1e-6, rope_theta=1_000_000.0, attention_bias=False,
        layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048,
        final_logit_softcapping=30.0, block_size=16, **shape,
    ))


def gemma4_31b_config() -> ModelConfig:
    """google/gemma-4-31B-it's text config.json keys (shared/reference/gemma4.md section 1)."""
    return _gemma4_large(hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
                         num_key_value_heads=16, num_global_key_value_heads=4)


def gemma4_31b_drafter_config() -> DrafterConfig:
    """z-lab/gemma-4-31B-it-DFlash's config.json (shared/reference/dflash.md section 1.2)."""
    return _dflash_drafter(hidden_size=5376, num_attention_heads=64, intermediate_size=10752, num_target_layers=60,
                           dflash_config={"mask_token_id": 4, "target_layer_ids": [1, 12, 23, 35, 46, 57]})


def gemma4_26b_a4b_config() -> ModelConfig:
    """google/gemma-4-26B-A4B-it's text config.json keys, as several independent copies of it give them (MLX, Rust
    and Swift loaders' fixtures): 30 layers 2816 wide, a 2112-wide dense MLP beside 128 experts 704 wide, 8 a
    token."""
    return _gemma4_large(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
                         num_key_value_heads=8, num_global_key_value_heads=2, enable_moe_block=True,
                         num_experts=128, top_k_experts=8, moe_intermediate_size=704)


def gemma4_26b_a4b_drafter_config() -> DrafterConfig:
    """z-lab/gemma-4-26B-A4B-it-DFlash. Its config.json is not in shared/reference: this is the 31B drafter's
    layout at the 26B's width (5 layers, MLP twice the width; about 0.43B weights, as the published "0.4B"), reading
    the target layers third parties report (1, 6, 11, 17, 22, 27). A plan, not a loader: the real file decides."""
    return _dflash_drafter(hidden_size=2816, num_attention_heads=32, intermediate_size=5632, num_target_layers=30,
                           dflash_config={"mask_token_id": 4, "target_layer_ids": [1, 6, 11, 17, 22, 27]})


# name -> (target config, its DFlash drafter's config)
SYNTHETIC_CONFIGS = {
    "gemma4-31b": (gemma4_31b_config, gemma4_31b_drafter_config),
    "gemma4-26b-a4b": (gemma4_26b_a4b_config, gemma4_26b_a4b_drafter_config),
}
MODELS = tuple(SYNTHETIC_CONFIGS)


def _use_more_bits(i: int, n: int) -> bool:
    # llama.cpp (llama-quant.cpp): which layers' attn_v / ffn_down get Q6_K in the _M mixes
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quant_types(config: ModelConfig, quant: str) -> dict[str, GGMLQuantizationType | None]:
    """The GGUF type of every parameter in a checkpoint quantized as `quant` (None: a float vector).

    Q4_0 (Google's QAT GGUF): every block matrix Q4_0; the tied embedding (and E2B / E4B's per-layer one) Q6_K,
    which is what its published size (16.44 GiB) implies. Q4_K_M (llama.cpp): Q4_K, with Q6_K for attn_v and
    ffn_down (the experts' too) of the layers llama.cpp's use_more_bits picks, and for the embedding; rows of
    widths that are not a multiple of 256 (26B-A4B's 2112 and 704) take llama.cpp's fallbacks, Q5_0 for Q4_K and
    Q8_0 for Q6_K. A MoE router stays float.
    """
    if quant not in QUANTS:
        raise UserError(f"unknown quantization {quant!r} ({', '.join(QUANTS)})")
    shapes = {name: tuple(t.shape) for name, t in GemmaModel(config).state_dict().items()}
    n_layers = config.num_layers
    v_layers = [i for i, spec in enumerate(config.layers) if not spec.k_eq_v]
    types: dict[str, GGMLQuantizationType | None] = {}
    for name, shape in shapes.items():
        if len(shape) < 2 or name.endswith("router.proj.weight"):  # llama.cpp keeps the router in float
            types[name] = None
        elif name in ("embed_tokens.weight", "embed_tokens_per_layer.weight") or quant == "Q4_K_M" and \
                name == "lm_head.weight":  # llama-quantize takes the per-layer table for a token embedding
            types[name] = T.Q6_K
        elif quant == "Q4_0":
            types[name] = T.Q4_0
        elif not name.startswith("layers."):  # E2B / E4B's per-layer model projection
            types[name] = T.Q4_K if shape[-1] % 256 == 0 else T.Q5_0
        else:
            layer = int(name.split(".")[1])
            if name.endswith(("mlp.down_proj.weight", "experts.down_proj")) and _use_more_bits(layer, n_layers):
                types[name] = T.Q6_K
            elif name.endswith("self_attn.v_proj.weight") and _use_more_bits(v_layers.index(layer), len(v_layers)):
                types[name] = T.Q6_K
            else:
                types[name] = T.Q4_K
            if shape[-1] % 256:  # llama.cpp's fallback where rows do not hold whole K-quant super-blocks
                types[name] = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}[types[name]]
    return types


def synthetic_weight_bytes(config: ModelConfig, quant: str, dtype: torch.dtype = torch.bfloat16) -> int:
    shapes = {name: tuple(t.shape) for name, t in GemmaModel(config).state_dict().items()}
    types = quant_types(config, quant)
    return weight_bytes(((shapes[name], types[name]) for name in shapes), dtype)


def synthetic_plan(quant: str, ctx_size: int, gpu_memory: int | None, draft_quant: str | None = DRAFT_QUANT,
                   kv_dtype: str = "model", model: str = "gemma4-31b") -> MemoryPlan:
    """The memory plan of a synthetic target (bf16 compute) + its drafter at `ctx_size` tokens."""
    target, draft = SYNTHETIC_CONFIGS[model]
    config = target()
    drafter = DrafterPlan(draft(), draft_quant)
    return plan_memory(config, synthetic_weight_bytes(config, quant), ctx_size, kv_dtype=kv_dtype,
                       drafter=drafter, budget_bytes=gpu_memory)


def parse_size(text: str) -> int:
    """'24GiB', '24 GB', '23.5G', '24000MiB' or a plain byte count -> bytes (G/GiB binary, GB decimal)."""
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
             "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not math.isfinite(value) or value <= 0:
        raise UserError(f"cannot read {text!r} as a memory size (e.g. 24GiB, 24GB, 24000MiB)")
    return int(value * units[unit])


# --- the GPU benchmark -----------------------------------------------------------------------------------------


@dataclass
class DecodeSpeed:
    context: int
    tok_s: float  # through CUDA graphs, as the engine decodes
    tok_s_eager: float
    bytes_per_token: int  # the weights a token reads (a MoE's top k experts, not all) + the KV the step reads
    roofline_tok_s: float  # copy bandwidth / bytes per token
    roofline_fraction: float


@dataclass
class StreamsSpeed:
    """Decode steps of several requests at once (StepRunner.forward_groups), through CUDA graphs as the engine runs
    them (one per combination of slots; one stream through its own cache's); and a step verifying a 16-token block of
    each, as speculating slots run it, through graphs and eagerly."""

    streams: int
    context: int
    kv_cache: str  # the caches' KV dtype (engine.types.STORED_KV_DTYPES)
    tok_s: float  # aggregate: a token per stream per step
    per_stream_tok_s: float
    over_one_stream: float
    roofline_tok_s: float  # copy bandwidth / (the weights once + each stream's KV)
    verify16_ms: float = 0.0  # every stream's block in one step
    verify16_ms_eager: float = 0.0


@dataclass
class SyntheticResult:
    model: str
    quant: str
    draft_quant: str
    device: str
    ctx_size: int
    copy_bandwidth_gb_s: float
    weight_bytes: int
    decode: list[DecodeSpeed]
    reference_context: int
    decode_ms: float
    verify16_ms: float
    verify16_over_decode: float
    drafter_step_ms: float
    drafter_step_ms_eager: float
    append_context_ms: float
    dflash_projected_tok_s: dict[str, float]
    peak_memory_bytes: int
    plan: dict
    streams: list[StreamsSpeed] = field(default_factory=list)
    goals: dict[str, bool] = field(default_factory=dict)
    command: str = ""


_SCALE_FIELDS = {T.Q4_0: (0,), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _random_blocks(shape: tuple[int, ...], qtype: GGMLQuantizationType, device, generator) -> torch.Tensor:
    """Random packed bytes of `qtype` with every fp16 scale 2^-8 (finite, and activations stay O(1))."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = math.prod(shape) // block
    raw = torch.randint(0, 256, (n_blocks, type_size), dtype=torch.uint8, device=device, generator=generator)
    scale = torch.full((n_blocks, 1), 2.0**-8, dtype=torch.float16, device=device).view(torch.uint8)
    for off in _SCALE_FIELDS[qtype]:
        raw[:, off : off + 2] = scale
    return raw.reshape(-1)


def build_synthetic_target(config: ModelConfig, quant: str, device: torch.device, dtype: torch.dtype,
                           seed: int = 0) -> GemmaModel:
    """The target with random packed weights, built on `device` one tensor at a time."""
    from ..engine.formats.quant import PackedTensor
    from ..engine.model.packed import PackedWeight

    generator = torch.Generator(device=device).manual_seed(seed)
    model = GemmaModel(config, device=device)
    types = quant_types(config, quant)
    state = {}
    for name, meta in model.state_dict().items():
        qtype = types[name]
        if qtype is None:
            state[name] = torch.ones(meta.shape, dtype=dtype, device=device)
        else:
            raw = _random_blocks(tuple(meta.shape), qtype, device, generator)
            state[name] = PackedWeight(PackedTensor(raw, qtype, tuple(meta.shape)), dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def build_synthetic_drafter(config: DrafterConfig, target_hidden: int, quant: str | None, device: torch.device,
                            dtype: torch.dtype, seed: int = 0) -> Drafter:
    """A drafter with random weights, quantized one matrix at a time (so the bf16 drafter never exists whole)."""
    from torch import nn

    from ..engine.model.quant_linear import QuantLinear

    generator = torch.Generator(device=device).manual_seed(seed)
    drafter = Drafter(config, target_hidden)  # weights on the meta device
    for module in list(drafter.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                w = torch.randn(child.weight.shape, generator=generator, device=device, dtype=dtype) * 0.02
                if quant is None:
                    child.weight = nn.Parameter(w, requires_grad=False)
                else:
                    setattr(module, name, QuantLinear(w, quant))
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:  # norm weights
                module.register_buffer(name, torch.ones(buf.shape, dtype=dtype, device=device))
    drafter.inv_freq = drafter.inv_freq.to(device)
    return drafter.eval()


def _time_ms(step, iters: int, device: torch.device, warmup: int = 3) -> float:
    """Mean milliseconds per call of `step`: CUDA events on a GPU (the smoke test runs on the CPU)."""
    for _ in range(warmup):
        step()
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(iters):
            step()
        return (time.perf_counter() - started) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read + write): what a bandwidth-bound kernel can reach."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), 20, device)
    return 2 * nbytes / (ms / 1e3)


def _fill_context(cache, length: int) -> None:
    """Pretend `length` tokens are cached: the length, and the rings' slot map of their last positions."""
    cache.length = length
    slots = cache.ring_slots
    positions = torch.arange(max(0, length - slots), length, device=cache.ring_pos.device)
    cache.ring_pos.fill_(-1)
    cache.ring_pos[positions % slots] = positions


def _kv_bytes_read(cache, context: int) -> int:
    """KV bytes a decode step reads: full layers up to the context, rings whole."""
    total = 0
    for layer in cache.owned:
        per_slot = sum(t[0].numel() * t.element_size() for t in layer.storage())
        total += per_slot * (layer.k.shape[0] if layer.sliding else context)
    return total


def run_synthetic_bench(model: str, quant: str, ctx_size: int | None, draft_quant: str | None = DRAFT_QUANT,
                        iters: int = 20) -> SyntheticResult:
    if model not in MODELS:
        raise UserError(f"unknown synthetic model {model!r} ({', '.join(MODELS)})")
    if quant not in QUANTS:
        raise UserError(f"unknown quantization {quant!r} ({', '.join(QUANTS)})")
    if not torch.cuda.is_available():
        raise UserError("bench --synthetic needs a CUDA GPU (--plan-only --gpu-memory SIZE prints the memory plan "
                        "without one)")
    target, drafter = SYNTHETIC_CONFIGS[model]
    return measure(model, target(), drafter(), quant, ctx_size or DEFAULT_CTX, draft_quant, torch.device("cuda"),
                   iters)


@torch.inference_mode()
def measure(model: str, config: ModelConfig, dconfig: DrafterConfig, quant: str, ctx_size: int,
            draft_quant: str | None, device: torch.device, iters: int,
            contexts: tuple[int, ...] = CONTEXTS, reference: int = REFERENCE_CTX,
            copy_bytes: int = 1 << 30) -> SyntheticResult:
    """The measurements of the module doc for any config (the 31B on a GPU; the tests' tiny one on the CPU)."""
    from ..engine.backends.cuda import DraftStepGraph, cuda_step_graphs
    from ..engine.model.gemma import RowGroup
    from ..engine.model.packed import PackedWeight, choose_cuda_tiles
    from ..engine.runner import StepRunner

    cuda, dtype = device.type == "cuda", torch.bfloat16
    block_size = 16
    measured = [c for c in contexts if block_size <= c <= ctx_size] or [ctx_size]
    target_bytes = synthetic_weight_bytes(config, quant, dtype)
    drafter_plan = DrafterPlan(dconfig, draft_quant)
    # before anything is built: its two 1 GiB buffers once made the peak memory 0.9 GiB over the plan
    bandwidth = copy_bandwidth(device, copy_bytes)
    log.info("copy bandwidth %.0f GB/s", bandwidth / 1e9)
    if cuda:
        torch.cuda.empty_cache()
        plan = fit_context(torch.cuda.mem_get_info(device)[0], config, target_bytes, requested=ctx_size,
                           dtype=dtype, drafter=drafter_plan)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        plan = plan_memory(config, target_bytes, ctx_size, dtype=dtype, drafter=drafter_plan)
    log.info("%s", plan.describe())

    started = time.perf_counter()
    target = build_synthetic_target(config, quant, device, dtype)
    if cuda:
        choose_cuda_tiles(target.matmul_weights())  # as Engine.load does
    drafter = build_synthetic_drafter(dconfig, config.hidden_size, draft_quant, device, dtype)
    log.info("built the synthetic %s %s target and %s drafter in %.0f s", model, quant, draft_quant,
             time.perf_counter() - started)
    cache = target.new_cache(ctx_size)
    dcache = drafter.new_cache(ctx_size)
    loaded = sum(b.packed.nbytes if isinstance(b, PackedWeight) else b.nbytes for b in target.buffers())
    read = loaded  # what a decode step reads of the weights: a MoE token only its top k of each layer's experts
    if config.moe is not None:
        stacks = sum(b.packed.nbytes for b in target.buffers() if isinstance(b, PackedWeight) and b.dim() == 3)
        read = loaded - stacks + stacks * config.moe.top_k // config.moe.num_experts

    one = torch.zeros(1, dtype=torch.long, device=device)
    block = torch.zeros(block_size, dtype=torch.long, device=device)
    rows = torch.arange(block_size, device=device)

    def step_ms(runner: StepRunner, ids: torch.Tensor, context: int, logits_at: torch.Tensor | None) -> float:
        # the step's last token sits at position context - 1; every call rolls back and repeats it
        cached = context - ids.shape[0]
        _fill_context(cache, cached)

        def step() -> None:
            cache.rollback(cached)
            runner.forward(ids, cache, logits_at=logits_at)

        return _time_ms(step, iters, device)

    eager_runner = StepRunner(target)
    eager = {c: step_ms(eager_runner, one, c, None) for c in measured}
    # as the engine runs decode on CUDA (no graphs elsewhere); one slot's logits buffer, as the plan the peak is read
    # against counts (the streams below grow it)
    runner = StepRunner(target, graphs=cuda_step_graphs(target))
    decode: list[DecodeSpeed] = []
    graphed: dict[int, float] = {}
    for c in measured:
        graphed[c] = step_ms(runner, one, c, None)
        per_token = read + _kv_bytes_read(cache, c)
        roofline = bandwidth / per_token
        tok_s = 1e3 / graphed[c]
        decode.append(DecodeSpeed(c, tok_s, 1e3 / eager[c], per_token, roofline, tok_s / roofline))
        log.info("decode at %d: %.1f tok/s (eager %.1f), %.0f%% of the roofline", c, tok_s, 1e3 / eager[c],
                 100 * tok_s / roofline)

    ref = reference if reference in graphed else measured[-1]
    verify = step_ms(runner, block, ref, rows)

    # the drafter at the reference context: a block of 16 drafted after ref - 16 context tokens, then
    # the features of 8 committed tokens appended
    dcache.length = ref - block_size
    head = target.output_weight
    embeds = target.embed_tokens.weight[block]

    def draft_eager_step() -> None:
        drafter.logits(drafter.draft(embeds, dcache)[1:], head).argmax(-1)

    draft_eager = _time_ms(draft_eager_step, iters, device)
    if cuda:
        draft_graph = DraftStepGraph(drafter, head, dcache, block=block_size)
        draft = _time_ms(lambda: draft_graph.draft(embeds), iters, device)
    else:
        draft = draft_eager
    features = torch.randn(8, len(dconfig.target_layer_ids) * config.hidden_size, device=device, dtype=dtype)

    def append() -> None:
        dcache.rollback(ref - block_size)
        drafter.append_context(features, dcache)

    append_ms = _time_ms(append, iters, device)
    projected = {str(tau): tau / ((draft + verify + append_ms) / 1e3) for tau in ACCEPTANCE_LENGTHS}
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0  # the plan's, before the streams' own caches

    # several requests decoding at once, each at the shortest context (short caches: the weights are what is shared)
    streams: list[StreamsSpeed] = []
    context = measured[0]
    for kv_cache, n in ((kv_cache, n) for kv_cache in STREAMS_KV for n in STREAMS):
        # a fresh set of graphs: the last count's go, and the caches they kept with them
        runner = StepRunner(target, graphs=cuda_step_graphs(target))
        caches = [target.new_cache(context, kv_cache) for _ in range(n)]

        def batched_step(on: StepRunner, groups: list[RowGroup]) -> None:
            for group in groups:
                _fill_context(group.cache, context - group.ids.shape[0])
            on.forward_groups(groups)

        decode_rows = [RowGroup(one, cache) for cache in caches]
        tok_s = n * 1e3 / _time_ms(partial(batched_step, runner, decode_rows), iters, device)
        one_tok_s = next((st.tok_s for st in streams if st.kv_cache == kv_cache), tok_s)
        roofline = n * bandwidth / (read + n * _kv_bytes_read(caches[0], context))
        blocks = [RowGroup(block, cache, rows) for cache in caches]
        verify_n = _time_ms(partial(batched_step, runner, blocks), iters, device)
        verify_n_eager = _time_ms(partial(batched_step, eager_runner, blocks), iters, device)
        streams.append(StreamsSpeed(n, context, kv_cache, tok_s, tok_s / n, tok_s / one_tok_s, roofline, verify_n,
                                    verify_n_eager))
        log.info("%d streams at %d, %s KV: %.1f tok/s together, %.2fx one stream; verify-16 of each %.2f ms "
                 "(eager %.2f)", n, context, kv_cache, tok_s, tok_s / one_tok_s, verify_n, verify_n_eager)
    result = SyntheticResult(
        model=model, quant=quant, draft_quant=str(draft_quant),
        device=torch.cuda.get_device_name(device) if cuda else str(device),
        ctx_size=ctx_size, copy_bandwidth_gb_s=bandwidth / 1e9, weight_bytes=loaded, decode=decode,
        reference_context=ref, decode_ms=graphed[ref], verify16_ms=verify, verify16_over_decode=verify / graphed[ref],
        drafter_step_ms=draft, drafter_step_ms_eager=draft_eager, append_context_ms=append_ms,
        dflash_projected_tok_s=projected, peak_memory_bytes=peak, plan=plan.to_json(), streams=streams,
    )
    four = next((s for s in streams if s.streams == 4 and s.kv_cache == STREAMS_KV[0]), None)
    result.goals = {
        "decode >= 85% of roofline": all(d.roofline_fraction >= 0.85 for d in decode),
        "verify-16 <= 1.25x decode at 8K": ref == REFERENCE_CTX and result.verify16_over_decode <= 1.25,
        "peak <= 23 GiB": cuda and peak <= PLAN_BUDGET,
        f"4 streams >= {STREAMS_GOAL}x one": four is not None and four.over_one_stream >= STREAMS_GOAL,
    }
    return result


def plot(result: SyntheticResult, path: Path) -> None:
    """Decode tok/s against the roofline by context, and projected DFlash tok/s by acceptance length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{d.context // 1024}K" for d in result.decode]
    xs = range(len(result.decode))
    left.bar([x - 0.2 for x in xs], [d.tok_s for d in result.decode], width=0.4, label="decode (CUDA graphs)")
    left.bar([x + 0.2 for x in xs], [d.roofline_tok_s for d in result.decode], width=0.4, label="bandwidth roofline")
    left.set_xticks(list(xs), labels)
    left.set_xlabel("context")
    left.set_ylabel("tokens / s")
    left.set_title(f"{result.model} {result.quant}: autoregressive decode")
    left.legend()
    taus = list(result.dflash_projected_tok_s)
    right.bar(["AR"] + [f"tau={t}" for t in taus],
              [1e3 / result.decode_ms] + [result.dflash_projected_tok_s[t] for t in taus])
    right.set_ylabel("tokens / s")
    right.set_title(f"DFlash projection at {result.reference_context // 1024}K context")
    fig.suptitle(result.device)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(result: SyntheticResult, out: Path, as_json: bool) -> str:
    """Write the JSON and the PNG next to it; return what to print."""
    out.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(result)
    out.write_text(json.dumps(data, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    if as_json:
        return json.dumps(data)
    lines = [f"{result.model} {result.quant} + {result.draft_quant} drafter on {result.device}",
             f"copy bandwidth {result.copy_bandwidth_gb_s:.0f} GB/s; weights {result.weight_bytes / GiB:.2f} GiB"]
    for d in result.decode:
        lines.append(f"  decode at {d.context:>6}: {d.tok_s:7.1f} tok/s (eager {d.tok_s_eager:.1f}), "
                     f"{100 * d.roofline_fraction:.0f}% of the {d.roofline_tok_s:.1f} tok/s roofline")
    lines.append(f"  verify-16 / decode at {result.reference_context}: {result.verify16_over_decode:.2f} "
                 f"({result.verify16_ms:.2f} / {result.decode_ms:.2f} ms)")
    lines.append(f"  drafter step {result.drafter_step_ms:.2f} ms (eager {result.drafter_step_ms_eager:.2f}), "
                 f"append 8 tokens {result.append_context_ms:.2f} ms")
    lines.append("  projected DFlash tok/s: " + ", ".join(f"tau {t}: {v:.1f}"
                                                         for t, v in result.dflash_projected_tok_s.items()))
    one_stream = {st.kv_cache: st for st in result.streams if st.streams == 1}
    for st in result.streams:
        # each stream's KV is read apart, so the roofline's own ratio to one stream bounds over_one_stream (3.48x at
        # 4 streams of the Q4_0 31B at 1K with bf16 KV, 3.70x with q8)
        lines.append(f"  {st.streams} streams at {st.context}, {st.kv_cache} KV: {st.tok_s:7.1f} tok/s together, "
                     f"{st.per_stream_tok_s:.1f} each, {st.over_one_stream:.2f}x one stream, roofline "
                     f"{st.roofline_tok_s:.1f} ({st.roofline_tok_s / one_stream[st.kv_cache].roofline_tok_s:.2f}x "
                     f"one); verify-16 of each {st.verify16_ms:.2f} ms "
                     f"(eager {st.verify16_ms_eager:.2f})")
    lines.append(f"  peak memory {result.peak_memory_bytes / GiB:.2f} GiB (plan {result.plan['total_gib']:.2f} GiB)")
    lines += [f"  goal {name}: {'met' if ok else 'NOT met'}" for name, ok in result.goals.items()]
    lines.append(f"results in {out} and {out.with_suffix('.png')}")
    return "\n".join(lines)


# The bounded drafter window the plan table shows (--draft-ctx): twice the Gemma 4 drafters' sliding window.
PLAN_DRAFT_CTX = 4096


def command(model: str | None, quant: str | None, ctx_size: int | None, plan_only: bool, gpu_memory: str | None,
            as_json: bool, out: Path | None) -> str:
    """`bench --synthetic ...`: validate the options, run the plan or the benchmark, return what to print."""
    if model is None:
        raise UserError("--quant, --ctx-size, --plan-only, --gpu-memory and --json go with --synthetic")
    quant = quant or QUANTS[0]
    ctx = ctx_size or DEFAULT_CTX
    if plan_only:
        if gpu_memory is None:
            raise UserError("--plan-only needs --gpu-memory (e.g. 24GiB): the memory to plan for")
        budget = parse_size(gpu_memory)
        target, draft = SYNTHETIC_CONFIGS[model]
        config = target()
        weights = synthetic_weight_bytes(config, quant)
        drafter = DrafterPlan(draft(), DRAFT_QUANT)
        plan = fit_context(budget, config, weights, requested=ctx, drafter=drafter)  # refuses what does not fit
        # the largest context with and without the drafter, in each KV dtype a cache stores
        bounded = DrafterPlan(drafter.config.with_context_window(PLAN_DRAFT_CTX), DRAFT_QUANT)
        largest = {name: {kv: largest_context(budget, config, weights, drafter=d, kv_dtype=kv)
                          for kv in STORED_KV_DTYPES}
                   for name, d in (("drafter", drafter), ("drafter_bounded", bounded), ("no_drafter", None))}
        labels = {"drafter": "with drafter", "drafter_bounded": f"draft-ctx {PLAN_DRAFT_CTX}",
                  "no_drafter": "no drafter"}
        if as_json:
            return json.dumps({"model": model, "quant": quant, "draft_quant": DRAFT_QUANT, "gpu_memory_bytes": budget,
                               "draft_ctx_bounded": PLAN_DRAFT_CTX, "largest_ctx_size": largest["drafter"]["model"],
                               "largest_ctx": largest,
                               **plan.to_json()})
        lines = [f"{model} {quant} + {DRAFT_QUANT} drafter", plan.describe(),
                 f"  largest context that fits in {budget / GiB:.2f} GiB (tokens):",
                 f"    {'':<16}" + "".join(f"{kv + ' KV':>10}" for kv in STORED_KV_DTYPES)]
        lines += [f"    {labels[name]:<16}" + "".join(f"{n:>10}" for n in row.values())
                  for name, row in largest.items()]
        return "\n".join(lines)
    if gpu_memory is not None:
        raise UserError("--gpu-memory goes with --plan-only (the benchmark plans for the GPU's own free memory)")
    result = run_synthetic_bench(model, quant, ctx_size)
    result.command = shlex.join(["dflash-agent", *sys.argv[1:]])
    return report(result, out or Path(f"bench-results/synthetic-{model}-{quant}.json"), as_json)
