"""Where the synthetic Gemma 4 31B's GPU steps spend their time, for the kernel work `bench --gpu-check` asks for.

Run on a GPU machine from a checkout (the lent one: `scripts/device-gpu-check.sh probe`):

    python3 scripts/gpu_probe.py OUT_DIR [SECONDS]

It writes OUT_DIR/probe.json (after each part, so a run stopped at its limit keeps what it measured) and logs:
- kernels: the CUDA kernels of one step (eager decode, 4 requests' decode rows, a 16-token verification, a graphed
  decode, a DFlash drafter's step), by total time per step, from torch.profiler;
- gemv: kernels.triton.quant_tuning's timing of every candidate tile (a decode row plus a 16-row verification block)
  over the 31B's MLP shapes and a K projection's, beside cuBLAS multiplying the same matrix in bf16, timed in CUDA
  graphs (a Triton launch's host cost is more than a GEMV's time).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dflash_agent.bench import synthetic
from dflash_agent.engine.backends.cuda import DraftStepGraph, cuda_step_graphs
from dflash_agent.engine.model.gemma import RowGroup
from dflash_agent.engine.model.packed import choose_cuda_tiles
from dflash_agent.engine.runner import StepRunner
from dflash_agent.kernels.dispatch import VERIFY_ROWS
from dflash_agent.kernels.triton import quant_matmul as qm
from dflash_agent.kernels.triton.quant_tuning import choose_tile, graphed_cost, graphed_ms

log = logging.getLogger("gpu_probe")
T = GGMLQuantizationType
CONTEXT = 1024


def kernel_table(step, iters: int = 3, top: int = 25) -> dict:
    """The CUDA kernels one call of `step` runs: per-step microseconds and launches by kernel name."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            entry = by_name.setdefault(event.name[:100], [0.0, 0])
            entry[0] += event.time_range.elapsed_us() / iters
            entry[1] += 1 / iters
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    total = sum(us for us, _ in by_name.values())
    return {"kernel_us": round(total, 1), "launches": round(sum(n for _, n in by_name.values())),
            "top": [{"name": name, "us": round(us, 1), "launches": round(n, 1)} for name, (us, n) in ranked[:top]]}


@torch.inference_mode()
def steps_part(out: dict) -> None:
    device = torch.device("cuda")
    dtype = torch.bfloat16
    config = synthetic.gemma4_31b_config()
    target = synthetic.build_synthetic_target(config, "Q4_0", device, dtype)
    choose_cuda_tiles(target.matmul_weights())
    cache = target.new_cache(2 * CONTEXT)
    one = torch.zeros(1, dtype=torch.long, device=device)
    block = torch.zeros(16, dtype=torch.long, device=device)
    rows = torch.arange(16, device=device)

    eager = StepRunner(target)

    def run(runner, ids, logits_at=None):
        cached = CONTEXT - ids.shape[0]

        def step():
            if cache.length >= cached:
                cache.rollback(cached)
            else:  # the scenario before this one left fewer tokens
                synthetic._fill_context(cache, cached)
            runner.forward(ids, cache, logits_at=logits_at)
        return step

    caches = [target.new_cache(2 * CONTEXT) for _ in range(4)]

    def four_rows(runner):
        def step():
            for c in caches:
                synthetic._fill_context(c, CONTEXT - 1)
            runner.forward_groups([RowGroup(one, c) for c in caches])
        return step

    scenarios = {"decode eager": run(eager, one), "4 decode rows eager": four_rows(eager),
                 "verify-16 eager": run(eager, block, rows)}
    for name, step in scenarios.items():
        out["kernels"][name] = table = kernel_table(step)
        table["wall_ms"] = round(synthetic._time_ms(step, 10, device), 2)
        log.info("%s: %.2f ms a step, %.2f ms of kernels in %d launches\n%s", name, table["wall_ms"],
                 table["kernel_us"] / 1e3, table["launches"],
                 "\n".join(f"  {k['us']:9.1f} us {k['launches']:6.1f}x  {k['name']}" for k in table["top"]))
    graphed = StepRunner(target, graphs=cuda_step_graphs(target, slots=4))
    for name, step in {"decode graphed": run(graphed, one), "4 decode rows graphed": four_rows(graphed),
                       "verify-16 graphed": run(graphed, block, rows)}.items():
        wall = synthetic._time_ms(step, 10, device)
        out["kernels"][name] = table = kernel_table(step)
        table["wall_ms"] = round(wall, 2)
        log.info("%s: %.2f ms a step, %.2f ms of kernels in %d launches seen", name, wall, table["kernel_us"] / 1e3,
                 table["launches"])
    # last, so a failure here loses none of the above: a DFlash draft as bench --synthetic times it (a block of 16
    # after the context, the LM head on 15 rows, argmax): the graph's wall time, and its kernels run eagerly
    drafter = synthetic.build_synthetic_drafter(synthetic.gemma4_31b_drafter_config(), config.hidden_size,
                                                synthetic.DRAFT_QUANT, device, dtype)
    dcache = drafter.new_cache(2 * CONTEXT)
    dcache.length = CONTEXT - 16
    embeds = target.embed_tokens.weight[block]
    draft = DraftStepGraph(drafter, target.output_weight, dcache, block=16)
    wall = synthetic._time_ms(lambda: draft.draft(embeds), 10, device)
    out["kernels"]["drafter step"] = table = kernel_table(draft._step)  # the inputs the graph's replays left
    table["wall_ms"] = round(wall, 2)
    log.info("drafter step: %.2f ms graphed, %.2f ms of kernels in %d launches eagerly\n%s", wall,
             table["kernel_us"] / 1e3, table["launches"],
             "\n".join(f"  {k['us']:9.1f} us {k['launches']:6.1f}x  {k['name']}" for k in table["top"]))


@torch.inference_mode()
def gemv_part(out: dict, deadline: float) -> None:
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for qtype in (T.Q4_0, T.Q4_K, T.Q6_K):
        for n, k in ((21504, 5376), (5376, 21504), (4096, 5376)):
            if time.monotonic() > deadline:
                log.info("tile sweep stopped at its deadline")
                return
            raw = synthetic._random_blocks((n, k), qtype, device, generator)
            dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for m in (1, VERIFY_ROWS)]
            cublas = graphed_ms(lambda: [torch.matmul(x, dense.t()) for x in xs]) * 1e3
            times: dict[qm.TileChoice, float] = {}
            cost = graphed_cost(raw, qtype, n, k, torch.bfloat16)

            def recorded(choice: qm.TileChoice) -> float:
                times[choice] = cost(choice)
                return times[choice]

            best, measured = choose_tile(qtype, n, k, sms, recorded)
            key = f"{qtype.name} [{n}, {k}]"
            out["gemv"][key] = {
                "cublas bf16 us": round(cublas, 1), **measured,
                "us": {f"n{c.shape.block_n} w{c.shape.num_warps} s{c.shape.num_stages} b{c.shape.blocks} "
                       f"split{c.split}": round(t, 1) for c, t in sorted(times.items(), key=lambda i: i[1])}}
            log.info("%s, a decode row + a 16-row block: cuBLAS bf16 %.1f us; tile default %.1f us, best %.1f us "
                     "(%s)", key, cublas, measured["default_us"], measured["best_us"], best)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out_dir = Path(sys.argv[1])
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 300.0
    deadline = time.monotonic() + seconds
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kernels": {}, "gemv": {}}
    path = out_dir / "probe.json"
    for part in (steps_part, lambda o: gemv_part(o, deadline)):
        try:
            part(out)
        except Exception:
            log.exception("a probe part failed")
        path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
