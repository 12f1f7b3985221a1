"""The CPU benchmark runs end to end (its figures are reported, never asserted)."""

import json

from dflash_agent.bench.cpu import report, run_cpu_bench


def test_bench_runs_and_writes_json(tmp_path):
    result = run_cpu_bench(prompt_tokens=8, decode_tokens=3, repeats=1)
    out = tmp_path / "cpu.json"
    report(result, out)
    data = json.loads(out.read_text())
    assert data["prompt_tokens"] == 8 and data["decode_tokens"] == 3
    assert data["ours"]["decode_tok_s"] > 0 and data["transformers"]["decode_tok_s"] > 0
    assert set(data["ratios"]) == {"prefill_tok_s", "decode_tok_s"}
