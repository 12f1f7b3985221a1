"""kernels.cpu_dot's LM-head screen (CpuDot.norm_head_argmax, cpu_layer.c): each row's pick is the one the whole head
gives (norm_linear, then argmax: the first largest logit), on the vector and the scalar build, for a Q8_0 head (its
own integers) and requantized ones, through outlier channels, exact ties and ties closer than the screen's bound."""

from __future__ import annotations

import pytest
import torch

from dflash_agent.kernels import cpu_dot

from .test_cpu_dot import LAYOUTS, _layout, each_build  # noqa: F401 (each_build is a fixture)

EPS = 1e-6


def _whole_head(lib, x, norm, matrix):
    return [lib.argmax(row) for row in lib.norm_linear(x, norm, EPS, matrix.struct())]


def _aligned(lib, matrix, norm, rows):
    """Activation rows whose normed values point along head rows `rows` (their logits the largest, or nearly)."""
    w = lib.dequantize(matrix, torch.tensor(rows))
    return w / norm * 10


@pytest.mark.parametrize("layout", ["s8 Q8_0", "u4 Q4_K", "u6 Q6_K", "s8 m"])
def test_the_screen_picks_what_the_whole_head_picks(each_build, layout):
    lib = each_build
    matrix, _ = _layout(*LAYOUTS[layout], n=1000, k=512)  # 1000 rows: the last pair of panels part padding
    duplicate = matrix._mapped(lambda t: torch.cat([t[:600], t[10:11], t[601:]]))  # row 600 = row 10: exact ties
    g = torch.Generator().manual_seed(3)
    norm = torch.rand(512, generator=g) * 2 + 0.5
    norm[7] = 60.0  # an outlier channel, as Gemma's final norms have
    x = torch.cat([torch.randn(40, 512, generator=g), torch.randn(8, 512, generator=g) * 1e-30,
                   _aligned(lib, duplicate, norm, [10, 600, 999, 0, 31, 32])])
    x[5:9, 100] = 500.0  # outlier activations
    screen = cpu_dot.HeadScreen.of(lib, duplicate)
    assert (screen.err is None) == (layout == "s8 Q8_0")  # Q8_0: its own integers, exactly
    picks = lib.norm_head_argmax(x, norm, EPS, duplicate.struct(), screen)
    whole = _whole_head(lib, x, norm, duplicate)
    assert all(p == w for p, w in zip(picks, whole, strict=True) if p is not None)
    assert sum(p is None for p in picks) <= 2, picks  # only rows whose logits crowd the bound fall back
    assert 600 not in picks and 600 not in whole  # a tie goes to the first, as argmax's
    if layout in ("s8 Q8_0", "u6 Q6_K"):  # no offsets: the aligned row's logit is the largest, tied
        assert whole[-6] == picks[-6] == 10


def test_near_ties_are_settled_by_the_exact_logits(each_build):
    """Head rows one integer apart: their logits differ by far less than the screen's bound, and the exact
    computation of the candidates decides."""
    lib = each_build
    values = torch.randint(-100, 100, (300, 256), generator=torch.Generator().manual_seed(5))
    for r in range(40, 104):
        values[r] = values[40]
        values[r, r % 256] += 1 if r % 2 else -1
    d = torch.full((300, 8), 1e-3).half()
    matrix = cpu_dot.IntMatrix.pack(values, d, None, 8, 32)
    norm = torch.ones(256)
    x = _aligned(lib, matrix, norm, list(range(40, 104))) + torch.randn(64, 256) * 1e-3
    picks = lib.norm_head_argmax(x, norm, EPS, matrix.struct(), cpu_dot.HeadScreen.of(lib, matrix))
    assert picks == _whole_head(lib, x, norm, matrix)
    assert all(40 <= p < 104 for p in picks)


def test_rows_the_screen_cannot_bound_are_left_to_the_whole_head(each_build):
    lib = each_build
    matrix, _ = _layout(*LAYOUTS["s8 Q8_0"], n=64, k=256)
    screen = cpu_dot.HeadScreen.of(lib, matrix)
    x = torch.randn(4, 256)
    x[1, 3], x[2, 9] = float("nan"), float("inf")
    x[3] = 0.0  # every logit 0: a tie of the whole vocabulary, past the candidates a row may have
    picks = lib.norm_head_argmax(x, torch.ones(256), EPS, matrix.struct(), screen)
    assert picks[0] == _whole_head(lib, x[:1], torch.ones(256), matrix)[0]
    assert picks[1] is None and picks[2] is None
    assert picks[3] in (None, 0)


def test_a_screen_of_another_head_is_refused(each_build):
    lib = each_build
    matrix, _ = _layout(*LAYOUTS["s8 Q8_0"], n=64, k=256)
    other, _ = _layout(*LAYOUTS["s8 Q8_0"], n=65, k=256)
    with pytest.raises(ValueError, match="a screen of"):
        lib.norm_head_argmax(torch.randn(2, 256), torch.ones(256), EPS, matrix.struct(),
                             cpu_dot.HeadScreen.of(lib, other))
