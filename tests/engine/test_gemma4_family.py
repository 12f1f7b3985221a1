"""Gemma 4 26B-A4B (routed experts) and E2B / E4B (per-layer embeddings, KV shared across layers) against
transformers' own Gemma 4 classes, on tiny random checkpoints (float32). The logits tests of
test_model_vs_transformers.py run on these layouts too."""

import pytest
import torch

from dflash_agent.engine.formats.config import ModelConfig
from dflash_agent.engine.load.weights import build_model, open_checkpoint
from tests.helpers.references import CONFIGS, PROMPT_LEN, VOCAB, moe_config, ple_config, save_reference
from tests.helpers.tokenizers import word_tokenizer


@pytest.fixture(params=sorted(CONFIGS))
def pair(request, tmp_path):
    ref = save_reference(request.param, tmp_path)
    ours = build_model(open_checkpoint(tmp_path), "cpu", torch.float32, progress=False)
    return ref, ours


def test_configs_read_the_family():
    moe = ModelConfig.from_hf_dict(moe_config().to_dict())
    assert moe.moe is not None and (moe.moe.num_experts, moe.moe.top_k, moe.moe.intermediate_size) == (8, 2, 32)
    ple = ModelConfig.from_hf_dict(ple_config().to_dict())
    assert ple.per_layer_input == 16 and ple.moe is None
    # sliding layers 3, 4 read layer 1's K / V, full layer 5 reads layer 2's, as transformers' kv_sharing_modes
    assert [s.kv_source for s in ple.layers] == [None, None, None, 1, 1, 2]
    assert [ple.layer_intermediate_size(i) for i in range(6)] == [48, 48, 48, 96, 96, 96]


def test_e2b_layout_shares_kv_as_published():
    """google/gemma-4-E2B-it's text config (its keys as MLX and Rust loaders' fixtures copy them): layers 15-34 reuse
    layer 13's K / V (the last sliding layer before them) or layer 14's (the last full one)."""
    config = ModelConfig.from_hf_dict(dict(
        model_type="gemma4_text", hidden_size=1536, num_hidden_layers=35, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512, vocab_size=262144,
        vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, num_kv_shared_layers=20,
        use_double_wide_mlp=True, intermediate_size=6144, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
    ))
    sources = [spec.kv_source for spec in config.layers]
    assert sources[:15] == [None] * 15
    assert all(s == (14 if not config.layers[i].sliding else 13) for i, s in enumerate(sources) if i >= 15)
    assert config.layer_intermediate_size(14) == 6144 and config.layer_intermediate_size(15) == 12288


def test_chunked_prefill_rollback_and_block_verify(pair):
    """Prompt chunks longer than the rings' slack, a rejected block rolled back, then a verified block."""
    ref, ours = pair
    ids = torch.randint(0, VOCAB, (PROMPT_LEN * 2 + 12,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    cache = ours.new_cache(96)
    ours(ids[:PROMPT_LEN], cache)
    ours(ids[PROMPT_LEN : 2 * PROMPT_LEN], cache)
    wrong = torch.randint(0, VOCAB, (4,))
    ours(wrong, cache, logits_at=torch.arange(4))
    cache.rollback(2 * PROMPT_LEN)
    got = ours(ids[2 * PROMPT_LEN :], cache, logits_at=torch.arange(12)).logits
    torch.testing.assert_close(got, expected[2 * PROMPT_LEN :], atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(pair):
    ref, ours = pair
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,))
    seq = prompt.tolist()
    with torch.no_grad():  # argmax of a full forward per token: no generation-config processors in the way
        for _ in range(24):
            seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
    expected = torch.tensor(seq[PROMPT_LEN:])
    cache = ours.new_cache(64)
    logits = ours(prompt, cache).logits[0]
    got = []
    for _ in range(24):
        token = int(logits.argmax())
        got.append(token)
        logits = ours(torch.tensor([token]), cache).logits[0]
    assert got == expected.tolist()


def test_shared_layers_keep_no_kv_of_their_own(pair):
    _, ours = pair
    cache = ours.new_cache(64)
    sources = [spec.kv_source for spec in ours.config.layers]
    for layer, source in zip(cache.layers, sources, strict=True):
        if source is not None:
            assert layer is cache.layers[source]
    assert len(cache.owned) == sum(source is None for source in sources)


def _engine_run(engine, prompt: list[int], max_tokens: int):
    import asyncio

    from dflash_agent.engine.engine import GenerateRequest

    async def collect():
        return [e async for e in engine.generate(GenerateRequest(prompt, max_tokens=max_tokens))]

    events = asyncio.run(collect())
    return [t for e in events[:-1] for t in e.ids], events[-1]


def test_agent_turns_with_lookup_drafts_and_the_prefix_cache_match_plain_decoding(pair):
    """Each turn appends the output and a 'tool result' quoting earlier text: prompt lookup drafts long blocks,
    the prefix cache resumes each turn, and every token is what plain decoding without either gives."""
    from dflash_agent.engine.cache.prefix_cache import PrefixCacheConfig
    from dflash_agent.engine.decode.speculative import SpecConfig
    from dflash_agent.engine.engine import Engine

    _, ours = pair
    fast = Engine(ours, word_tokenizer(VOCAB), 256, spec=SpecConfig(ngram_min=1, copy_match=4),
                  prefix_cache=PrefixCacheConfig(min_tokens=8))
    plain = Engine(ours, word_tokenizer(VOCAB), 256, spec=SpecConfig(enabled=False), prefix_cache=None)
    try:
        base = torch.randint(5, VOCAB, (12,), generator=torch.Generator().manual_seed(7)).tolist()
        convo, drafted = base * 2, 0
        for turn in range(3):
            ids, final = _engine_run(fast, convo, 20)
            plain_ids, _ = _engine_run(plain, convo, 20)
            assert ids == plain_ids
            assert final.timings.cache_n > 0 or turn == 0
            drafted += final.spec.drafted
            convo = convo + ids + base + ids[:6]
        assert drafted > 0
    finally:
        fast.close()
        plain.close()
