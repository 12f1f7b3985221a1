"""The memory plan: its figures against what the engine really allocates, and the context fitting rules."""

from __future__ import annotations

import logging

import pytest
import torch

from dflash_agent.bench.synthetic import build_synthetic_drafter, gemma4_31b_config, gemma4_31b_drafter_config
from dflash_agent.engine.formats.drafter_config import DrafterConfig
from dflash_agent.engine.limits import DEFAULT_SLACK, LOOKUP_SLACK
from dflash_agent.engine.load.weights import build_model
from dflash_agent.engine.memory_plan import (
    DrafterPlan,
    GiB,
    MemoryPlanError,
    checkpoint_weight_bytes,
    choose_kv_dtype,
    drafter_kv_bytes,
    drafter_weight_bytes,
    fit_context,
    largest_context,
    plan_memory,
    target_kv_bytes,
)
from dflash_agent.engine.model.packed import PackedWeight
from dflash_agent.kernels.dispatch import SPLIT_ROWS
from tests.helpers.packed import tiny_gemma4_config, tiny_packed_checkpoint


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_q8_kv_is_about_half() -> None:
    config = gemma4_31b_config()
    full, rings = target_kv_bytes(config, 32768, "model", torch.bfloat16, values_only=False)
    full_q8, rings_q8 = target_kv_bytes(config, 32768, "q8", torch.bfloat16)
    assert 0.5 < full_q8 / full < 0.6 and 0.5 < rings_q8 / rings < 0.6
    # an 8-bit cache keeps its keys: in bf16 the full layers keeping V alone take about what 8 bits do
    assert 0.9 < full_q8 / target_kv_bytes(config, 32768, "model", torch.bfloat16)[0] < 1.1


def test_drafter_kv_is_the_caches() -> None:
    drafter = gemma4_31b_drafter_config()
    # slots of 8 KV heads x 128 (K and V, bf16): max_len in the full layer, window + slack in the four sliding ones
    # (the slack: prompt lookup's longest rollback), and their shared int64 slot -> position map
    slot = 2 * 8 * 128 * 2
    ring = 2048 + LOOKUP_SLACK
    assert drafter_kv_bytes(drafter, 32768, torch.bfloat16) == 32768 * slot + 4 * ring * slot + ring * 8


@pytest.mark.parametrize("quant", [None, "q8", "q4"])
def test_drafter_weight_figure_is_what_quantization_keeps(quant) -> None:
    config = DrafterConfig.from_dict(dict(
        hidden_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=200, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
        block_size=4, dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 2, 3]},
    ))
    drafter = build_synthetic_drafter(config, 96, quant, torch.device("cpu"), torch.bfloat16)
    kept = _nbytes(b for b in drafter.buffers() if b is not drafter.inv_freq) + _nbytes(drafter.parameters())
    assert drafter_weight_bytes(DrafterPlan(config, quant), 96, torch.bfloat16) == kept


def test_target_weight_figure_is_what_the_model_keeps() -> None:
    ckpt = tiny_packed_checkpoint()
    model = build_model(ckpt, "cpu", torch.bfloat16, progress=False, packed=True)
    kept = sum(b.packed.nbytes if isinstance(b, PackedWeight) else b.numel() * b.element_size()
               for b in model.buffers())
    assert checkpoint_weight_bytes(ckpt.tensors, torch.bfloat16, packed=True) == kept
    dense = build_model(ckpt, "cpu", torch.bfloat16, progress=False)
    assert checkpoint_weight_bytes(ckpt.tensors, torch.bfloat16, packed=False) == _nbytes(dense.buffers())


def test_31b_kv_matches_the_fact_sheet() -> None:
    # shared/reference/gemma4.md 3.3: full layers 80 KiB / token in bf16 (2.5 GiB at 32K); sliding layers
    # 16 KiB / token / layer over 50 layers, held for window + slack slots
    # sliding layers 16 KiB / token / layer over 50 layers, held for window + slack slots; where the full layers
    # keep V alone (attention_k_eq_v: GemmaModel.new_cache), half the 80 KiB
    config = gemma4_31b_config()
    full, rings = target_kv_bytes(config, 32768, "model", torch.bfloat16, values_only=False)
    assert full == 32768 * 80 * 1024 == int(2.5 * GiB)
    assert rings == (1024 + 16) * 50 * 16384 + (1024 + 16) * 8  # + the int64 slot -> position map
    assert target_kv_bytes(config, 32768, "model", torch.bfloat16) == (full // 2, rings)


def test_plan_itemises_and_totals() -> None:
    config = gemma4_31b_config()
    plan = plan_memory(config, 10 * GiB, 4096, drafter=DrafterPlan(gemma4_31b_drafter_config(), "q8"),
                       budget_bytes=24 * GiB)
    assert plan.total_bytes == sum(plan.items.values())
    assert {"target weights", "drafter weights", "target KV: full-attention layers", "target KV: sliding rings",
            "drafter KV"} <= set(plan.items)
    assert any(k.startswith("workspace") for k in plan.items)
    data = plan.to_json()
    assert data["total_bytes"] == plan.total_bytes and data["fits"] and data["ctx_size"] == 4096
    assert "total" in plan.describe() and "fits" in plan.describe()
    with pytest.raises(ValueError, match="positive"):
        plan_memory(config, GiB, 0)


def test_step_graphs_captured_features_are_planned() -> None:
    """Each CUDA step graph keeps its rows' captured target layers (the drafter's features): 31 rows a slot for its
    own buckets (1, 2, 4, 8, 16), and 32 graphs of several slots' blocks."""
    config, dconfig = gemma4_31b_config(), gemma4_31b_drafter_config()
    row = len(dconfig.target_layer_ids) * config.hidden_size * 2
    key = "workspace: step graphs' captured features"
    one = plan_memory(config, 10 * GiB, 4096, drafter=DrafterPlan(dconfig, "q8"))
    four = plan_memory(config, 10 * GiB, 4096, drafter=DrafterPlan(dconfig, "q8"), slots=4)
    assert one.items[key] == 31 * row and four.items[key] == (4 * 31 + 32 * 4 * 16) * row
    assert key not in plan_memory(config, 10 * GiB, 4096, slots=4).items


@pytest.mark.parametrize("ctx", [1024, 32768])
def test_attention_partials_hold_what_a_verify_step_allocates(ctx) -> None:
    """The attention kernel's float32 partials (kernels.triton.attention_triton) for a verified block over each layer kind's
    cache: a ring's shorter chunks are the most at a short context, the full layers' at a long one."""
    from dflash_agent.kernels.triton.attention_triton import cache_attention_launch

    config, meta = gemma4_31b_config(), torch.device("meta")
    planned = plan_memory(config, 10 * GiB, ctx).items["workspace: attention partials"]
    for spec in {(s.sliding, s.head_dim, s.num_kv_heads): s for s in config.layers}.values():
        slots = min(ctx, config.sliding_window + DEFAULT_SLACK) if spec.sliding else ctx
        q = torch.empty(SPLIT_ROWS, config.num_heads, spec.head_dim, device=meta)
        kv = torch.empty(slots, spec.num_kv_heads, spec.head_dim, device=meta)
        k_pos = torch.empty(slots, dtype=torch.long, device=meta) if spec.sliding else None
        launch = cache_attention_launch(q, kv, kv, q[:, 0, 0].long(), k_pos, config.sliding_window, 1.0).launch
        partial, lse = launch.args[9:11]
        assert partial.nbytes + lse.nbytes <= planned, (spec.sliding, ctx)


def test_fit_context_picks_the_largest_and_refuses_what_does_not_fit() -> None:
    config = gemma4_31b_config()
    weights = 16 * GiB
    drafter = DrafterPlan(gemma4_31b_drafter_config(), "q4")
    budget = 22 * GiB
    largest = largest_context(budget, config, weights, drafter=drafter)
    assert 8192 < largest < config.max_position_embeddings
    assert plan_memory(config, weights, largest, drafter=drafter, budget_bytes=budget).fits
    assert not plan_memory(config, weights, largest + 1, drafter=drafter, budget_bytes=budget).fits
    assert fit_context(budget, config, weights, drafter=drafter).ctx_size == largest
    assert fit_context(budget, config, weights, requested=8192, drafter=drafter).ctx_size == 8192
    with pytest.raises(MemoryPlanError, match=rf"--ctx-size {largest + 1} needs .* the largest context that fits "
                                              rf"is {largest} tokens"):
        fit_context(budget, config, weights, requested=largest + 1, drafter=drafter)
    with pytest.raises(MemoryPlanError, match="the model does not fit"):
        fit_context(8 * GiB, config, weights)
    with pytest.raises(MemoryPlanError, match="no context fits"):
        fit_context(8 * GiB, config, weights, requested=1024)


def test_auto_kv_is_the_models_while_the_context_fits_else_8_bit(caplog) -> None:
    """kv_dtype "auto": the model's dtype where the asked context (without one, the model's whole) fits; else 8-bit
    where that fits the asked one or holds more, said in the log; a request that fits neither is refused naming the
    largest 8-bit context; a named dtype is kept as named."""
    config = gemma4_31b_config()
    weights = 16 * GiB
    drafter = DrafterPlan(gemma4_31b_drafter_config(), "q4")
    budget = 22 * GiB
    in_model = largest_context(budget, config, weights, drafter=drafter)
    in_q8 = largest_context(budget, config, weights, drafter=drafter, kv_dtype="q8")
    assert in_model < in_q8 < config.max_position_embeddings
    args = (budget, config, weights)
    kv, plan = choose_kv_dtype(*args, 8192, "auto", drafter=drafter)
    assert (kv, plan.ctx_size) == ("model", 8192)
    with caplog.at_level(logging.INFO, logger="dflash_agent.engine.memory_plan"):
        kv, plan = choose_kv_dtype(*args, in_model + 1, "auto", drafter=drafter)
    assert (kv, plan.ctx_size) == ("q8", in_model + 1) and plan.fits
    assert f"8-bit KV cache: a {in_model + 1}-token context in the model's dtype needs" in caplog.text
    kv, plan = choose_kv_dtype(*args, None, "auto", drafter=drafter)
    assert (kv, plan.ctx_size) == ("q8", in_q8)
    with pytest.raises(MemoryPlanError, match=rf"the largest context that fits is {in_q8} tokens"):
        choose_kv_dtype(*args, in_q8 + 1, "auto", drafter=drafter)
    with pytest.raises(MemoryPlanError, match=rf"the largest context that fits is {in_model} tokens"):
        choose_kv_dtype(*args, in_model + 1, "model", drafter=drafter)
    assert choose_kv_dtype(*args, None, "model", drafter=drafter)[1].ctx_size == in_model
    small = tiny_gemma4_config()  # its whole context fits in its own dtype
    assert choose_kv_dtype(8 * GiB, small, 10 << 20, None, "auto")[0] == "model"


def test_small_model_gets_its_whole_context() -> None:
    config = tiny_gemma4_config()
    plan = fit_context(8 * GiB, config, 10 << 20)
    assert plan.ctx_size == config.max_position_embeddings


def test_gpu_context_size_from_free_memory(monkeypatch, tmp_path) -> None:
    # the engine's CUDA path, with the device's free memory stood in for (no GPU here)
    from dflash_agent.engine.memory_plan import drafter_plan, gpu_context_size
    from dflash_agent.engine.model.drafter import DrafterError, init_drafter_checkpoint

    ckpt = tiny_packed_checkpoint()
    config = ckpt.config
    drafter = drafter_plan(init_drafter_checkpoint(tmp_path / "d", config.hidden_size, 60, mask_token_id=1), "q8")
    weights = checkpoint_weight_bytes(ckpt.tensors, torch.bfloat16, packed=True)
    free = plan_memory(config, weights, 100, drafter=drafter).total_bytes  # exactly a 100-token context
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    args = (config, ckpt.tensors, torch.device("cuda"), torch.bfloat16)
    assert gpu_context_size(*args, None, "model", drafter=drafter) == (100, "model")
    assert gpu_context_size(*args, 64, "model", drafter=drafter) == (64, "model")
    with pytest.raises(MemoryPlanError, match="--ctx-size 200 needs .* the largest context that fits is 100 tokens"):
        gpu_context_size(*args, 200, "model", drafter=drafter)
    # the default: the model's dtype where the asked context fits, 8 bits where it takes them
    assert gpu_context_size(*args, 64, "auto", drafter=drafter) == (64, "model")
    assert gpu_context_size(*args, 101, "auto", drafter=drafter) == (101, "q8")
    n_ctx, kv = gpu_context_size(*args, None, "auto", drafter=drafter)
    assert kv == "q8" and 101 <= n_ctx < config.max_position_embeddings
    with pytest.raises(DrafterError, match="cannot read the drafter config"):
        drafter_plan(tmp_path / "nowhere", None)


def test_cpu_context_size_from_available_ram(caplog) -> None:
    """Without --ctx-size the CPU engine takes the model's context where the weights and half the RAM beside them hold
    it, else the largest that does (at least 4096 tokens where they fit), with a warning; a requested size is kept,
    capped by the model, where it fits; what does not fit is refused with what does, never loaded to be killed."""
    import dataclasses

    from dflash_agent.engine.memory_plan import CPU_RESERVE, CPU_SHARE, cpu_context_size

    ckpt = tiny_packed_checkpoint()
    config = dataclasses.replace(ckpt.config, max_position_embeddings=32768)
    weights = checkpoint_weight_bytes(ckpt.tensors, torch.float32, packed=False)
    args = (config, ckpt.tensors, torch.float32)
    assert cpu_context_size(*args, None, available_bytes=64 * GiB) == 32768
    # the CPU plans its caches with K beside V, as the C layers read them
    total = plan_memory(config, weights, 10000, dtype=torch.float32, values_only=False).total_bytes
    ram = CPU_RESERVE + weights + int((total - weights) / CPU_SHARE) + 1
    with caplog.at_level(logging.WARNING, logger="dflash_agent.engine.memory_plan"):
        assert 9900 <= cpu_context_size(*args, None, available_bytes=ram) <= 10000
    assert "not the model's 32768" in caplog.text and "--ctx-size sets it" in caplog.text
    assert "coding agents need about 32768" in caplog.text
    assert cpu_context_size(*args, 2048, available_bytes=64 * GiB) == 2048
    assert cpu_context_size(*args, 99999, available_bytes=64 * GiB) == 32768
    tight = CPU_RESERVE + plan_memory(config, weights, 3000, dtype=torch.float32, values_only=False).total_bytes
    assert 2900 <= cpu_context_size(*args, None, available_bytes=tight) <= 3000  # under 4096: what fits
    with pytest.raises(MemoryPlanError, match=r"--ctx-size 20000 needs .* GiB of RAM available .* the largest "
                                              r"context that fits is \d+ tokens"):
        cpu_context_size(*args, 20000, available_bytes=tight)
    with pytest.raises(MemoryPlanError, match="the model does not fit: it needs .* GiB with a 1-token context"):
        cpu_context_size(*args, None, available_bytes=CPU_RESERVE + (1 << 20))


def test_slots_each_have_a_context_and_the_plan_refuses_what_does_not_fit() -> None:
    """--parallel N: N contexts of --ctx-size tokens (target and drafter KV), the weights once; a request that does
    not fit names the largest context per slot."""
    config, drafter = gemma4_31b_config(), DrafterPlan(gemma4_31b_drafter_config(), "q8")
    weights = 16 * GiB
    one = plan_memory(config, weights, 8192, drafter=drafter)
    four = plan_memory(config, weights, 8192, drafter=drafter, slots=4)
    kv = [k for k in one.items if "KV" in k]
    assert all(four.items[k] == 4 * one.items[k] for k in kv)
    assert four.items["target weights"] == one.items["target weights"] and four.slots == 4
    assert "4 slots x a 8192-token context" in four.describe() and four.to_json()["slots"] == 4
    budget = 23 * GiB
    largest = fit_context(budget, config, weights, drafter=drafter, slots=4).ctx_size
    assert largest < fit_context(budget, config, weights, drafter=drafter).ctx_size
    assert plan_memory(config, weights, largest, drafter=drafter, slots=4, budget_bytes=budget).fits
    with pytest.raises(MemoryPlanError, match=rf"x 4 slots .* the largest context that fits is {largest} tokens per "
                                              r"slot"):
        fit_context(budget, config, weights, requested=largest + 1, drafter=drafter, slots=4)
