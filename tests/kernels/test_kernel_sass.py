"""scripts/kernel_sass.py: the quant matmul's instructions a weight, read from SASS compiled for sm_89 / sm_90 without a
GPU. Run as a subprocess: this session may have set TRITON_INTERPRET=1, and Triton decides at import whether it
compiles."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).parents[2]


def test_the_tile_issues_fewer_instructions_a_weight_than_the_gemv() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "scripts/kernel_sass.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    rows = {tuple(m.group(1, 2)): [float(v) for v in re.findall(r"sm_\d+ ([\d.]+)", m.group(3))]
            for m in re.finditer(r"^(Q\w+)\s+(tile|GEMV)\s+(.*)$", done.stdout, re.M)}
    assert {q for q, _ in rows} == {"Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    for qtype in ("Q4_0", "Q4_K", "Q6_K"):  # the 31B's quantizations: a decode row costs less in the tile
        tile, gemv = rows[(qtype, "tile")], rows[(qtype, "GEMV")]
        assert len(tile) == len(gemv) == 2 and all(0 < t < g for t, g in zip(tile, gemv, strict=True)), qtype
