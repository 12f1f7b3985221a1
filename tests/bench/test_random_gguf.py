"""bench.random_gguf: a Gemma 3 GGUF of random weights at a chosen shape, with the embedded model's tokenizer, that
this engine loads (and llama-quantize can then quantize, as README shows)."""

from __future__ import annotations

import torch

from dflash_agent.bench.random_gguf import Shape, write_random_gemma3
from dflash_agent.engine.load.tokenizer import Tokenizer
from dflash_agent.engine.load.weights import build_model, open_checkpoint


def test_a_random_gemma3_loads_at_its_shape(tmp_path):
    shape = Shape(hidden=256, layers=2, intermediate=512, heads=2, kv_heads=1, head_dim=128)
    path = tmp_path / "random.gguf"
    write_random_gemma3(path, shape)
    ckpt = open_checkpoint(path)
    config = ckpt.config
    assert (config.hidden_size, config.num_layers, config.num_heads) == (256, 2, 2)
    assert {(spec.num_kv_heads, spec.head_dim) for spec in config.layers} == {(1, 128)}
    tokenizer = Tokenizer.from_gguf(path, gguf=ckpt.gguf)
    ids = tokenizer.encode("def main():", add_bos=True)
    model = build_model(ckpt, "cpu", torch.float32, progress=False)
    with torch.inference_mode():
        logits = model(torch.tensor(ids), model.new_cache(32), logits_at=torch.arange(len(ids))).logits
    assert logits.shape == (len(ids), config.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0.1  # random weights, not zeros
