"""`bench --kernels`: every Triton launch the engine makes for Gemma 4 31B and 26B-A4B and their DFlash drafters,
compiled for RTX 3090 / 4090 / 5090 and H100 (sm_86 / 89 / 120 / 90) without a GPU, with registers, spills and
shared memory per launch, checked against the budgets below.

The launches are not a hand-kept list: they come from the same functions the engine launches through
(kernels.triton.quant_matmul.quant_matmul_launch, kernels.triton.attention_triton.cache_attention_launch), called
with meta tensors of the shapes the engine passes them:
- matmuls: every packed weight of `bench --synthetic gemma4-31b` and `gemma4-26b-a4b` (the routed experts' stacks
  through kernels.triton.quant_matmul.grouped_launch, as the model launches them) at each quantization
  (bench.synthetic.quant_types, plus Q8_0: every matrix Q8_0, as llama.cpp writes it; and Q5_K_M: Q4_K_M's mix
  with Q5_K for Q4_K), at M = 1 (decode), 4 and 8
  decode rows of as many requests (slots: quant_matmul_launch's several_sequences), the CUDA-graph buckets up to
  the drafter's block (verify), PREFILL_CHUNK and a partial last chunk (prefill), and the drafter's LM head (the
  target's embedding, block - 1 rows). The drafter's own q4 matrices (QuantLinear's Q4_0
  blocks) launch the same Q4_0 kernels at its block's rows.
- attention: each layer kind of the target (sliding head_dim 256 over its ring, full head_dim 512 over the
  cache) with bf16 and q8 KV, at the same rows, where the engine routes them to the kernel (model._plan: sliding
  layers only for blocks within the ring's slack), at contexts within one key chunk of a ring, within one of a
  full cache, and a long one (so both the single-pass and the split-keys kernels, and the latter's combination);
  the slots' rows each over its own cache in one launch (kernels.triton.attention_triton.rows_attention_launch) and
  their keys' write; the drafter's CUDA-graph step attends its cache through the kernel too.
Launches that compile to the same kernel (same constexprs, dtypes and integer specializations) are merged.

Budgets (`violations`): no spilled bytes for decode / slots / verify on any target; decode and slots launches (the
16-row tiles, and a MoE's GEMV of one row a pair) at <= 192 registers per thread; shared memory within what one
program may use (99 KB on sm_86 / 89 / 120); prefill spills only up to what a kernel's docstring argues is harmless
(PREFILL_SPILL_ALLOWANCE).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import platform
import shlex
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..engine.cache.kv_cache import Q8_BLOCK, keeps_values_only
from ..engine.formats.config import ModelConfig
from ..engine.formats.drafter_config import DrafterConfig
from ..engine.limits import BUCKETS, DEFAULT_SLACK, PREFILL_CHUNK
from ..engine.model.gemma import GemmaModel
from ..engine.types import STORED_KV_DTYPES
from ..kernels.attention import OFFSETS_PER_CACHE, KeysFromValues
from ..kernels.dispatch import KEYS_PER_CHUNK, RING_KEYS_PER_CHUNK
from .synthetic import DEFAULT_CTX, SYNTHETIC_CONFIGS, quant_types

log = logging.getLogger(__name__)

T = GGMLQuantizationType
QUANTS = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q8_0")
PHASES = ("decode", "slots", "verify", "prefill")
DTYPE = torch.bfloat16  # the 31B's activations
# A decode step's 4-warp tile at <= 192 registers a thread keeps two programs an SM, each with a K step of loads in
# flight ahead of the one it multiplies. (sm_90's Q4_K tile takes 177: its wgmma keeps more live than the RTX cards'
# mma, about 100 there. Unrolled less, it took 85 but a third more instructions a weight, which is what binds.)
DECODE_REGISTERS = 192
# Spilled bytes per thread a prefill launch may have, by kernel: only what its docstring shows is harmless.
PREFILL_SPILL_ALLOWANCE: dict[str, int] = {"quant_matmul": 0, "sum_splits": 0, "cache_attention": 0,
                                           "combine_chunks": 0}


@dataclass
class KernelConfig:
    kernel: str  # quant_matmul | sum_splits (its split K's) | cache_attention | combine_chunks (keys') | write_rows
    phase: str  # decode | slots | verify | prefill
    detail: str  # what distinguishes the compiled kernel
    used_by: list[str]  # model: quantization / weight or layer kind, rows
    usage: dict[str, dict] = field(default_factory=dict)  # target -> compile_check.Usage as a dict


def _phase_rows(drafter: DrafterConfig) -> dict[str, list[int]]:
    verify = [b for b in BUCKETS if 1 < b <= drafter.block_size]
    # slots: concurrent requests' decode rows in one step (StepRunner.forward_groups), in the 16-row tiles
    return {"decode": [1], "slots": [4, 8], "verify": sorted({*verify, drafter.block_size}),
            "prefill": [PREFILL_CHUNK, PREFILL_CHUNK - 1]}


def _weight_types(config: ModelConfig, quant: str) -> dict[str, GGMLQuantizationType]:
    if quant == "Q8_0":
        types = quant_types(config, "Q4_0")
        return {name: T.Q8_0 for name, qtype in types.items() if qtype is not None}
    if quant == "Q5_K_M":
        # llama.cpp's Q5_K_M: Q4_K_M's mix with Q5_K for Q4_K. Its rows of widths no 256 divides take Q5_1 there,
        # which loads dequantized (not a packed type): they launch no quant matmul.
        types = quant_types(config, "Q4_K_M")
        return {name: T.Q5_K if qtype == T.Q4_K else qtype for name, qtype in types.items()
                if qtype is not None and qtype != T.Q5_0}
    return {name: qtype for name, qtype in quant_types(config, quant).items() if qtype is not None}


def _matmul_launches(model: str, config: ModelConfig,
                     drafter: DrafterConfig) -> Iterator[tuple[str, str, str, str, object]]:
    from ..kernels.triton.quant_matmul import decode_shape, grouped_launch, launch_shape, quant_matmul_launch

    shapes = {name: tuple(t.shape) for name, t in GemmaModel(config).state_dict().items()}
    rows = _phase_rows(drafter)
    meta = torch.device("meta")
    for quant in QUANTS:
        types = _weight_types(config, quant)
        # the tied embedding is the LM head's matrix (target, and the drafter over block - 1 positions)
        uses = [(name, phase, m) for name in types for phase, ms in rows.items() for m in ms]
        head = "embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"
        uses.append((f"drafter LM head ({head})", "verify", drafter.block_size - 1))
        for name, phase, m in uses:
            weight = head if name.startswith("drafter") else name
            qtype = types[weight]
            n, k = shapes[weight][-2:]
            block, type_size = GGML_QUANT_SIZES[qtype]
            x = torch.empty(m, k, dtype=DTYPE, device=meta)
            if len(shapes[weight]) == 3:  # an expert stack: m tokens' top k of its matrices in one grouped launch
                experts = shapes[weight][0]
                # decode rows (one request's or several): a GEMV program a pair; else as if every token's rows were
                # one expert's: the widest tile
                shape = decode_shape(qtype) if phase in ("decode", "slots") else launch_shape(m, qtype)
                tiles = -(-m * config.moe.top_k // shape.block_m)
                raw = torch.empty(experts * n * (k // block) * type_size, dtype=torch.uint8, device=meta)
                y = torch.empty(tiles * shape.block_m, n, dtype=DTYPE, device=meta)
                x_rows = torch.empty(tiles * shape.block_m, dtype=torch.int32, device=meta)
                tile_expert = torch.empty(tiles, dtype=torch.int32, device=meta)
                plan = grouped_launch(x, raw, qtype, experts, x_rows, tile_expert, y, shape)
            else:
                raw = torch.empty(n * (k // block) * type_size, dtype=torch.uint8, device=meta)
                y = torch.empty(m, n, dtype=DTYPE, device=meta)
                plan = quant_matmul_launch(x, raw, qtype, y, several_sequences=phase == "slots")
            short = name.removesuffix(".weight").split(".", 2)[-1] if name.startswith("layers.") else name
            use = f"{model} {quant}: {short} K={k} M={m}"
            yield "quant_matmul", phase, f"{qtype.name}", use, plan.launch
            if plan.total is not None:  # K split: the partials' sum
                yield "sum_splits", phase, f"split={plan.launch.grid[2]}", use, plan.total


def _attention_launches(model: str, config: ModelConfig,
                        drafter: DrafterConfig) -> Iterator[tuple[str, str, str, str, object]]:
    from ..kernels.triton.attention_triton import cache_attention_launch, rows_attention_launch, write_rows_launch

    meta = torch.device("meta")
    rows = _phase_rows(drafter)
    kinds = {}
    for spec in config.layers:  # one per distinct layer kind
        kinds[(spec.sliding, spec.head_dim, spec.num_kv_heads, keeps_values_only(spec))] = spec
    for context in (RING_KEYS_PER_CHUNK, KEYS_PER_CHUNK, DEFAULT_CTX):
        cases = []
        for (sliding, d, kv_heads, _), spec in kinds.items():
            slots = min(context, config.sliding_window + DEFAULT_SLACK) if sliding else context
            for kv_dtype in STORED_KV_DTYPES:
                for phase, ms in rows.items():
                    for t in ms:
                        if sliding and t > DEFAULT_SLACK + 1:
                            continue  # model._plan: blocks past the ring's slack attend through SDPA
                        name = f"{model} {'sliding' if sliding else 'full'} d={d} {kv_dtype} KV"
                        cases.append((phase, name, config.num_heads, kv_heads, d, slots,
                                      config.sliding_window if sliding else None, sliding, kv_dtype, t,
                                      keeps_values_only(spec, kv_dtype)))
        # the drafter's captured step: its block of queries over its whole cache, slot = position
        for window in sorted(set(drafter.window), key=lambda w: w or 0):
            cases.append(("verify", f"drafter window={window}", drafter.num_heads, drafter.num_kv_heads,
                          drafter.head_dim, context, window, False, "model", drafter.block_size, False))
        for phase, name, heads, kv_heads, d, slots, window, ring, kv_dtype, t, values_only in cases:
            # a layer that keeps V alone: its keys rebuilt from it as the kernel reads them
            keys_from = KeysFromValues(torch.empty(d, device=meta), torch.empty(d // 2, device=meta)) \
                if values_only else None
            q = torch.empty(t, heads, d, dtype=DTYPE, device=meta)
            q8 = kv_dtype == "q8"
            k = torch.empty(slots, kv_heads, d, dtype=torch.int8 if q8 else DTYPE, device=meta)
            scales = torch.empty(slots, kv_heads, d // Q8_BLOCK, dtype=DTYPE, device=meta) if q8 else None
            pos = torch.empty(t, dtype=torch.long, device=meta)
            if phase == "slots":  # each request's decode row over its own cache, all in one launch (JointAttention)
                offsets = torch.empty(t, OFFSETS_PER_CACHE, dtype=torch.long, device=meta)
                k_pos = torch.empty(t, slots, dtype=torch.long, device=meta) if ring else None
                plan = rows_attention_launch(q, k, k, pos, k_pos, window, d**-0.5, offsets, scales, scales, keys_from)
                # the new keys (LayerKV.write_rows): int8 ones and their scales a launch each
                for stored in [k] if scales is None else [k, scales]:
                    new = torch.empty(t, kv_heads, stored.shape[-1], dtype=stored.dtype, device=meta)
                    write = write_rows_launch(new, new, stored, stored, pos, offsets)
                    yield "write_rows", phase, f"{stored.dtype} d={stored.shape[-1]}", f"{name}: rows={t}", write
            else:
                k_pos = torch.empty(slots, dtype=torch.long, device=meta) if ring else None
                plan = cache_attention_launch(q, k, k, pos, k_pos, window, d**-0.5, scales, scales, keys_from)
            kv = ("int8" if q8 else "bf16") + (" V-only KV" if values_only else " KV")
            split = "split keys" if plan.combine is not None else "one pass"
            use = f"{name}: T={t} S={slots}"
            yield "cache_attention", phase, f"d={d} group={heads // kv_heads} {kv} {split}", use, plan.launch
            if plan.combine is not None:
                yield "combine_chunks", phase, f"d={d} heads={heads}", use, plan.combine


def kernel_configs() -> list[tuple[KernelConfig, object]]:
    """Every distinct compiled kernel the engine launches for the synthetic targets and their drafters, with one
    launch each."""
    from .compile_check import compile_key

    merged: dict[str, tuple[KernelConfig, object]] = {}
    launches = []
    for model, (target, draft) in SYNTHETIC_CONFIGS.items():
        config, drafter = target(), draft()
        launches += [(model, *launch) for launch in _matmul_launches(model, config, drafter)]
        launches += [(model, *launch) for launch in _attention_launches(model, config, drafter)]
    for model, kernel, phase, detail, use, launch in launches:
        key = compile_key(launch)
        if key not in merged:
            meta = {k: v for k, v in launch.meta.items() if k != "DOT"}
            merged[key] = (KernelConfig(kernel, phase, f"{detail} {meta}", []), launch)
        entry = merged[key][0]
        # a kernel shared by phases is held to the strictest budget of them
        entry.phase = min(phase, entry.phase, key=PHASES.index)
        if len(entry.used_by) < 8 or not any(u.startswith(f"{model} ") for u in entry.used_by):
            entry.used_by.append(use)  # a few uses, and one of each model
    return list(merged.values())


_LAUNCHES: list = []


def _compile(job: tuple[int, str]) -> tuple[int, str, dict]:
    from .compile_check import resource_usage

    index, target = job
    return index, target, asdict(resource_usage(_LAUNCHES[index], target))


def compile_all(targets: list[str], workers: int | None = None) -> list[KernelConfig]:
    """Compile every config for every target (in parallel processes) and fill in its usage."""
    pairs = kernel_configs()
    configs = [c for c, _ in pairs]
    _LAUNCHES[:] = [launch for _, launch in pairs]
    jobs = [(i, t) for i in range(len(pairs)) for t in targets]
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    if workers == 1:
        results = map(_compile, jobs)
    else:  # fork: the children inherit the launches (meta tensors, jit functions) instead of pickling them
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        results = pool.map(_compile, jobs)
    log.info("compiling %d kernels for %s (Triton's cache keeps them for the next run)", len(pairs),
             ", ".join(targets))
    for done, (index, target, usage) in enumerate(results, 1):
        configs[index].usage[target] = usage
        if done % 20 == 0:
            log.info("%d / %d compiled", done, len(jobs))
    if workers > 1:
        pool.shutdown()
    return configs


def violations(configs: list[KernelConfig]) -> list[str]:
    """Every budget of the module doc a config breaks, one line each."""
    from .compile_check import SHARED_LIMIT

    out = []
    for c in configs:
        for target, u in c.usage.items():
            where = f"{c.kernel} {c.phase} {c.detail} on {target}"
            spilled = u["stack"] + u["local"]
            allowed = PREFILL_SPILL_ALLOWANCE[c.kernel] if c.phase == "prefill" else 0
            if spilled > allowed:
                out.append(f"{where}: {spilled} spilled bytes (budget {allowed})")
            if c.kernel == "quant_matmul" and c.phase in ("decode", "slots") and u["registers"] > DECODE_REGISTERS:
                out.append(f"{where}: {u['registers']} registers (budget {DECODE_REGISTERS})")
            if u["shared"] > SHARED_LIMIT[target]:
                out.append(f"{where}: {u['shared']} bytes of shared memory (limit {SHARED_LIMIT[target]})")
    return out


def table(configs: list[KernelConfig], targets: list[str]) -> str:
    head = "| kernel | phase | config | " + " | ".join(f"{t} regs / spill / shared KB" for t in targets) + " |"
    lines = [head, "|" + "---|" * (3 + len(targets))]
    for c in configs:
        cells = []
        for t in targets:
            u = c.usage[t]
            cells.append(f"{u['registers']} / {u['stack'] + u['local']} / {u['shared'] / 1024:.1f}")
        lines.append(f"| {c.kernel} | {c.phase} | {c.detail} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def command(out: Path | None, as_json: bool, targets: list[str] | None = None) -> tuple[str, bool]:
    """`bench --kernels`: compile, write JSON, return (what to print, whether every budget holds)."""
    import triton

    from .compile_check import TARGETS

    targets = targets or list(TARGETS)
    configs = compile_all(targets)
    broken = violations(configs)
    out = out or Path("bench-results/kernels.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"command": shlex.join(["dflash-agent", *sys.argv[1:]]), "triton": triton.__version__,
            "host": platform.node(), "targets": targets, "budget_violations": broken,
            "configs": [asdict(c) for c in configs]}
    out.write_text(json.dumps(data, indent=2) + "\n")
    if as_json:
        return json.dumps(data), not broken
    lines = [f"Triton {triton.__version__}: {len(configs)} distinct kernels the engine launches for "
             f"{' and '.join(SYNTHETIC_CONFIGS)} and their drafters, compiled for {', '.join(targets)} "
             "(registers / thread, spilled bytes / thread, "
             "shared KB / program)", table(configs, targets), ""]
    lines += [f"budget broken: {v}" for v in broken] or ["every budget holds"]
    lines.append(f"results in {out}")
    return "\n".join(lines), not broken
