"""The Triton kernels fit RTX cards: every launch the engine makes for Gemma 4 31B and its drafter, compiled for
sm_86 / 89 / 90 / 120 on the CPU (`dflash-agent bench --kernels`), within the budgets of bench.kernels.

The report runs in a subprocess: this test session may have set TRITON_INTERPRET=1 (tests/conftest.py), and
Triton decides at import whether it compiles. Compiled kernels are kept in Triton's cache, so a rerun is quick.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_agent.bench.kernels import DECODE_REGISTERS, KernelConfig, violations

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("kernels") / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "dflash_agent", "bench", "--kernels", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert out.exists(), done.stderr
    data = json.loads(out.read_text())
    data["returncode"], data["stdout"] = done.returncode, done.stdout
    return data


def test_every_launch_within_budget(report) -> None:
    assert report["budget_violations"] == [], "\n".join(report["budget_violations"])
    assert report["returncode"] == 0 and "every budget holds" in report["stdout"]


def test_report_covers_the_engine_launches(report) -> None:
    configs = report["configs"]
    assert all(set(c["usage"]) == {"sm_86", "sm_89", "sm_90", "sm_120"} for c in configs)
    matmuls = {(c["detail"].split()[0], c["phase"]) for c in configs if c["kernel"] == "quant_matmul"}
    for qtype in ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0"):  # Q4_0, Q4_K_M's and Q5_K_M's mixes, Q8_0
        for phase in ("decode", "prefill"):
            assert (qtype, phase) in matmuls
    # verify blocks and several requests' decode rows compile to the kernel a decode step alone runs (the 16-row
    # tile, held to the decode budgets): one rounding
    tiles = [c for c in configs if c["kernel"] == "quant_matmul" and c["phase"] == "decode" and "'GEMV': False" in
             c["detail"]]
    assert all("'BLOCK_M': 16" in c["detail"] for c in tiles)
    assert any(use.endswith(" M=1") for c in tiles for use in c["used_by"])
    assert any(use.endswith(" M=4") for c in tiles for use in c["used_by"])
    assert not any(phase == "slots" for _, phase in matmuls)
    # their attention: each row over its own cache in one launch, and their keys written by one
    joint = {c["kernel"] for c in configs if c["phase"] == "slots" and "'ROWS': True" in c["detail"]}
    assert joint == {"cache_attention"}
    written = {" ".join(c["detail"].split()[:2]) for c in configs if c["kernel"] == "write_rows"}
    # bf16 caches, and int8 ones: their keys, then their scales (one per 32 values)
    assert {"torch.bfloat16 d=256", "torch.int8 d=256", "torch.bfloat16 d=8"} <= written
    assert {"torch.bfloat16 d=512", "torch.int8 d=512", "torch.bfloat16 d=16"} <= written
    assert any(c["kernel"] == "combine_chunks" for c in configs)
    heads = {c["detail"].split()[0] for c in configs if c["kernel"] == "cache_attention"}
    assert heads == {"d=256", "d=512", "d=128"}  # sliding, full, drafter
    assert any("int8 KV" in c["detail"] for c in configs) and any("split keys" in c["detail"] for c in configs)


def _config(phase: str, kernel: str = "quant_matmul", **usage) -> KernelConfig:
    u = dict(registers=64, stack=0, local=0, shared=1024, num_warps=4) | usage
    return KernelConfig(kernel, phase, "Q4_K {}", ["x"], {"sm_89": u})


def test_violations_name_each_broken_budget() -> None:
    assert violations([_config("decode"), _config("prefill", registers=255)]) == []
    assert "spilled" in violations([_config("verify", stack=8)])[0]
    assert "spilled" in violations([_config("prefill", kernel="cache_attention", local=4)])[0]
    assert "registers" in violations([_config("decode", registers=DECODE_REGISTERS + 1)])[0]
    assert violations([_config("slots", registers=DECODE_REGISTERS)]) == []
    assert "registers (budget 192)" in violations([_config("slots", registers=DECODE_REGISTERS + 1)])[0]
    assert "shared" in violations([_config("prefill", shared=100 * 1024)])[0]


def test_kernels_option_takes_no_model_options() -> None:
    done = subprocess.run([sys.executable, "-m", "dflash_agent", "bench", "--kernels", "--spec"],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 2 and "--kernels takes only --json and --out" in done.stderr
