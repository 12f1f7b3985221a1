"""Sampling against transformers' logits warpers, and stop-string streaming."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dflash_agent.engine.decode.sampling import Sampler, SamplingParams, StopStringFilter


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.05),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02),
    ],
)
def test_distribution_matches_transformers_warpers(params):
    logits = torch.randn(3, 500) * 3
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    if params.min_p:
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    expected = torch.softmax(scores, dim=-1)
    got = Sampler(params).probs(logits)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_greedy_is_argmax():
    logits = torch.randn(1000)
    assert Sampler(SamplingParams())(logits) == int(logits.argmax())


def test_seed_reproduces_and_differs():
    logits = torch.randn(1000)

    def draw(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler(logits) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_samples_follow_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, -10.0])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = torch.bincount(torch.tensor([sampler(logits) for _ in range(4000)]), minlength=4).float()
    torch.testing.assert_close(counts / 4000, torch.softmax(logits, 0), atol=0.03, rtol=0)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2), dict(top_k=-1)])
def test_invalid_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_stop_string_split_across_pushes():
    f = StopStringFilter(("</end>", "STOP"))
    out = []
    for piece in ["hello </", "en", "d> never"]:
        text, hit = f.push(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "hello "
    assert hit == "</end>"


def test_stop_string_earliest_wins_and_false_prefix_released():
    f = StopStringFilter(("bb", "a b"))
    assert f.push("xa") == ("x", None)  # "a" may start "a b"
    assert f.push("c") == ("ac", None)  # it did not
    assert f.push("a bb") == ("", "a b")


def test_no_stop_strings_passes_everything():
    f = StopStringFilter(())
    assert f.push("abc") == ("abc", None)
    assert f.flush() == ""
