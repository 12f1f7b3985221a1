"""Prefix reuse across requests: outputs with the cache equal outputs without it (tiny Gemma 4 target with a
sliding window of 8 and a tiny DFlash drafter, float32), on appended turns, branches, retries and
several conversations under a small budget; the 8-bit KV cache stays close to the float one."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dflash_agent.engine.cache import drafter_cache
from dflash_agent.engine.cache.kv_cache import dequantize_q8, quantize_q8
from dflash_agent.engine.cache.prefix_cache import PrefixCacheConfig, PrefixKV, PrefixStore, common_prefix
from dflash_agent.engine.decode import speculative
from dflash_agent.engine.decode.draft_policy import Source
from dflash_agent.engine.decode.sampling import Sampler, SamplingParams
from dflash_agent.engine.decode.speculative import RequestDecoder, SpecConfig
from dflash_agent.engine.engine import Engine, FinalEvent, GenerateRequest
from dflash_agent.engine.load.weights import build_model, open_checkpoint
from dflash_agent.engine.model.drafter import load_drafter
from dflash_agent.engine.runner import StepRunner
from tests.helpers.decoding import decode, prefill
from tests.helpers.references import VOCAB
from tests.helpers.tokenizers import word_tokenizer

from .dflash_pair import BLOCK, save_pair

pytest.importorskip("dflash.model")

N_CTX = 256
WINDOW = 8  # the tiny target's sliding window; its rings hold WINDOW + 16 slots
CONFIG = PrefixCacheConfig(min_tokens=8)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, _, target_dir, drafter_dir = save_pair(tmp_path_factory.mktemp("pair"))
    target = build_model(open_checkpoint(target_dir), "cpu", torch.float32, progress=False)
    drafter = load_drafter(drafter_dir, 64, 4, VOCAB, torch.device("cpu"), torch.float32)
    return target, drafter


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Pair:
    """The same target (and drafter) behind an engine with the prefix cache and one without."""

    def __init__(self, target, drafter, config: PrefixCacheConfig = CONFIG, kv_dtype: str = "model") -> None:
        spec = SpecConfig(block=BLOCK, ngram=False) if drafter is not None else SpecConfig(enabled=False)
        self.cached = Engine(target, word_tokenizer(VOCAB), N_CTX, drafter=drafter, spec=spec, prefix_cache=config,
                             kv_dtype=kv_dtype)
        self.plain = Engine(target, word_tokenizer(VOCAB), N_CTX, drafter=drafter, spec=spec, prefix_cache=None,
                            kv_dtype=kv_dtype)

    def run(self, prompt: list[int], max_tokens: int = 10, **options) -> tuple[list[int], FinalEvent]:
        """Both engines on one request: greedy outputs and drafting statistics must agree."""
        ids, final = _run(self.cached, prompt, max_tokens, **options)
        plain_ids, plain = _run(self.plain, prompt, max_tokens)
        assert ids == plain_ids
        assert (final.spec.drafted, final.spec.accepted) == (plain.spec.drafted, plain.spec.accepted)
        assert final.finish_reason == plain.finish_reason
        t = final.timings
        assert t.cache_n + t.prompt_n == len(prompt) == final.usage.prompt_tokens
        assert final.usage.cached_tokens == t.cache_n
        return ids, final

    def close(self) -> None:
        self.cached.close()
        self.plain.close()


def _run(engine: Engine, prompt: list[int], max_tokens: int, **options) -> tuple[list[int], FinalEvent]:
    async def collect():
        return [e async for e in engine.generate(GenerateRequest(prompt, max_tokens=max_tokens, **options))]

    events = asyncio.run(collect())
    return [t for e in events[:-1] for t in e.ids], events[-1]


@pytest.fixture(params=["target", "with drafter"])
def engines(request, pair):
    target, drafter = pair
    both = Pair(target, drafter if request.param == "with drafter" else None)
    yield both
    both.close()


def test_common_prefix():
    a = list(range(1000))
    assert common_prefix(a, a) == 1000
    assert common_prefix(a, a[:300]) == 300
    assert common_prefix(a, a[:700] + [5] + a[701:]) == 700
    assert common_prefix([], a) == 0


def test_agent_turns_reuse_everything_they_can(engines):
    """Each turn appends the previous output and a tool result: only those new tokens are prefilled."""
    convo = _tokens(40, seed=1)
    previous = 0
    for turn in range(4):
        ids, final = engines.run(convo)
        # All but the last generated token have keys (it was sampled, never run through the target).
        assert final.timings.cache_n == (0 if turn == 0 else previous - 1)
        previous = len(convo) + len(ids)
        convo = convo + ids + _tokens(7, seed=10 + turn)
    stats = engines.cached.prefix_stats
    assert stats.hits == 3 and stats.requests == 4


def test_branches_inside_and_beyond_the_window(engines):
    """Where reuse lands: rollback inside the rings' reach, a prompt-end checkpoint, or nothing; the
    outputs equal uncached decoding in every case."""
    short = _tokens(6, seed=2)
    engines.run(short, max_tokens=3)
    # The whole short conversation still fits in the rings: any prefix rolls back exactly.
    assert engines.run(short[:5] + [9, 9], max_tokens=3)[1].timings.cache_n == 5

    prompt = _tokens(40, seed=3)
    out, _ = engines.run(prompt, max_tokens=12)
    # Cut 5 tokens back from the end of the keys: within the rings' slack, a plain rollback.
    assert engines.run(prompt + out[:6] + [7, 7])[1].timings.cache_n == 46
    # The same prompt with another ending: back to the prompt-end checkpoint (the ring has moved on).
    assert engines.run(prompt + [8, 8, 8], max_tokens=12)[1].timings.cache_n == 40
    # Cut inside the prompt, beyond the rings' reach, with no checkpoint before it: prefilled again.
    assert engines.run(prompt[:30] + [8], max_tokens=6)[1].timings.cache_n == 0
    # A retry of a prompt: its checkpoint kept the last token's logits, so nothing is prefilled.
    engines.run(prompt, max_tokens=12)
    retry = engines.run(prompt, max_tokens=12)[1]
    assert retry.timings.cache_n == 40 and retry.timings.prompt_n == 0


@pytest.fixture(params=["drafter rings", "tight drafter rings", "bounded drafter"])
def drafter_rings(request, monkeypatch, pair):
    """The target and drafter, the drafter's rings as the engine makes them, or with a block's slack only: as short
    as the target's, so these conversations wrap them and a restore needs their checkpoints too; or so and with the
    drafter reading only the last tokens of the context (--draft-ctx), its full layer a ring too."""
    target, drafter = pair
    if request.param != "drafter rings":
        monkeypatch.setattr(drafter_cache, "LOOKUP_SLACK", BLOCK)
    if request.param == "bounded drafter":
        drafter = drafter.with_context_window(BLOCK + 4)
    return target, drafter


def test_checkpoints_inside_a_long_prefill(monkeypatch, drafter_rings):
    """Ring checkpoints every `checkpoint_every` prefilled tokens let a branch inside a long prompt reuse
    up to the last one before it."""
    monkeypatch.setattr(speculative, "PREFILL_CHUNK", 8)
    target, drafter = drafter_rings
    both = Pair(target, drafter, PrefixCacheConfig(min_tokens=8, checkpoint_every=16))
    try:
        prompt = _tokens(60, seed=4)
        both.run(prompt)
        assert both.run(prompt[:37] + [6, 6, 6])[1].timings.cache_n == 32
        assert both.run(prompt[:12] + [6])[1].timings.cache_n == 0
        # Prefill chunks end on multiples of the chunk size, whatever the reused prefix.
        assert both.run(prompt[:20] + _tokens(30, seed=5))[1].timings.cache_n == 16
    finally:
        both.close()


@pytest.fixture
def proposals(monkeypatch) -> list[list[int]]:
    """Every block the decoders draft, in order (the drafter itself runs unchanged)."""
    seen: list[list[int]] = []
    original = RequestDecoder._propose

    def recorded(self, source, anchor, k):
        proposal = original(self, source, anchor, k)
        seen.append(proposal.tokens)
        return proposal

    monkeypatch.setattr(RequestDecoder, "_propose", recorded)
    return seen


def test_drafter_context_after_a_hit(proposals, drafter_rings):
    """After a hit the drafter proposes exactly what it proposes without the cache: its context K/V
    for the cached prefix was kept with the target's."""
    target, drafter = drafter_rings
    spec = SpecConfig(block=BLOCK, ngram=False)
    cached = Engine(target, word_tokenizer(VOCAB), N_CTX, drafter=drafter, spec=spec, prefix_cache=CONFIG)
    plain = Engine(target, word_tokenizer(VOCAB), N_CTX, drafter=drafter, spec=spec, prefix_cache=None)
    try:
        convo = _tokens(30, seed=6)
        runs = {"cached": [], "plain": []}
        for turn in range(3):
            for name, engine in (("cached", cached), ("plain", plain)):
                proposals.clear()
                ids, final = _run(engine, convo, 16)
                runs[name].append((ids, list(proposals), final.timings.cache_n))
            convo = convo + runs["cached"][-1][0] + _tokens(5, seed=20 + turn)
    finally:
        cached.close()
        plain.close()
    assert [r[:2] for r in runs["cached"]] == [r[:2] for r in runs["plain"]]
    assert all(r[2] > 0 for r in runs["cached"][1:])
    assert sum(len(p) for r in runs["cached"] for p in r[1]) > 0


@pytest.mark.parametrize("device_bytes", [0, 100_000])
def test_many_conversations_under_a_small_budget(device_bytes, monkeypatch, drafter_rings):
    """Five conversations sharing a system prompt, interleaved, with room for about two stored ones: hits
    and evictions both happen and every output equals uncached decoding (no conversation gets another's
    KV). With `device_bytes`, stored states start on the device and move to the host under pressure."""
    monkeypatch.setattr(speculative, "PREFILL_CHUNK", 8)
    target, drafter = drafter_rings
    host = 400_000
    config = PrefixCacheConfig(host_bytes=host, device_bytes=device_bytes, max_entries=3, min_tokens=8,
                               checkpoint_every=16)
    both = Pair(target, drafter, config)
    shared = _tokens(20, seed=7)
    convos = [shared + _tokens(10 + 3 * i, seed=30 + i) for i in range(5)]
    try:
        for turn in range(3):
            for i in (0, 1, 2, 3, 4) if turn % 2 == 0 else (4, 2, 0, 3, 1):
                ids, _ = both.run(convos[i], max_tokens=6)
                convos[i] = convos[i] + ids + _tokens(4, seed=100 * turn + i)
            # Back to a recent conversation: served from the store.
            both.run(convos[(turn + 1) % 5][:-4], max_tokens=4)
        stats = both.cached.prefix_stats
    finally:
        both.close()
    assert stats.evicted > 0 and stats.restored > 0 and stats.hits > 10
    assert stats.entries <= 3
    assert stats.host_bytes <= host and stats.device_bytes <= device_bytes


def test_cache_prompt_false_neither_reuses_nor_stores(pair):
    target, _ = pair
    both = Pair(target, None)
    try:
        a = _tokens(40, seed=8)
        out, _ = both.run(a)
        other = _tokens(30, seed=9)
        assert both.run(other, cache_prompt=False)[1].timings.cache_n == 0
        # The first conversation was stored before the uncached request took the working cache.
        assert both.run(a + out + [5])[1].timings.cache_n == len(a) + len(out) - 1
        assert both.run(other)[1].timings.cache_n == 0
        assert both.run(a, cache_prompt=False)[1].timings.cache_n == 0
    finally:
        both.close()


def test_stored_state_restores_bit_exactly(pair, proposals):
    """A conversation stored and restored gives bitwise the logits it gave in place: the same output and
    the same drafts."""
    target, drafter = pair
    engine = Engine(target, word_tokenizer(VOCAB), N_CTX, drafter=drafter, spec=SpecConfig(block=BLOCK, ngram=False),
                    prefix_cache=CONFIG)
    try:
        a, b = _tokens(40, seed=11), _tokens(40, seed=12)
        first = _run(engine, a, 8)
        drafts = list(proposals)
        _run(engine, b, 8)  # stores a, takes the working cache
        proposals.clear()
        again = _run(engine, a, 8)  # restored from the store
        assert again[1].timings.cache_n == 40 and again[0] == first[0]
        assert engine.prefix_stats.restored == 1
        assert proposals == drafts and len(drafts) > 1
    finally:
        engine.close()


def test_stop_inside_a_block_leaves_matching_keys(pair):
    """Generation that stops inside a verified block cuts the caches back to the consumed tokens. The
    drafts are scripted to be the target's own greedy tokens, so every block is accepted in full."""
    target, drafter = pair
    prompt = _tokens(20, seed=13)
    plain = RequestDecoder(StepRunner(target), target.new_cache(N_CTX), Sampler(SamplingParams()),
                           spec=SpecConfig(enabled=False))
    prefill(plain, prompt)
    truth = list(decode(plain, 30))

    cache, drafter_cache = target.new_cache(N_CTX), drafter.new_cache(N_CTX)
    decoder = RequestDecoder(StepRunner(target), cache, Sampler(SamplingParams()), drafter=drafter,
                             drafter_cache=drafter_cache,
                             spec=SpecConfig(block=BLOCK, ngram=False))
    decoder._propose = lambda source, anchor, k: speculative._Proposal(
        Source.DFLASH, truth[len(decoder.sequence) - len(prompt):][:k])
    prefill(decoder, prompt)
    stream = decode(decoder, 30)
    taken = [next(stream) for _ in range(3)]  # the third is inside the first verified block
    assert taken == truth[:3]
    assert cache.length == len(prompt) + BLOCK and decoder.stats.accepted == BLOCK - 1
    ids = decoder.finish(len(taken))
    assert ids == prompt + taken and cache.length == drafter_cache.length == len(ids)


def test_q8_quantizer():
    x = torch.randn(5, 2, 64)
    x[:, :, 3] *= 40  # an outlier: only its own block of 32 loses resolution
    q, scale = quantize_q8(x)
    assert q.dtype == torch.int8 and scale.shape == (5, 2, 2)
    error = (dequantize_q8(q, scale) - x).abs()
    assert (error <= scale.repeat_interleave(32, -1) / 2 + 1e-6).all()
    assert error[..., 32:].max() < 0.03


def test_q8_kv_cache_is_smaller_and_close(pair):
    target, _ = pair
    # both keeping K and V (an 8-bit cache always does; one in the model's dtype may keep V alone: test_values_only_kv)
    caches = {kv: target.new_cache(N_CTX, kv, values_only=False) for kv in ("model", "q8")}
    size = {kv: sum(t.nbytes for layer in c.layers for t in layer.storage()) for kv, c in caches.items()}
    assert size["q8"] < 0.3 * size["model"]  # against float32
    prompt = torch.tensor(_tokens(40, seed=14))
    logits = {}
    for kv, cache in caches.items():
        target(prompt[:30], cache)
        logits[kv] = target(prompt[30:], cache, logits_at=torch.arange(10)).logits
    # This random model is touchy (a bf16 KV cache moves its logits by ~2%); see the embedded test for outputs.
    assert (logits["q8"] - logits["model"]).norm() / logits["model"].norm() < 0.1


def test_q8_with_the_prefix_cache(pair):
    target, drafter = pair
    both = Pair(target, drafter, kv_dtype="q8")
    try:
        convo = _tokens(40, seed=15)
        for turn in range(3):
            ids, final = both.run(convo)
            convo = convo + ids + _tokens(5, seed=40 + turn)
        assert final.timings.cache_n > 0
    finally:
        both.close()


def test_bad_kv_dtype(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="a KV cache stores model or q8, not 'q4'"):
        target.new_cache(N_CTX, "q4")
    with pytest.raises(ValueError, match="not 'auto'"):  # the memory plan's to resolve, before a cache is made
        target.new_cache(N_CTX, "auto")
    with pytest.raises(ValueError, match=r"unknown KV cache type 'int4' \(auto, model, q8\)"):
        Engine.load("embedded", kv_dtype="int4")


# --- the embedded Gemma 3 270M (sliding window 512) ----------------------------------------------------


@pytest.fixture(scope="module")
def embedded(embedded_engine):
    engine = embedded_engine(1024, device="cpu", dtype="float32", weights="exact")
    yield engine
    engine.close()


def test_embedded_session_past_the_window(embedded):
    """A session on the real model whose reused prefixes end beyond its 512-token window: an appended turn
    reuses everything, a branch at the first prompt's end is restored from the store, and each equals
    prefilling in full."""
    import inspect
    import json.decoder

    source = embedded.tokenizer.encode(inspect.getsource(json.decoder), add_bos=False)
    first = [embedded.tokenizer.bos_id, *source[:560]]
    out1, _ = _run(embedded, first, 6)
    second = first + out1 + source[560:600]
    out2, final = _run(embedded, second, 6)
    assert final.timings.cache_n == len(first) + len(out1) - 1
    assert _run(embedded, second, 6, cache_prompt=False)[0] == out2  # also stores the session
    branch = first + embedded.tokenizer.encode("\n\n# A different ending", add_bos=False)
    out3, final = _run(embedded, branch, 6)
    assert final.timings.cache_n == len(first)
    assert _run(embedded, branch, 6, cache_prompt=False)[0] == out3
    assert embedded.prefix_stats.restored == 1


def test_embedded_q8_greedy_matches(embedded):
    q8 = Engine(embedded.model, embedded.tokenizer, 1024, kv_dtype="q8", runner=embedded.runner)
    try:
        prompt = embedded.tokenizer.encode("def fibonacci(n):")
        assert _run(q8, prompt, 16)[0] == _run(embedded, prompt, 16, cache_prompt=False)[0]
    finally:
        q8.close()


def test_reused_logits_are_a_copy(pair):
    """Grammar masks and samplers edit logits in place; a full hit must not hand out the stored ones."""
    from dflash_agent.engine.cache.prefix_cache import PrefixCache

    target, _ = pair
    cache = target.new_cache(N_CTX)
    prefix = PrefixCache(CONFIG, cache, None)
    prompt = _tokens(30, seed=16)
    firsts, reused = [], []
    for _ in range(3):
        decoder = RequestDecoder(StepRunner(target), cache, Sampler(SamplingParams()),
                                 spec=SpecConfig(enabled=False))
        reuse = prefix.acquire(prompt)
        prefill(decoder, prompt, reuse.tokens, reuse.logits, on_chunk=prefix.prefilled)
        firsts.append(next(decode(decoder, 4)))
        reused.append(reuse.tokens)
        if reuse.logits is not None:
            reuse.logits.fill_(float("-inf"))
        prefix.release(decoder.finish(1))
    assert reused == [0, len(prompt), len(prompt)]
    assert firsts[0] == firsts[1] == firsts[2]


def test_slots_storing_the_same_conversation(pair):
    """Requests one after another over four slots: two conversations asked in turn each take over the slot of the
    other (their common start), so the store is offered the same conversation again while it holds it, then past
    its max_entries evicts. One copy is kept of each conversation, and every output still equals uncached
    decoding."""
    target, _ = pair
    config = PrefixCacheConfig(min_tokens=8, max_entries=4)
    cached = Engine(target, word_tokenizer(VOCAB), N_CTX, spec=SpecConfig(enabled=False), prefix_cache=config,
                    parallel=4)
    plain = Engine(target, word_tokenizer(VOCAB), N_CTX, spec=SpecConfig(enabled=False), prefix_cache=None)
    shared = _tokens(12, seed=39)  # a chat template's start: each turn reaches the slot that held the other
    a, b = shared + _tokens(30, seed=40), shared + _tokens(30, seed=41)
    prompts = [a, b] * 3 + [shared + _tokens(20 + i, seed=50 + i) for i in range(8)]
    try:
        for prompt in prompts:
            # a turn longer than a quarter of the conversation: restoring its prompt keeps the stored copy
            assert _run(cached, prompt, 20)[0] == _run(plain, prompt, 20)[0]
            entries = cached._scheduler.slots[0].prefix.store.entries
            assert len({tuple(e.ids) for e in entries}) == len(entries)
        stats = cached.prefix_stats
    finally:
        cached.close()
        plain.close()
    assert stats.evicted > 0 and stats.restored + stats.hits > 0 and stats.entries <= 4


def test_stored_conversations_are_told_apart_by_identity() -> None:
    """Eviction removes the entry it chose, not the first one equal to it: comparing two copies of a conversation
    field by field would ask their tensors for a truth value (a 500 on every later request, once)."""
    store = PrefixStore(PrefixCacheConfig(max_entries=1))
    ids = [1, 2, 3]
    newer, older = PrefixKV(ids, [], [torch.ones(3, 4)], last_used=2), PrefixKV(list(ids), [], [torch.ones(3, 4)],
                                                                         last_used=1)
    store.entries += [newer, older]
    store.fit()
    assert store.entries == [newer] and store.entries[0] is newer and store.stats.evicted == 1
