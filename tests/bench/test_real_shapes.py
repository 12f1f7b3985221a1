"""bench.real_shapes: Gemma 4 GGUFs at the family's real shapes, written block by block. The real sizes are checked by
their byte counts against the published files; the writer itself on tiny configs, whose files our loader reads back
to the config they were written from (llama.cpp's converter holds the metadata: tests/engine/test_gemma4_family_gguf)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_agent.bench.real_shapes import SHAPES, SPECIAL_TOKENS, random_blocks, write_real_shape_gguf
from dflash_agent.bench.synthetic import synthetic_weight_bytes
from dflash_agent.engine.formats.quant import dequantize
from dflash_agent.engine.load.tokenizer import Tokenizer
from dflash_agent.engine.load.weights import build_model, open_checkpoint
from tests.helpers.packed import tiny_family_config, tiny_gemma4_config

GiB = 1 << 30
# Q4_0 files as llama.cpp loads them: E2B / E4B's as the house issue measured them (3.09 / 4.75 GiB), 26B-A4B's,
# and Google's QAT 31B (16.44 GiB)
PUBLISHED_Q4_0_GIB = {"gemma4-e2b": 3.09, "gemma4-e4b": 4.75, "gemma4-26b-a4b": 13.4, "gemma4-31b": 16.44}


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_the_family_at_its_published_sizes(model):
    size = synthetic_weight_bytes(SHAPES[model](), "Q4_0") / GiB
    assert abs(size - PUBLISHED_Q4_0_GIB[model]) < 0.01 * PUBLISHED_Q4_0_GIB[model], size


@pytest.mark.parametrize("kind", ["dense", "moe", "ple"])
@pytest.mark.parametrize("quant", ["Q4_0", "Q4_K_M"])
def test_a_written_file_loads_back_as_its_config_and_runs(kind, quant, tmp_path):
    config = tiny_gemma4_config() if kind == "dense" else tiny_family_config(kind)
    config = dataclasses.replace(config, vocab_size=128)  # room for Gemma 4's turn markers (105, 106)
    path = tmp_path / "model.gguf"
    seen = []
    write_real_shape_gguf(path, config, quant, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] and path.stat().st_size > seen[-1][1]
    ckpt = open_checkpoint(path)
    assert ckpt.config.rms_norm_eps == pytest.approx(config.rms_norm_eps)  # GGUF's float32
    assert dataclasses.replace(ckpt.config, rms_norm_eps=config.rms_norm_eps) == config
    tokenizer = Tokenizer.from_gguf(path, gguf=ckpt.gguf)
    assert tokenizer.token_id(SPECIAL_TOKENS[105]) == 105 and 106 in tokenizer.stop_ids  # Gemma 4's turn markers
    exact = build_model(ckpt, "cpu", torch.float32, progress=False)
    repacked = build_model(open_checkpoint(path), "cpu", torch.float32, progress=False, repack_cpu=True)
    ids = torch.tensor([2, 105, 7, 30, 61])
    with torch.no_grad():
        want = exact(ids, exact.new_cache(16), logits_at=torch.arange(5)).logits
        got = repacked(ids, repacked.new_cache(16), logits_at=torch.arange(5)).logits
    assert torch.isfinite(want).all() and float(want.std()) > 0.1  # unit-scale random weights, not zeros or NaNs
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)


def test_random_blocks_have_unit_scale_outputs():
    import numpy as np
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(0)
    x = torch.randn(8, 2048)
    for qtype in (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K):
        w = dequantize(torch.from_numpy(random_blocks(qtype, 256, 2048, rng)), qtype, (256, 2048))
        assert torch.isfinite(w).all()
        assert 0.3 < float((x @ w.T).std()) < 3.0, qtype.name


@pytest.mark.parametrize("model", ["gemma4-e2b", "gemma4-e4b"])
def test_kv_sharing_starts_after_a_sliding_then_a_full_layer(model):
    """llama.cpp's KV cache maps the sharing layers onto the last two layers before them, a sliding one and then a
    full one (llama-kv-cache.cpp asserts it): a layout where that does not hold would not load there."""
    layers = SHAPES[model]().layers
    first = next(i for i, spec in enumerate(layers) if spec.kv_source is not None)
    assert layers[first - 2].sliding and not layers[first - 1].sliding
