"""tools/gpu_probe.py, the GPU machine's diagnosis of where a step's time goes, runs end to end on a tiny model (on the
CPU through the interpreter, or on the GPU): a lent machine's minutes are too few to find its bugs there."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from gguf import GGMLQuantizationType as T

PROBE = Path(__file__).resolve().parents[2] / "tools" / "gpu_probe.py"


def test_probe_tables_a_tiny_models_steps_and_sweeps_a_gemv(kernels) -> None:
    from tests.engine.test_packed_linear import tiny_gemma4_config

    spec = importlib.util.spec_from_file_location("gpu_probe", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)  # after the fixture: the probe's kernels are the ones it runs
    probe.CONTEXT = 32
    out: dict = {"kernels": {}, "gemv": {}}
    probe.steps_part(out, tiny_gemma4_config(), kernels.device)
    assert set(out["kernels"]) == {f"{step} {mode}" for step in ("decode", "4 decode rows", "verify-16")
                                   for mode in ("eager", "graphed")}
    for table in out["kernels"].values():
        assert table["launches"] > 0 and table["kernel_us"] > 0 and table["wall_ms"] > 0 and table["top"]
    probe.gemv_part(out, time.monotonic() + 600, shapes=((64, 256),), qtypes=(T.Q4_K,), row_counts=(4,),
                    device=kernels.device)
    (key, results), = out["gemv"].items()
    assert key == "Q4_K [64, 256] x 4 rows"
    # cuBLAS, the default launch, and rows a program x BLOCK_N x warps of the GEMV beside the tensor-core tiles
    assert len(results) == 2 + 2 * 3 * 2 + 2 * 2 and all("us" in r and r["us"] > 0 for r in results.values())
