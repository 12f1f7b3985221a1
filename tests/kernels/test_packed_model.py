"""The CUDA code path of the model, run on the CPU through Triton's interpreter: packed GGUF weights through
kernels.quant_matmul and attention through kernels.attention (model.Attention's kernel dispatch, by
positions), against the plain CPU model (dequantized weights, SDPA with masks)."""

from __future__ import annotations

import pytest
import torch

from dflash_agent.engine.weights import build_model
from dflash_agent.kernels.dispatch import CPU_KERNELS_ENV
from tests.engine.test_packed_linear import run_steps, tiny_family_config, tiny_packed_checkpoint


@pytest.mark.parametrize("cache_kind", ["auto", "q8"])
def test_kernel_path_matches_cpu_model(kernels, cache_kind) -> None:
    ckpt = tiny_packed_checkpoint()
    packed = build_model(ckpt, kernels.device, torch.float32, progress=False, packed=True)
    kernel_logits = [logits.cpu() for logits in run_steps(packed, cache_kind)]
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(CPU_KERNELS_ENV, raising=False)  # the reference: the engine's own CPU path
        plain = build_model(ckpt, "cpu", torch.float32, progress=False)
        expected = run_steps(plain, cache_kind)
    for got, want in zip(kernel_logits, expected, strict=True):
        # float32 throughout; only the order of the sums differs (the q8 cache is the same int8 either way)
        torch.testing.assert_close(got, want, atol=2e-5 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("kind", ["moe", "ple"])
def test_gemma4_family_on_the_kernel_path(kernels, kind) -> None:
    """26B-A4B's experts (two grouped launches a layer: decode steps' GEMV rows, longer steps' tiles by expert) and
    E2B / E4B's per-layer inputs and shared KV on the kernel path, against the plain CPU model."""
    ckpt = tiny_packed_checkpoint(config=tiny_family_config(kind))
    packed = build_model(ckpt, kernels.device, torch.float32, progress=False, packed=True)
    qm, grouped = kernels.load("quant_matmul"), []
    launch = qm.grouped_quant_matmul
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qm, "grouped_quant_matmul", lambda *a: grouped.append(a[-1]) or launch(*a))
        kernel_logits = [logits.cpu() for logits in run_steps(packed)]
    # run_steps: a prefill, a decode step, a verify block and another decode step, over 2 MoE layers
    assert grouped == ([False] * 4 + [True] * 4 + [False] * 4 + [True] * 4 if kind == "moe" else [])
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(CPU_KERNELS_ENV, raising=False)
        plain = build_model(ckpt, "cpu", torch.float32, progress=False)
        expected = run_steps(plain)
    for got, want in zip(kernel_logits, expected, strict=True):
        # a token's FFN sums the dense MLP's and its experts' outputs, each in the kernels' own order
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)
