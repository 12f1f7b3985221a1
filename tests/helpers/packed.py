"""Tiny random Gemma 4 checkpoints in GGUF's packed types, one of each assigned to the matrices in turn, built
without a file (a Checkpoint of PackedTensors): the packed and repacked paths' fixtures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from dflash_agent.engine.formats.config import ModelConfig
from dflash_agent.engine.formats.quant import PackedTensor
from dflash_agent.engine.load.weights import Checkpoint
from dflash_agent.engine.model.gemma import GemmaModel
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


def run_steps(model: GemmaModel | StepRunner, cache_kind: str = "model") -> list[torch.Tensor]:
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
