"""GGUF's names for a Gemma decoder's tensors and config, mapped to ours (the HF names GemmaModel uses)."""

from __future__ import annotations

import re

import numpy as np

from .config import ModelConfig
from .gguf import GGUFFile

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "post_ffw_norm": "post_feedforward_layernorm.weight",
    "layer_output_scale": "layer_scalar",
    # Gemma 4 26B-A4B: the router and the routed experts beside the dense MLP
    "ffn_gate_inp": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_down_exps": "experts.down_proj",
    "post_ffw_norm_1": "post_feedforward_layernorm_1.weight",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_2": "post_feedforward_layernorm_2.weight",
    # Gemma 4 E2B / E4B: each layer's gated per-layer input
    "inp_gate": "per_layer_input_gate.weight",
    "proj": "per_layer_projection.weight",
    "post_norm": "post_per_layer_input_norm.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "per_layer_projection_norm.weight",
}


def gguf_tensor_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|scale)", name)
    if m is None:
        return None
    key = m.group(2) if m.group(3) == "weight" else f"{m.group(2)}.scale"
    return f"layers.{m.group(1)}.{_GGUF_LAYER_NAMES[key]}" if key in _GGUF_LAYER_NAMES else None


_OUR_GLOBAL_NAMES = {v: k for k, v in _GGUF_GLOBAL_NAMES.items()}
_OUR_LAYER_NAMES = {v: k for k, v in _GGUF_LAYER_NAMES.items()}


def gguf_name(ours: str) -> str:
    """The GGUF name of our parameter `ours` (gguf_tensor_name's inverse), as llama.cpp's converter writes it."""
    if ours in _OUR_GLOBAL_NAMES:
        return _OUR_GLOBAL_NAMES[ours]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", ours)
    layer = _OUR_LAYER_NAMES.get(m.group(2)) if m else None
    if layer is None:
        raise KeyError(f"no GGUF name for {ours!r}")
    if layer.endswith(".scale"):
        return f"blk.{m.group(1)}.{layer}"
    return f"blk.{m.group(1)}.{layer}.weight"


def gguf_model_config(gguf: GGUFFile, fields: dict) -> ModelConfig:
    """The decoder a GGUF describes, from its metadata `fields` (gguf.fields, or a rewrite of them) and tensors:
    the vocabulary from the embedding where the metadata omits it, Gemma 4's rope_freqs folded in."""
    if "token_embd.weight" in gguf.tensors:
        arch = fields.get("general.architecture")
        fields.setdefault(f"{arch}.vocab_size", gguf.tensors["token_embd.weight"].shape[0])
    rope_freqs = gguf.tensors.get("rope_freqs.weight")
    return ModelConfig.from_gguf_fields(
        fields,
        set(gguf.tensors),
        rope_freqs=rope_freqs.data.view(np.float32).tolist() if rope_freqs is not None else None,
        source=str(gguf.path),
    )
