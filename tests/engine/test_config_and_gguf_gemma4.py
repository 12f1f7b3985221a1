"""ModelConfig errors, and a Gemma 4 written as GGUF the way llama.cpp lays it out, against transformers."""

import json

import gguf
import numpy as np
import pytest
import torch

from dflash_agent.engine.formats.config import ConfigError, ModelConfig
from dflash_agent.engine.load.weights import ModelLoadError, build_model, open_checkpoint, resolve_model_path
from tests.helpers.references import VOCAB, save_reference

GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
    "post_attention_layernorm.weight": "post_attention_norm", "pre_feedforward_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
    "post_feedforward_layernorm.weight": "post_ffw_norm", "layer_scalar": "layer_output_scale",
}


def write_gemma4_gguf(ref, path):
    cfg = ref.config
    full = [t == "full_attention" for t in cfg.layer_types]
    head_dim, global_dim = 16, 32  # as in tests/helpers/references.gemma4_config
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([1 if f else 2 for f in full])
    w.add_key_length(global_dim)
    w.add_value_length(global_dim)
    w.add_uint32("gemma4.attention.key_length_swa", head_dim)
    w.add_uint32("gemma4.attention.value_length_swa", head_dim)
    w.add_float32("gemma4.rope.freq_base", 1_000_000.0)
    w.add_float32("gemma4.rope.freq_base_swa", 10_000.0)
    w.add_sliding_window(cfg.sliding_window)
    w.add_array("gemma4.attention.sliding_window_pattern", [not f for f in full])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_float32("gemma4.final_logit_softcapping", cfg.final_logit_softcapping)
    w.add_context_length(cfg.max_position_embeddings)
    angles = int(0.25 * global_dim // 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * angles + [1e30] * (global_dim // 2 - angles), np.float32))
    for name, tensor in ref.state_dict().items():
        name = name.removeprefix("model.")
        data = tensor.float().numpy()
        if name == "embed_tokens.weight":
            w.add_tensor("token_embd.weight", data)
        elif name == "norm.weight":
            w.add_tensor("output_norm.weight", data)
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            w.add_tensor(f"blk.{i}.{GGUF_LAYER[rest]}.weight", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gemma4_gguf_matches_transformers(tmp_path):
    ref = save_reference("gemma4", tmp_path / "hf")
    path = tmp_path / "tiny-gemma4.gguf"
    write_gemma4_gguf(ref, path)
    ckpt = open_checkpoint(path)
    full = [spec for spec in ckpt.config.layers if not spec.sliding]
    assert all(spec.k_eq_v and spec.rope_angles == 4 and spec.head_dim == 32 for spec in full)
    ours = build_model(ckpt, "cpu", torch.float32, progress=False)
    ids = torch.randint(0, VOCAB, (21,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    got = ours(ids, ours.new_cache(64), logits_at=torch.arange(21)).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_hf_configs_agree_old_and_new_format():
    """Google's config.json spells the full-layer shape as global_head_dim; newer transformers as per_layer_config."""
    base = dict(model_type="gemma4_text", vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, head_dim=8, sliding_window=4, rms_norm_eps=1e-6,
                layer_types=["sliding_attention", "full_attention"], attention_k_eq_v=True)
    old = ModelConfig.from_hf_dict(base | dict(global_head_dim=16, num_global_key_value_heads=1))
    new = ModelConfig.from_hf_dict(base | dict(per_layer_config={"1": {"head_dim": 16, "num_key_value_heads": 1}}))
    assert old == new
    assert old.layers[1].head_dim == 16 and old.layers[1].num_kv_heads == 1 and old.layers[1].k_eq_v
    assert old.layers[1].rope_angles == 2  # proportional, partial factor 0.25 by default


def test_multimodal_wrapper_reads_text_config():
    text = dict(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, sliding_window=4, rms_norm_eps=1e-6, query_pre_attn_scalar=8)
    cfg = ModelConfig.from_hf_dict({"model_type": "gemma3", "text_config": text})
    assert cfg.family == "gemma3" and cfg.norm_offset == 1.0 and cfg.attn_scale == 8**-0.5


def test_unknown_architecture_is_named():
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        ModelConfig.from_hf_dict({"model_type": "llama"})


def test_missing_key_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "hidden_size": 16}))
    with pytest.raises(ConfigError, match="missing required key 'num_hidden_layers'"):
        ModelConfig.from_hf_dir(tmp_path)


def test_kv_sharing_needs_an_owner_of_each_kind():
    base = dict(model_type="gemma4_text", vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=4, rms_norm_eps=1e-6,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    with pytest.raises(ConfigError, match="layer 2 shares the K / V of a full layer"):
        ModelConfig.from_hf_dict(base | {"num_kv_shared_layers": 1})
    with pytest.raises(ConfigError, match="leave no layer that owns"):
        ModelConfig.from_hf_dict(base | {"num_kv_shared_layers": 3})


def test_directory_without_weights(tmp_path):
    ref = save_reference("gemma3", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    del ref
    with pytest.raises(ModelLoadError, match="neither model.safetensors"):
        open_checkpoint(tmp_path)


def test_not_a_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="without config.json"):
        resolve_model_path(str(tmp_path))
