"""Logits of our decoder against transformers' Gemma 3 / Gemma 4 on tiny random checkpoints (float32)."""

import pytest
import torch

from dflash_agent.engine.load.weights import build_model, open_checkpoint
from tests.helpers.references import PROMPT_LEN, VOCAB, save_reference


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
