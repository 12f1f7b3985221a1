"""Logits of our decoder against transformers' Gemma 3 / Gemma 4 on tiny random checkpoints (float32)."""

from pathlib import Path

import pytest
import torch

from dflash_agent.engine.load.weights import build_model, open_checkpoint

transformers = pytest.importorskip("transformers")

VOCAB = 128
PROMPT_LEN = 21  # longer than the sliding window below


def _randomize(model: torch.nn.Module) -> None:
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
    """A tiny dense Gemma 4 (overrides: other fields, as test_gemma4_family's MoE layout sets)."""
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=8, final_logit_softcapping=3.0, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB, layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=256,
    )
    return transformers.Gemma4TextConfig(**(fields | overrides))


def save_reference(kind: str, path: Path):
    """kind: gemma3, gemma4, or a Gemma 4 family layout of tests/engine/test_gemma4_family.py (moe, ple)."""
    from tests.engine.test_gemma4_family import CONFIGS

    torch.manual_seed(1)
    if kind == "gemma3":
        ref = transformers.Gemma3ForCausalLM(gemma3_config())
    else:
        ref = transformers.Gemma4ForCausalLM(CONFIGS[kind]() if kind in CONFIGS else gemma4_config())
    _randomize(ref)
    ref.eval()
    ref.save_pretrained(path)
    return ref


@pytest.fixture(params=["gemma3", "gemma4", "moe", "ple"])
def pair(request, tmp_path):
    ref = save_reference(request.param, tmp_path)
    ours = build_model(open_checkpoint(tmp_path), "cpu", torch.float32, progress=False)
    return ref, ours


def test_prefill_logits_match(pair):
    ref, ours = pair
    ids = torch.randint(0, VOCAB, (PROMPT_LEN,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    cache = ours.new_cache(64)
    got = ours(ids, cache, logits_at=torch.arange(PROMPT_LEN)).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_decode_through_cache_past_window(pair):
    ref, ours = pair
    ids = torch.randint(0, VOCAB, (PROMPT_LEN + 14,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    cache = ours.new_cache(64)
    ours(ids[:5], cache)
    for t in range(5, ids.shape[0]):
        got = ours(ids[t : t + 1], cache).logits[0]
        torch.testing.assert_close(got, expected[t], atol=1e-4, rtol=0)


def test_rollback_and_block_verify(pair):
    """A 4-token block verified in one forward, rolled back, then continued, equals the plain sequence."""
    ref, ours = pair
    ids = torch.randint(0, VOCAB, (PROMPT_LEN + 12,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    cache = ours.new_cache(64)
    ours(ids[:PROMPT_LEN], cache)
    wrong = torch.randint(0, VOCAB, (4,))
    ours(wrong, cache, logits_at=torch.arange(4))
    cache.rollback(PROMPT_LEN)
    got = ours(ids[PROMPT_LEN:], cache, logits_at=torch.arange(12)).logits
    torch.testing.assert_close(got, expected[PROMPT_LEN:], atol=1e-4, rtol=0)


def test_capture_layer_outputs(pair):
    ref, ours = pair
    ids = torch.randint(0, VOCAB, (PROMPT_LEN,))
    with torch.no_grad():
        hidden = ref(ids[None], output_hidden_states=True).hidden_states
    out = ours(ids, ours.new_cache(64), capture=(0, 2))
    torch.testing.assert_close(out.captured[0], hidden[1][0], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.captured[2], hidden[3][0], atol=1e-4, rtol=0)
