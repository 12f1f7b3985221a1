"""`dflash-agent bench --gpu-check`: the one command to run first on a machine with a GPU.

It runs two things and reports them in one table, with JSON in `bench-results/gpu-check.json` (the first
quantization's benchmark first, then the tests, whose pytest output goes to `gpu-tests.log` beside it):
- the tests that exercise the CUDA path, compiled for the device rather than interpreted: the kernels against their
  PyTorch references, the packed model, CUDA graphs, and the CUDA-only engine tests. It runs them from a checkout,
  because the wheel carries no tests;
- the synthetic Gemma 4 31B benchmark at each quantization (decode against the roofline, verify, the drafter, peak
  memory), with each result's own JSON and plot written beside it.

Without a GPU it refuses with one line. `bench --kernels` is what a CPU machine can check instead.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from ..errors import UserError

log = logging.getLogger(__name__)

# the tests that run on CUDA when there is a GPU (the rest of tests/kernels is the CPU's C kernels and the compile
# report, which need no GPU)
GPU_TESTS = (
    "tests/kernels/test_attention.py",
    "tests/kernels/test_packed_model.py",
    "tests/kernels/test_quant_matmul.py",
    "tests/kernels/test_quant_tuning.py",
    "tests/kernels/test_rms_norm.py",
    "tests/engine/test_cuda_graphs.py",
    "tests/engine/test_packed_linear.py",
    "tests/engine/test_quant.py",
    "tests/engine/test_grammar.py",
    "tests/engine/test_memory_plan.py",
)
MODEL = "gemma4-31b"
# a hung test (a capture waiting on a host sync, say) must not take the benchmarks' time with it
TESTS_TIMEOUT_S = 300


@dataclass
class Step:
    name: str
    ok: bool
    seconds: float
    detail: str


def _gpu_tests(repo: Path, log_path: Path) -> Step:
    tests = [t for t in GPU_TESTS if (repo / t).exists()]
    if not tests:
        return Step("GPU tests", False, 0.0, f"no tests/ under {repo}: run --gpu-check from a checkout")
    log.info("running the GPU tests: %s (pytest's output in %s)", " ".join(tests), log_path)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled for the device
    # Triton compiles each kernel on first use: spread over the cores (pytest-xdist) where it is installed
    parallel = ["-n", str(min(12, os.cpu_count() or 1))] if importlib.util.find_spec("xdist") else []
    started = time.perf_counter()
    with log_path.open("w") as output:  # a file, so a run stopped at its timeout keeps what pytest printed
        try:
            returncode = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", *parallel, *tests],
                cwd=repo, env=env, stdout=output, stderr=subprocess.STDOUT, timeout=TESTS_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            returncode = None
    lines = log_path.read_text(errors="replace").strip().splitlines()
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    last = lines[-1:] if returncode is not None else [f"stopped after {TESTS_TIMEOUT_S} s"]
    detail = "; ".join([*(last or ["no output"]), *failures[:20]])
    return Step("GPU tests", returncode == 0, time.perf_counter() - started, detail)


def _synthetic(quant: str) -> Step:
    from .synthetic import report, run_synthetic_bench

    log.info("synthetic %s %s benchmark", MODEL, quant)
    started = time.perf_counter()
    try:
        result = run_synthetic_bench(MODEL, quant, None)
    except Exception as exc:  # a failed step is a finding of the check, reported beside the others
        log.debug("the synthetic benchmark failed", exc_info=True)
        return Step(f"synthetic {quant}", False, time.perf_counter() - started, f"{type(exc).__name__}: {exc}")
    result.command = f"dflash-agent bench --synthetic {MODEL} --quant {quant}"
    text = report(result, Path(f"bench-results/synthetic-{MODEL}-{quant}.json"), as_json=False)
    return Step(f"synthetic {quant}", all(result.goals.values()), time.perf_counter() - started, text)


def run_gpu_check(out: Path, repo: Path | None = None) -> tuple[str, bool]:
    """(the table to print, whether every step passed)."""
    import torch

    from .synthetic import QUANTS

    if not torch.cuda.is_available():
        raise UserError("--gpu-check needs a CUDA GPU and this machine has none; without one, "
                        "`dflash-agent bench --kernels` checks the kernels' compile budgets")
    device = torch.cuda.get_device_name()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)  # a run stopped in its first step leaves no older run's results behind
    lines = [f"GPU check on {device} (torch {torch.__version__}), {out}"]
    steps: list[Step] = []
    # the first quantization's benchmark leads: a run stopped at a device's time limit keeps the figure it is for
    runs = [partial(_synthetic, QUANTS[0]),
            partial(_gpu_tests, repo or Path(__file__).resolve().parents[2], out.with_name("gpu-tests.log")),
            *(partial(_synthetic, quant) for quant in QUANTS[1:])]
    for run in runs:
        steps.append(step := run())
        step_lines = [f"[{'ok' if step.ok else 'FAIL'}] {step.name} ({step.seconds:.0f} s)",
                      *(f"    {line}" for line in step.detail.splitlines())]
        lines += step_lines
        log.info("%s", "\n".join(step_lines))
        # written after every step, so a run stopped at a time limit keeps what it measured
        out.write_text(json.dumps({"device": device, "torch": torch.__version__,
                                   "steps": [asdict(done) for done in steps]}, indent=2))
    return "\n".join(lines), all(step.ok for step in steps)
