"""Tiny random transformers checkpoints to hold our model against: Gemma 3, dense Gemma 4, its 26B-A4B ("moe") and
E2B / E4B ("ple") layouts, and a Gemma 4 assistant (MTP drafter) for them (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 128
PROMPT_LEN = 21  # longer than the sliding window below


def randomize(model: torch.nn.Module) -> None:
    """Norm weights and layer scalars away from their identity init, so a wrong convention shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "gemma4" in type(model).__module__ else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)


def gemma3_config():
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}},
        max_position_embeddings=256,
    )


def gemma4_config(**overrides):
    """A tiny dense Gemma 4 (overrides: other fields, as the MoE layout sets)."""
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=8, final_logit_softcapping=3.0, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB, layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=256,
    )
    return transformers.Gemma4TextConfig(**(fields | overrides))


def moe_config():
    """26B-A4B's layout, shrunk: every layer a dense MLP plus 8 experts, 2 per token (widths multiples of 32, so the
    converter's Q8_0 file repacks whole for the C layers)."""
    return gemma4_config(intermediate_size=32, enable_moe_block=True, num_experts=8, top_k_experts=2,
                         moe_intermediate_size=32)


def ple_config():
    """E2B / E4B's layout, shrunk: per-layer inputs, the last 3 of 6 layers sharing K / V, their MLPs twice as wide."""
    return transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8, final_logit_softcapping=3.0,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=3,
        use_double_wide_mlp=True, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        max_position_embeddings=256,
    )


# the Gemma 4 family's layouts beside the dense one
CONFIGS = {"moe": moe_config, "ple": ple_config}


def save_reference(kind: str, path: Path):
    """kind: gemma3, gemma4, or a Gemma 4 family layout of CONFIGS (moe, ple)."""
    torch.manual_seed(1)
    if kind == "gemma3":
        ref = transformers.Gemma3ForCausalLM(gemma3_config())
    else:
        ref = transformers.Gemma4ForCausalLM(CONFIGS[kind]() if kind in CONFIGS else gemma4_config())
    randomize(ref)
    ref.eval()
    ref.save_pretrained(path)
    return ref


def assistant_config(kind: str):
    """An assistant for the tiny dense target ("gemma4": sliding layers of 2 K / V heads of 16, full ones of 1 of
    32) or for the E2B-like one ("ple": 1 head everywhere)."""
    full_kv = 1
    sliding_kv = 2 if kind == "gemma4" else 1
    text = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=sliding_kv, head_dim=16, global_head_dim=32, num_global_key_value_heads=full_kv,
        attention_k_eq_v=kind == "gemma4", sliding_window=8, final_logit_softcapping=3.0,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
    )
    return transformers.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, use_ordered_embeddings=True,
                                              num_centroids=8, centroid_intermediate_top_k=2)


def save_assistant(kind: str, path: Path):
    torch.manual_seed(11)
    ref = transformers.Gemma4AssistantForCausalLM(assistant_config(kind))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
        ref.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
        for layer in ref.model.layers:
            layer.layer_scalar.copy_(torch.rand(1) + 0.5)
    ref.eval()
    ref.save_pretrained(path)
    return ref
