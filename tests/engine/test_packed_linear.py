"""PackedWeight: GGUF matrices kept in their blocks behave exactly like the dequantized-at-load model.

The CPU path of PackedWeight is the reference (dequantize, then F.linear), so a packed model on the CPU
must give bit-identical logits; tests/kernels/test_packed_model.py runs the same model through the
Triton kernels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from dflash_agent.engine.formats.config import ModelConfig
from dflash_agent.engine.formats.quant import PackedTensor, dequantize
from dflash_agent.engine.load.weights import Checkpoint, build_model
from dflash_agent.engine.model.gemma import GemmaModel, Linear
from dflash_agent.engine.model.packed import PACKED_TYPES, PackedWeight
from dflash_agent.engine.runner import StepRunner

T = GGMLQuantizationType
VOCAB = 96
# one of each packed type, assigned to the matrices in turn
TYPES = [T.Q4_0, T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0, T.Q5_K]


def tiny_gemma4_config() -> ModelConfig:
    """Gemma 4's structure at K-quant-friendly widths: every matrix's input width is a multiple of 256."""
    return ModelConfig.from_hf_dict(dict(
        model_type="gemma4_text", vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8, final_logit_softcapping=30.0,
        rms_norm_eps=1e-6, hidden_size_per_layer_input=0, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
    ))


def tiny_family_config(kind: str) -> ModelConfig:
    """tiny_gemma4_config's widths with 26B-A4B's routed experts ("moe") or E2B / E4B's per-layer inputs and
    KV shared by the last two of four layers ("ple")."""
    if kind == "moe":  # two layers of 4 experts, 2 a token: each chosen expert is a kernel launch of its own
        extra = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=256,
                     hidden_size_per_layer_input=0, num_hidden_layers=2)
    else:
        extra = dict(hidden_size_per_layer_input=256, num_kv_shared_layers=2, use_double_wide_mlp=True,
                     num_hidden_layers=4)
    layers = ["sliding_attention", "full_attention"] * (extra["num_hidden_layers"] // 2)
    return ModelConfig.from_hf_dict(dict(
        model_type="gemma4_text", vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=8, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
        max_position_embeddings=256, layer_types=layers, **extra,
    ))


def pack(values: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> PackedTensor:
    """gguf-py's quantizer where it has one; K-quants (which gguf-py only dequantizes) get random blocks
    with small scales, which are as good a test of the unpacking."""
    shape = values.shape
    if qtype in (T.Q4_0, T.Q5_0, T.Q8_0):
        raw = gq.quantize(values, qtype)
    else:
        block, type_size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(values.size // block, type_size), dtype=np.uint8)
        fields = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]
        for off in fields:
            scales = (rng.standard_normal(raw.shape[0]) * 2.0**-9).astype(np.float16)
            raw[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return PackedTensor(torch.from_numpy(np.ascontiguousarray(raw).reshape(-1)), qtype, shape)


def tiny_packed_checkpoint(seed: int = 0, config: ModelConfig | None = None) -> Checkpoint:
    config = config or tiny_gemma4_config()
    rng = np.random.default_rng(seed)
    shapes = {name: tuple(t.shape) for name, t in GemmaModel(config).state_dict().items()}
    tensors: dict[str, torch.Tensor | PackedTensor] = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        if len(shape) in (2, 3):  # matrices, and the stacks of a MoE layer's experts
            tensors[name] = pack(rng.standard_normal(shape).astype(np.float32) * 0.05, TYPES[i % len(TYPES)], rng)
        elif name.endswith("layer_scalar"):
            tensors[name] = torch.tensor([0.8])
        else:
            tensors[name] = torch.from_numpy(1.0 + 0.2 * rng.standard_normal(shape).astype(np.float32))
    return Checkpoint(Path("tiny-packed.gguf"), "gguf", config, tensors)


def run_steps(model: GemmaModel | StepRunner, cache_kind: str = "auto") -> list[torch.Tensor]:
    """Prefill past the sliding window, a decode step, a verify block, a rollback and another decode."""
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (30,)).to(model.device)
    cache = model.new_cache(64, kv_dtype=cache_kind)

    def rows(n: int) -> torch.Tensor:
        return torch.arange(n, device=model.device)

    out = [model.forward(ids[:13], cache, logits_at=rows(13)).logits]
    out.append(model.forward(ids[13:14], cache).logits)
    out.append(model.forward(ids[14:19], cache, logits_at=rows(5)).logits)
    cache.rollback(16)
    out.append(model.forward(ids[19:20], cache).logits)
    return out


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
