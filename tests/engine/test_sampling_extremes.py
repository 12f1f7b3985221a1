"""Sampling parameters at the edges of float range (issue 32): a temperature or top_p that underflows float32
still gives a distribution, never the inf / nan that made `torch.multinomial` fail."""

import pytest
import torch

from dflash_agent.engine.decode.sampling import Sampler, SamplingParams

LOGITS = torch.tensor([1.0, 3.0, 2.0, float("-inf"), -5.0])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-320),  # subnormal: rounds to 0 in float32
    SamplingParams(temperature=1e-40),
    SamplingParams(temperature=1e-30),  # a normal float32
    SamplingParams(temperature=1.0, top_p=5e-324),
    SamplingParams(temperature=1e-30, top_p=1e-45, top_k=2, min_p=1.0),
], ids=["t-subnormal", "t-below-float32", "t-tiny", "top-p-subnormal", "all-extreme"])
def test_vanishing_temperature_or_top_p_picks_the_best_token(params):
    sampler = Sampler(params, argmax=lambda logits: int(logits.argmax()))
    assert [sampler(LOGITS) for _ in range(5)] == [1] * 5
    probs = sampler.probs(LOGITS)
    assert torch.isfinite(probs).all() and probs[1] == 1.0


def test_a_huge_temperature_is_near_uniform_over_the_allowed_tokens():
    probs = Sampler(SamplingParams(temperature=1e308)).probs(LOGITS)
    assert torch.isfinite(probs).all() and probs[3] == 0.0
    torch.testing.assert_close(probs[[0, 1, 2, 4]], torch.full((4,), 0.25))
