"""`bench --synthetic gemma4-31b`: the 31B shapes and byte counts against published figures, the 24 GB memory
plan, and the CLI's plan-only and no-GPU behaviour (the benchmark itself needs CUDA)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dflash_agent.bench import synthetic
from dflash_agent.bench.synthetic import (
    DecodeSpeed,
    SyntheticResult,
    gemma4_26b_a4b_config,
    gemma4_31b_config,
    gemma4_31b_drafter_config,
    parse_size,
    quant_types,
    synthetic_plan,
    synthetic_weight_bytes,
)
from dflash_agent.cli import main
from dflash_agent.engine.memory_plan import DrafterPlan, GiB, drafter_weight_bytes, weight_bytes
from dflash_agent.engine.model.gemma import GemmaModel


def test_31b_shapes_match_the_model_card() -> None:
    # shared/reference/gemma4.md 1: 30,697,345,340 text-decoder parameters (Google's and NVIDIA's "30.7B")
    config = gemma4_31b_config()
    assert sum(t.numel() for t in GemmaModel(config).state_dict().values()) == 30_697_345_340
    full = [i for i, spec in enumerate(config.layers) if not spec.sliding]
    assert full == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert {(s.head_dim, s.num_kv_heads, s.k_eq_v) for s in config.layers} == {(256, 16, False), (512, 4, True)}
    # dflash.md 1.2: about 1.54B drafter parameters (1.36B in the layers + 173M in fc)
    drafter = gemma4_31b_drafter_config()
    params = drafter_weight_bytes(DrafterPlan(drafter, None), config.hidden_size, torch.bfloat16) // 2
    assert abs(params - 1.54e9) < 0.01e9
    assert drafter.target_layer_ids == (1, 12, 23, 35, 46, 57)


def test_quantized_sizes_match_published_files() -> None:
    # gemma4.md 3.2 / 6.2: Google's QAT Q4_0 GGUF is 16.44 GiB; unsloth's Q4_K_M 18.7 GB (17.4 GiB). The files
    # also hold metadata and the tokenizer, so ours (weights only) may be a little smaller.
    config = gemma4_31b_config()
    q4_0 = synthetic_weight_bytes(config, "Q4_0")
    q4_k_m = synthetic_weight_bytes(config, "Q4_K_M")
    assert 16.30 * GiB < q4_0 <= 16.44 * GiB
    assert 18.5e9 < q4_k_m <= 18.7e9
    types = quant_types(config, "Q4_K_M")
    # llama.cpp's use_more_bits gives Q6_K to half the ffn_down and attn_v tensors
    assert sum(t.name == "Q6_K" for n, t in types.items() if n.endswith("down_proj.weight")) == 30
    assert sum(t.name == "Q6_K" for n, t in types.items() if n.endswith("v_proj.weight")) == 25
    with pytest.raises(ValueError, match="unknown quantization"):
        quant_types(config, "Q3_K_S")


def test_26b_a4b_shapes_and_size_match_the_published_figures() -> None:
    # issue 34 / Google's model card: 25.2B parameters, about 3.8B active (8 of 128 experts); QAT Q4_0 is 14.4 GB
    config = gemma4_26b_a4b_config()
    state = GemmaModel(config).state_dict()
    total = sum(t.numel() for t in state.values())
    experts = sum(t.numel() for name, t in state.items() if ".experts." in name)
    assert abs(total - 25.2e9) < 0.05e9
    assert abs(total - experts + experts * 8 / 128 - 3.8e9) < 0.05e9
    assert abs(synthetic_weight_bytes(config, "Q4_0") - 14.4e9) < 0.05e9
    types = quant_types(config, "Q4_K_M")
    assert types["layers.0.router.proj.weight"] is None
    # 704-wide expert rows hold no whole 256-value super-block: llama.cpp's fallbacks, Q8_0 for Q6_K, Q5_0 for Q4_K
    assert types["layers.0.experts.down_proj"].name == "Q8_0" and types["layers.4.experts.down_proj"].name == "Q5_0"
    assert types["layers.0.experts.gate_up_proj"].name == "Q4_K"


def test_26b_a4b_plans_a_long_context_on_24_gib_with_its_drafter() -> None:
    result = CliRunner().invoke(main, ["bench", "--synthetic", "gemma4-26b-a4b", "--plan-only", "--gpu-memory",
                                       "24GiB", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["fits"] and plan["items"]["drafter weights"] > 0
    # a few times the 31B's reach (about 50K tokens): 5 full-attention layers of 2 KV heads, 14 GB of weights
    assert plan["largest_ctx_size"] > 200_000
    # issue 64's goal: the model's whole 256K with the drafter, in 8 bits
    assert plan["largest_ctx"]["drafter"]["q8"] == 262144


@pytest.mark.parametrize("draft_quant", ["q4", "q8"])
def test_q4_0_with_a_quantized_drafter_and_32k_plans_within_23_gib(draft_quant) -> None:
    plan = synthetic_plan("Q4_0", 32768, parse_size("24GiB"), draft_quant)
    assert plan.total_bytes <= 23 * GiB, plan.describe()
    assert plan.fits


def test_parse_size() -> None:
    assert parse_size("24GiB") == parse_size("24 gib") == parse_size("24G") == 24 * GiB
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("23.5GiB") == int(23.5 * GiB)
    assert parse_size("24000MiB") == 24000 << 20
    assert parse_size("1073741824") == GiB
    for bad in ("lots", "24 parsecs", "-3GiB", "0", "nanGiB"):
        with pytest.raises(ValueError, match="cannot read"):
            parse_size(bad)


def run_cli(*args: str):
    return CliRunner().invoke(main, ["bench", *args])


def test_plan_only_prints_the_plan_without_a_gpu() -> None:
    result = run_cli("--synthetic", "gemma4-31b", "--quant", "Q4_0", "--plan-only", "--gpu-memory", "24GiB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["ctx_size"] == 32768 and data["quant"] == "Q4_0" and data["fits"]
    assert data["total_bytes"] == sum(data["items"].values()) <= 23 * GiB
    assert data["largest_ctx_size"] == data["largest_ctx"]["drafter"]["model"] > 32768
    reach = data["largest_ctx"]  # 8 bits hold more than the model's dtype, and so does leaving the drafter out
    assert reach["drafter"]["q8"] > reach["drafter"]["model"] < reach["no_drafter"]["model"] < reach["no_drafter"]["q8"]
    # issue 64's goal for one 24 GB card in bf16: the full layers keep V alone, the drafter's sliding layers a ring
    assert reach["drafter"]["model"] >= 96 * 1024
    # a bounded drafter window (--draft-ctx) stops the drafter's full layer growing with the context
    assert reach["drafter"]["model"] < reach["drafter_bounded"]["model"] < reach["no_drafter"]["model"]
    assert data["draft_ctx_bounded"] == 4096
    text = run_cli("--synthetic", "gemma4-31b", "--quant", "Q4_K_M", "--plan-only", "--gpu-memory", "24GiB")
    assert text.exit_code == 0 and "target weights" in text.output and "largest context that fits" in text.output
    assert "model KV" in text.output and "q8 KV" in text.output and "no drafter" in text.output
    assert "draft-ctx 4096" in text.output


def test_too_large_context_is_refused_with_what_fits() -> None:
    result = run_cli("--synthetic", "gemma4-31b", "--plan-only", "--gpu-memory", "24GiB", "--ctx-size", "262144")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --ctx-size 262144 needs")
    assert "the largest context that fits is" in lines[0]


@pytest.mark.parametrize("args, message", [
    (["--plan-only", "--gpu-memory", "24GiB"], "go with --synthetic"),
    (["--synthetic", "gemma4-31b", "--plan-only"], "--plan-only needs --gpu-memory"),
    (["--synthetic", "gemma4-31b", "--plan-only", "--gpu-memory", "lots"], "cannot read 'lots'"),
])
def test_bad_options_are_one_line(args, message) -> None:
    result = run_cli(*args)
    assert result.exit_code == 1 and message in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_benchmark_without_cuda_says_it_needs_one() -> None:
    result = run_cli("--synthetic", "gemma4-31b", "--quant", "Q4_0")
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "error: bench --synthetic needs a CUDA GPU (--plan-only --gpu-memory SIZE prints the memory plan without one)"
    ]


def test_report_writes_json_and_png(tmp_path) -> None:
    # the writer, on a result shaped like a run's (its figures are placeholders, not measurements)
    plan = synthetic_plan("Q4_0", 8192, None)
    result = SyntheticResult(
        model="gemma4-31b", quant="Q4_0", draft_quant="q4", device="placeholder", ctx_size=8192,
        copy_bandwidth_gb_s=1.0, weight_bytes=1, decode=[DecodeSpeed(1024, 2.0, 1.0, 1, 3.0, 0.5)],
        reference_context=1024, decode_ms=1.0, verify16_ms=1.0, verify16_over_decode=1.0, drafter_step_ms=1.0,
        drafter_step_ms_eager=1.0, append_context_ms=1.0, dflash_projected_tok_s={"4": 1.0, "6": 2.0, "8": 3.0},
        peak_memory_bytes=1, plan=plan.to_json(),
    )
    out = tmp_path / "synthetic.json"
    printed = synthetic.report(result, out, as_json=True)
    assert json.loads(printed) == json.loads(out.read_text())
    assert json.loads(printed)["plan"]["total_bytes"] == plan.total_bytes
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "decode at" in synthetic.report(result, out, as_json=False)
    result.streams = [synthetic.StreamsSpeed(1, 1024, "q8", 2.5, 2.5, 1.0, 4.0),
                      synthetic.StreamsSpeed(4, 1024, "q8", 9.0, 2.25, 3.6, 14.8)]
    assert ("4 streams at 1024, q8 KV:     9.0 tok/s together, 2.2 each, 3.60x one stream, roofline 14.8 (3.70x one)"
            in synthetic.report(result, out, as_json=False))


@pytest.mark.parametrize("layout", ["dense", "moe"])
def test_measurements_run_end_to_end_on_a_tiny_config(layout) -> None:
    # every step the GPU run takes (random packed target and quantized drafter, decode at two contexts,
    # verify, draft, append, roofline and projection arithmetic), at a tiny Gemma 4 (dense, or 26B-A4B's layout)
    # on the CPU; timings are not asserted
    from dflash_agent.engine.formats.drafter_config import DrafterConfig
    from tests.helpers.packed import tiny_family_config
    from tests.helpers.packed import tiny_gemma4_config as dense_config

    def tiny_gemma4_config():
        return dense_config() if layout == "dense" else tiny_family_config("moe")

    dconfig = DrafterConfig.from_dict(dict(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        intermediate_size=512, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
        block_size=16, dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 1]},
    ))
    result = synthetic.measure("tiny", tiny_gemma4_config(), dconfig, "Q4_K_M", 64, "q8", torch.device("cpu"),
                               iters=1, contexts=(32, 64), reference=64, copy_bytes=1 << 20)
    assert [d.context for d in result.decode] == [32, 64] and result.reference_context == 64
    assert result.weight_bytes == synthetic_weight_bytes(tiny_gemma4_config(), "Q4_K_M")
    config = tiny_gemma4_config()
    shapes = {name: tuple(t.shape) for name, t in GemmaModel(config).state_dict().items()}
    stacks = weight_bytes([(shapes[name], qtype) for name, qtype in quant_types(config, "Q4_K_M").items()
                           if qtype is not None and len(shapes[name]) == 3], torch.bfloat16)
    read = result.weight_bytes - stacks // 2  # a MoE token reads 2 of each layer's 4 experts
    for d in result.decode:
        assert read < d.bytes_per_token < read + 2**20 and d.tok_s > 0  # plus the KV: 0.1 MB
        assert d.roofline_fraction == pytest.approx(d.tok_s / d.roofline_tok_s)
    assert result.decode[1].bytes_per_token > result.decode[0].bytes_per_token  # more KV at 64 than at 32
    total_ms = result.drafter_step_ms + result.verify16_ms + result.append_context_ms
    assert result.dflash_projected_tok_s["6"] == pytest.approx(6e3 / total_ms)
    assert result.plan["ctx_size"] == 64 and not result.goals["peak <= 23 GiB"]
    # the slots: 1, 4 and 8 streams decoding together at the shortest context, against one stream with the same
    # KV cache (the default, then 8-bit)
    assert [(st.streams, st.context, st.kv_cache) for st in result.streams] == [
        (n, 32, kv) for kv in ("model", "q8") for n in (1, 4, 8)]
    one = {st.kv_cache: st for st in result.streams if st.streams == 1}
    assert one["model"].over_one_stream == one["q8"].over_one_stream == 1.0
    for st in result.streams:
        assert st.tok_s > 0 and st.per_stream_tok_s == pytest.approx(st.tok_s / st.streams)
        assert st.over_one_stream == pytest.approx(st.tok_s / one[st.kv_cache].tok_s)
        assert st.roofline_tok_s > result.decode[0].roofline_tok_s * (st.streams > 1)  # the weights read once
        assert st.verify16_ms > 0 and st.verify16_ms_eager > 0  # each stream's block in one step
    assert one["q8"].roofline_tok_s > one["model"].roofline_tok_s  # half the KV bytes
    assert "4 streams >= 3.5x one" in result.goals
