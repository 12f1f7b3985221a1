"""The CPU benchmark runs end to end (its figures are reported, never asserted)."""

import json

import pytest

from dflash_agent.bench.cpu import (
    BenchResult,
    Speed,
    _llama_cpp,
    _transformers_reference,
    llama_cpp_binary,
    report,
    run_cpu_bench,
)
from dflash_agent.engine.load.weights import resolve_model_path


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
    # decode beside a process spinning on a core, where there is more than one thread to lose
    assert (data["busy_decode_tok_s"] or 0) > 0 if data["threads"] > 1 else data["busy_decode_tok_s"] is None
    assert data["llama_cpp_busy_decode_tok_s"] is None


def test_a_model_transformers_cannot_load_leaves_its_column_out(tmp_path, monkeypatch, capsys):
    """transformers' GGUF loader knows no Gemma 4: the bench of such a file reports ours and says why the
    reference column is missing, instead of failing."""
    import torch
    import transformers

    def refuse(*args, **kwargs):
        raise ValueError("GGUF model with architecture gemma4 is not supported yet.")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    reference, note = _transformers_reference(tmp_path / "gemma-4.gguf", torch.float32)
    assert reference is None and "cannot load gemma-4.gguf (GGUF model with architecture gemma4" in note
    ours = Speed(100.0, 40.0)
    result = BenchResult(model="gemma-4.gguf", device="cpu", dtype="float32", prefill="bfloat16", threads=2,
                         prompt_tokens=8, decode_tokens=3, repeats=1, ours=ours, exact=Speed(50.0, 10.0),
                         transformers=None, transformers_note=note)
    out = tmp_path / "cpu.json"
    report(result, out)
    data = json.loads(out.read_text())
    assert data["transformers"] is None and data["ratios"] == {"vs_exact": {"prefill_tok_s": 2.0, "decode_tok_s": 4.0}}
    printed = capsys.readouterr().out
    assert "no transformers column" in printed and "bfloat16" in printed and data["prefill"] == "bfloat16"


def test_llama_cpp_dir_without_llama_bench(tmp_path):
    with pytest.raises(ValueError, match="no llama-bench"):
        llama_cpp_binary(str(tmp_path))


def test_llama_bench_figures_from_an_empty_context_and_at_the_prompts_depth():
    """With a llama.cpp build at hand ($LLAMA_CPP_BIN or PATH): pp and tg from an empty context, and tg again after
    the prompt, each read from its own row of llama-bench's JSON."""
    binary = llama_cpp_binary(None)
    if binary is None:
        pytest.skip("no llama-bench (scripts/llama-cpp.sh builds one; set LLAMA_CPP_BIN)")
    prefill_s, decode, after_prompt = _llama_cpp(binary, resolve_model_path("embedded"), 64, 4, 2)
    assert 0 < prefill_s < 60 and decode > 0 and after_prompt > 0
