"""Where the synthetic Gemma 4 31B's GPU steps spend their time, for the kernel work `bench --gpu-check` asks for.

Run on a GPU machine from a checkout (the lent one: `tools/device-gpu-check.sh probe`):

    python3 tools/gpu_probe.py OUT_DIR [SECONDS]

It writes OUT_DIR/probe.json (after each part, so a run stopped at its limit keeps what it measured) and logs:
- kernels: the CUDA kernels of one step (eager decode, 4 requests' decode rows, a 16-token verification, a graphed
  decode), by total time per step, from torch.profiler;
- gemv: the quant matmul at 1, 4 and 16 rows over the 31B's MLP shapes, for each launch shape of a small sweep (the
  one-row GEMV; the tile's BLOCK_N, warps and pipeline stages), beside cuBLAS multiplying the same matrix in bf16:
  GB/s of the weight's bytes, timed in CUDA graphs (a Triton launch's host cost is more than a GEMV's time).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dflash_agent.bench import synthetic
from dflash_agent.engine.cuda_graphs import enable_cuda_graphs
from dflash_agent.engine.model import RowGroup
from dflash_agent.kernels import quant_matmul as qm

log = logging.getLogger("gpu_probe")
T = GGMLQuantizationType
CONTEXT = 1024


def graphed_ms(fn, device: torch.device, calls: int = 10, iters: int = 10) -> float:
    """Milliseconds one call of `fn` keeps the GPU busy: `calls` of it captured in one CUDA graph, so that the host's
    cost of a launch (tens of microseconds for a Triton kernel, more than a GEMV takes) is not what is timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled and warmed outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return synthetic._time_ms(graph.replay, iters, device) / calls


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
    cache = target.new_cache(2 * CONTEXT)
    one = torch.zeros(1, dtype=torch.long, device=device)
    block = torch.zeros(16, dtype=torch.long, device=device)
    rows = torch.arange(16, device=device)

    def run(ids, logits_at=None):
        cached = CONTEXT - ids.shape[0]

        def step():
            if cache.length >= cached:
                cache.rollback(cached)
            else:  # the scenario before this one left fewer tokens
                synthetic._fill_context(cache, cached)
            target(ids, cache, logits_at=logits_at)
        return step

    caches = [target.new_cache(2 * CONTEXT) for _ in range(4)]

    def four_rows():
        for c in caches:
            synthetic._fill_context(c, CONTEXT - 1)
        target.forward_groups([RowGroup(one, c) for c in caches])

    scenarios = {"decode eager": run(one), "4 decode rows eager": four_rows, "verify-16 eager": run(block, rows)}
    for name, step in scenarios.items():
        out["kernels"][name] = table = kernel_table(step)
        table["wall_ms"] = round(synthetic._time_ms(step, 10, device), 2)
        log.info("%s: %.2f ms a step, %.2f ms of kernels in %d launches\n%s", name, table["wall_ms"],
                 table["kernel_us"] / 1e3, table["launches"],
                 "\n".join(f"  {k['us']:9.1f} us {k['launches']:6.1f}x  {k['name']}" for k in table["top"]))
    enable_cuda_graphs(target, slots=4)
    for name, step in {"decode graphed": run(one), "4 decode rows graphed": four_rows,
                       "verify-16 graphed": run(block, rows)}.items():
        wall = synthetic._time_ms(step, 10, device)
        out["kernels"][name] = table = kernel_table(step)
        table["wall_ms"] = round(wall, 2)
        log.info("%s: %.2f ms a step, %.2f ms of kernels in %d launches seen", name, wall, table["kernel_us"] / 1e3,
                 table["launches"])


@torch.inference_mode()
def gemv_part(out: dict, deadline: float) -> None:
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    for qtype in (T.Q4_0, T.Q4_K, T.Q6_K):
        block, type_size = GGML_QUANT_SIZES[qtype]
        for n, k in ((21504, 5376), (5376, 21504)):
            raw = synthetic._random_blocks((n, k), qtype, device, generator)
            dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            row_bytes = k // block * type_size
            for m in (1, 4, 16):
                if time.monotonic() > deadline:
                    log.info("gemv sweep stopped at its deadline")
                    return
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                y = torch.empty(m, n, device=device, dtype=torch.bfloat16)
                key = f"{qtype.name} [{n}, {k}] x {m} rows"
                results = out["gemv"][key] = {}
                cublas = graphed_ms(lambda: torch.matmul(x, dense.t()), device)
                results["cublas bf16"] = {"us": round(cublas * 1e3, 1), "GB/s": round(dense.nbytes / cublas / 1e6)}
                default = graphed_ms(
                    lambda: qm.quant_matmul(x, raw, qtype, n, one_token_rows=m if m < 16 else 0), device)
                results["default"] = {"us": round(default * 1e3, 1), "GB/s": round(raw.nbytes / default / 1e6)}
                # the one-row GEMV (a MoE pair's; dense decode rows took it until the 16-row tile replaced it)
                # beside the tile's shapes: the choice launch_shape made without a GPU to time them
                launch_shapes = [qm.LaunchShape(1, bn, warps, 1 if block == 256 else 8, gemv=True)
                                 for bn in (8, 16, 32) for warps in (1, 2) if m == 1]
                launch_shapes += [qm.LaunchShape(16, bn, warps, 4, num_stages=stages)
                                  for bn in (32, 64, 128) for warps in (4, 8) for stages in (2, 3)]
                for shape in launch_shapes:
                    name = (f"{'gemv' if shape.gemv else 'dot'} m{shape.block_m} n{shape.block_n} w{shape.num_warps}"
                            f" s{shape.num_stages}")
                    try:
                        launch = qm._launch(x, raw, qtype, y, shape, row_bytes)
                        ms = graphed_ms(launch, device)
                    except Exception as exc:  # a shape that does not compile is a finding, beside the others
                        results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                        continue
                    results[name] = {"us": round(ms * 1e3, 1), "GB/s": round(raw.nbytes / ms / 1e6)}
                best = min((r for r in results.items() if "us" in r[1]), key=lambda r: r[1]["us"])
                log.info("%s: cuBLAS bf16 %s GB/s, default %s GB/s (%s us); fastest %s %s", key,
                         results["cublas bf16"]["GB/s"], results["default"]["GB/s"], results["default"]["us"],
                         best[0], best[1])


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
