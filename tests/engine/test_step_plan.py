"""The typed step plans and the one layer loop they drive (GemmaModel.layers_forward).

A leading batch dimension (train.target's rows) runs each row exactly as the one-sequence forward does,
whichever attention mode that forward plans; plans whose fields contradict their mode are refused.
"""

from __future__ import annotations

import builtins

import pytest
import torch

from dflash_agent.engine.cache import kv_cache
from dflash_agent.engine.cache.kv_cache import KVCache, LayerKV
from dflash_agent.engine.load.weights import build_model
from dflash_agent.engine.model.drafter import DraftLayerPlan
from dflash_agent.engine.model.gemma import KeyPositions, LayerPlan, StepPlan
from dflash_agent.kernels.attention import cache_offsets
from tests.helpers.packed import VOCAB, tiny_packed_checkpoint


def test_plans_refuse_fields_their_mode_does_not_take() -> None:
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="kernel"):
        LayerPlan("kernel", pos)  # the kernel masks by positions
    with pytest.raises(ValueError, match="kernel"):
        LayerPlan("cache", pos, positions=KeyPositions(pos, None, None))
    cache = torch.zeros(8, 1, 4)
    with pytest.raises(ValueError, match="slots"):
        DraftLayerPlan("cache", cache, cache, query_positions=pos)


@pytest.mark.parametrize("T", [12, 20])  # a block the rings' slack covers ("cache"), and a longer one ("prefill")
def test_batched_rows_match_one_sequence_forwards(T: int) -> None:
    model = build_model(tiny_packed_checkpoint(), "cpu", torch.float32, progress=False)
    cfg, rows = model.config, 3
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (rows, T))
    kv = []
    for spec in cfg.layers:
        shape = (rows, T, spec.num_kv_heads, spec.head_dim)
        kv.append(LayerKV(torch.zeros(shape), torch.zeros(shape), spec.sliding))
    pos = torch.arange(T)
    causal = pos[None, :] <= pos[:, None]
    window = causal & (pos[:, None] - pos[None, :] < cfg.sliding_window)
    plan = StepPlan(pos, full=LayerPlan("cache", pos, T, causal), sliding=LayerPlan("cache", pos, T, window))
    with torch.inference_mode():
        hidden, captured = model.layers_forward(model.embed(ids), plan, kv, capture=(0,))
        batched = model.logits(hidden)
    assert hidden.shape == (rows, T, cfg.hidden_size)
    for r in range(rows):
        want = model(ids[r], model.new_cache(32), logits_at=torch.arange(T), capture=(0,))
        torch.testing.assert_close(batched[r], want.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(captured[0][r], want.captured[0], atol=1e-5, rtol=1e-5)


def test_long_chunks_over_a_wrapped_ring_match_short_steps(monkeypatch) -> None:
    """Chunks of BLOCKED_ROWS+ rows once the sliding ring has wrapped (the "prefill" plan: the ring read in position
    order, attention block by block over the keys each block sees) give the logits of steps of 8 rows (SDPA over
    the ring as stored), at every position."""
    from dflash_agent.kernels import attention

    blocked = []
    real = attention._blocked_attention
    monkeypatch.setattr(attention, "_blocked_attention", lambda *a: blocked.append(a[3].shape) or real(*a))
    model = build_model(tiny_packed_checkpoint(), "cpu", torch.float32, progress=False)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (3 * attention.BLOCKED_ROWS + 40,))

    def logits(step: int) -> torch.Tensor:
        cache, out = model.new_cache(len(ids)), []
        assert cache.ring_slots < len(ids)  # the ring wraps
        with torch.inference_mode():
            for at in range(0, len(ids), step):
                part = ids[at:at + step]
                out.append(model(part, cache, logits_at=torch.arange(len(part))).logits)
        return torch.cat(out)

    long = logits(attention.BLOCKED_ROWS + 17)
    assert len(blocked) >= 4  # both layers of every full-size chunk
    blocked.clear()
    torch.testing.assert_close(long, logits(8), atol=1e-4, rtol=1e-4)
    assert not blocked


@pytest.mark.parametrize("kv_dtype", ["model", "q8"])
def test_a_cache_finds_where_the_others_lie_once_per_list(kv_dtype: str, monkeypatch) -> None:
    """KVCache.offsets_of (the slots' joint attention, eager steps included): every layer's element offsets from this
    cache, as cache_offsets finds them; the same tensor for the same list again; found anew for a cache that took a
    freed one's id, and None for a cache laid out otherwise."""
    config = build_model(tiny_packed_checkpoint(), "meta", torch.float32, progress=False).config

    def found(caches: list[KVCache]) -> list:
        return [cache_offsets([c.layers[i].storage() for c in caches]) for i in range(config.num_layers)]

    first, second, third = (KVCache(config, 40, kv_dtype=kv_dtype) for _ in range(3))
    table = first.offsets_of([first, second, third])
    assert table is not None and table.shape == (config.num_layers, 3, 4)
    assert table.tolist() == found([first, second, third]) and table[:, 0].eq(0).all()
    assert first.offsets_of([first, second, third]) is table
    assert first.offsets_of([first, third, second]).tolist() == found([first, third, second])
    # a cache made after one is freed may take its id (CPython reuses the memory, but not for certain): made to,
    # it is found where its own tensors lie, not where the freed one's were
    freed = id(second)
    del second
    second = KVCache(config, 40, kv_dtype=kv_dtype)
    taken = {id(second): freed}
    monkeypatch.setattr(kv_cache, "id", lambda obj: taken.get(builtins.id(obj), builtins.id(obj)), raising=False)
    assert first.offsets_of([first, second, third]).tolist() == found([first, second, third])
    assert first.offsets_of([first, KVCache(config, 48, kv_dtype=kv_dtype)]) is None
