"""bench.random_gemma4: the family's bench models as llama.cpp's converter writes them, loaded by the engine in the
layout asked for."""

import pytest
import torch

from dflash_agent.bench.random_gemma4 import converter_script, write_random_gemma4
from dflash_agent.engine.load.weights import build_model, open_checkpoint

pytestmark = pytest.mark.skipif(converter_script() is None,
                                reason="no llama.cpp sources with convert_hf_to_gguf.py ($LLAMA_CPP_SRC)")


@pytest.mark.parametrize("layout", ["moe", "e2b"])
def test_each_layout_loads_as_that_member(layout, tmp_path):
    path = tmp_path / f"{layout}.gguf"
    write_random_gemma4(path, layout, hidden=256)
    model = build_model(open_checkpoint(path), "cpu", torch.float32, progress=False)
    config = model.config
    if layout == "moe":
        assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (32, 8, 128)
        assert config.num_layers == 6 and not config.per_layer_input
    else:
        assert config.moe is None and config.per_layer_input == 256 and config.num_layers == 12
        assert [s.kv_source is not None for s in config.layers] == [False] * 8 + [True] * 4
    logits = model(torch.arange(2, 40), model.new_cache(64)).logits
    assert logits.shape == (1, 128) and torch.isfinite(logits).all()
