"""The CPU benchmark runs end to end (its figures are reported, never asserted)."""

import json

import pytest

from dflash_agent.bench.cpu import llama_bench_binary, report, run_cpu_bench


def test_bench_runs_and_writes_json(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-bench: the bench still runs, with a note
    result = run_cpu_bench(prompt_tokens=8, decode_tokens=3, repeats=1)
    out = tmp_path / "cpu.json"
    report(result, out)
    data = json.loads(out.read_text())
    assert data["prompt_tokens"] == 8 and data["decode_tokens"] == 3
    assert data["ours"]["decode_tok_s"] > 0 and data["exact"]["decode_tok_s"] > 0
    assert data["transformers"]["decode_tok_s"] > 0
    assert set(data["ratios"]) == {"vs_exact", "vs_transformers"}
    assert data["llama_cpp"] is None and "LLAMA_CPP_BIN" in data["llama_cpp_note"]


def test_llama_cpp_dir_without_llama_bench(tmp_path):
    with pytest.raises(ValueError, match="no llama-bench"):
        llama_bench_binary(str(tmp_path))
