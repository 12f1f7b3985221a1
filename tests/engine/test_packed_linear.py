"""PackedWeight: GGUF matrices kept in their blocks behave exactly like the dequantized-at-load model.

The CPU path of PackedWeight is the reference (dequantize, then F.linear), so a packed model on the CPU
must give bit-identical logits; tests/kernels/test_packed_model.py runs the same model through the
Triton kernels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_agent.engine.formats.quant import PackedTensor, dequantize
from dflash_agent.engine.load.weights import build_model
from dflash_agent.engine.model.gemma import Linear
from dflash_agent.engine.model.packed import PACKED_TYPES, PackedWeight
from tests.helpers.packed import T, pack, run_steps, tiny_family_config, tiny_packed_checkpoint


def test_packed_model_on_cpu_is_bit_identical() -> None:
    ckpt = tiny_packed_checkpoint()
    plain = build_model(ckpt, "cpu", torch.float32, progress=False)
    packed = build_model(ckpt, "cpu", torch.float32, progress=False, packed=True)
    assert isinstance(packed.embed_tokens.weight, PackedWeight)
    assert isinstance(packed.layers[0].mlp.down_proj.weight, PackedWeight)
    assert not isinstance(plain.layers[0].mlp.down_proj.weight, PackedWeight)
    assert {w.packed.qtype for w in packed.buffers() if isinstance(w, PackedWeight)} == PACKED_TYPES
    for a, b in zip(run_steps(plain), run_steps(packed), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["moe", "ple"])
def test_gemma4_family_packed_is_bit_identical(kind) -> None:
    """Expert stacks stay packed ([experts, out, in], each token reading its experts' blocks), as do the per-layer
    embedding table and projections: the logits are those of the model dequantized at load, bit for bit."""
    ckpt = tiny_packed_checkpoint(config=tiny_family_config(kind))
    plain = build_model(ckpt, "cpu", torch.float32, progress=False)
    packed = build_model(ckpt, "cpu", torch.float32, progress=False, packed=True)
    if kind == "moe":
        assert isinstance(packed.layers[0].experts.down_proj, PackedWeight)
        assert packed.layers[0].experts.down_proj.dim() == 3
    else:
        assert isinstance(packed.embed_tokens_per_layer.weight, PackedWeight)
    for a, b in zip(run_steps(plain), run_steps(packed), strict=True):
        assert torch.equal(a, b)


def test_matmul_weights_are_the_linears_and_the_head() -> None:
    """What choose_cuda_tiles times: every matrix a step multiplies by, not the per-layer embedding (PLE), which is
    only looked up."""
    model = build_model(tiny_packed_checkpoint(config=tiny_family_config("ple")), "cpu", torch.float32,
                        progress=False, packed=True)
    weights = {id(w) for w in model.matmul_weights()}
    linears = {id(m.weight) for m in model.modules() if isinstance(m, Linear)}
    assert weights == linears | {id(model.output_weight)} and len(model.matmul_weights()) == len(weights)
    assert id(model.embed_tokens_per_layer.weight) not in weights


def test_default_is_packed_only_on_cuda() -> None:
    model = build_model(tiny_packed_checkpoint(), "cpu", torch.float32, progress=False)
    assert not any(isinstance(b, PackedWeight) for b in model.buffers())


def test_packed_weight_ops() -> None:
    rng = np.random.default_rng(1)
    source = pack(rng.standard_normal((8, 64)).astype(np.float32), T.Q8_0, rng)
    w = PackedWeight(source, torch.bfloat16)
    ref = dequantize(source.raw, T.Q8_0, (8, 64)).to(torch.bfloat16)
    assert w.shape == (8, 64) and w.dtype == torch.bfloat16 and w.device.type == "cpu"
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(F.linear(x, w), F.linear(x, ref))
    ids = torch.tensor([[7, 0], [3, 3]])
    assert torch.equal(w[ids], ref[ids])
    assert "Q8_0" in repr(w)
    with pytest.raises(TypeError, match="only F.linear"):
        w.float()
    with pytest.raises(TypeError):
        _ = w + 1
    with pytest.raises(TypeError, match="row ids only"):
        _ = w[0]
    with pytest.raises(TypeError, match="no bias"):
        F.linear(x, w, torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="a packed weight needs a matrix"):
        PackedWeight(PackedTensor(torch.zeros(68, dtype=torch.uint8), T.Q8_0, (64,)), torch.float32)
