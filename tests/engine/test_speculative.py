"""DFlash drafting and speculative verification against z-lab's reference (`dflash` on PyPI) and
against plain decoding of the same target."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import torch

from dflash_agent.engine.cache.drafter_cache import DrafterCache
from dflash_agent.engine.decode.draft_policy import Arm, DraftPolicy, Source
from dflash_agent.engine.decode.sampling import Sampler, SamplingParams
from dflash_agent.engine.decode.speculative import CopyMemory, NgramIndex, RequestDecoder, SpecConfig
from dflash_agent.engine.engine import Engine, GenerateRequest
from dflash_agent.engine.load.weights import build_model, open_checkpoint
from dflash_agent.engine.model.drafter import DrafterError, load_drafter
from dflash_agent.engine.runner import StepRunner
from tests.helpers.decoding import decode, prefill
from tests.helpers.references import VOCAB
from tests.helpers.tokenizers import word_tokenizer

from .dflash_pair import BLOCK, DRAFT_WINDOW, MASK_ID, TARGET_LAYER_IDS, save_drafter, save_pair

dflash_model = pytest.importorskip("dflash.model")

N_CTX = 256


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    ref_target, ref_drafter, target_dir, drafter_dir = save_pair(root)
    target = build_model(open_checkpoint(target_dir), "cpu", torch.float32, progress=False)
    drafter = load_drafter(drafter_dir, 64, 4, VOCAB, torch.device("cpu"), torch.float32)
    return ref_target, ref_drafter, target, drafter, drafter_dir


def _decode(target, drafter, prompt, max_new, spec, sampling=None):
    decoder = RequestDecoder(
        StepRunner(target), target.new_cache(N_CTX), Sampler(sampling or SamplingParams()),
        drafter=drafter, drafter_cache=drafter.new_cache(N_CTX) if drafter is not None else None, spec=spec,
    )
    prefill(decoder, prompt)
    return list(decode(decoder, max_new)), decoder.stats


def _prompts(n):
    gen = torch.Generator().manual_seed(7)
    # Lengths from 3 to 40: several are longer than the target's (8) and the drafter's (12) windows.
    return [torch.randint(5, VOCAB, (3 + (i * 37) % 38,), generator=gen).tolist() for i in range(n)]


def test_greedy_matches_reference_and_plain_decoding(pair, monkeypatch):
    ref_target, ref_drafter, target, drafter, _ = pair
    # The reference times itself with torch.cuda.synchronize; its statistics are all we read.
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    max_new = 40
    drafted = 0
    for prompt in _prompts(20):
        ref = dflash_model.dflash_generate(
            ref_drafter, ref_target, torch.tensor([prompt]), max_new, None, temperature=0.0, return_stats=True
        )
        expected = ref.output_ids[0, len(prompt):].tolist()
        ours, stats = _decode(target, drafter, prompt, max_new, SpecConfig(block=BLOCK, ngram=False))
        plain, _ = _decode(target, None, prompt, max_new, SpecConfig(enabled=False))
        assert ours == expected
        assert plain == expected
        # Same drafts, same verdicts: the per-step committed counts agree with the reference's
        # (its last step may draft past max_new, so it is left out).
        assert [a + 1 for a in stats.accept_lengths][:-1] == ref.acceptance_lengths[: len(stats.accept_lengths) - 1]
        drafted += stats.drafted
    assert drafted > 0


def test_random_drafter_is_sometimes_right(pair):
    """The parity test above only means something if drafts are accepted now and then."""
    _, _, target, drafter, _ = pair
    accepted = sum(_decode(target, drafter, p, 40, SpecConfig(block=BLOCK, ngram=False))[1].accepted
                   for p in _prompts(20))
    assert accepted > 0


def test_incremental_context_equals_one_shot(pair):
    _, _, target, drafter, _ = pair
    ids = torch.tensor(_prompts(20)[5] + _prompts(20)[9])
    out = target(ids, target.new_cache(N_CTX), capture=tuple(TARGET_LAYER_IDS))
    features = torch.cat([out.captured[i] for i in TARGET_LAYER_IDS], -1)
    one_shot, pieces = drafter.new_cache(N_CTX), drafter.new_cache(N_CTX)
    drafter.append_context(features, one_shot)
    for chunk in features.split([1, 5, 2, 13, 1, features.shape[0] - 22]):
        drafter.append_context(chunk, pieces)
    n = features.shape[0]
    assert pieces.length == one_shot.length == n
    for k1, k2, v1, v2 in zip(one_shot.k, pieces.k, one_shot.v, pieces.v):
        torch.testing.assert_close(k1[:n], k2[:n])
        torch.testing.assert_close(v1[:n], v2[:n])
    block = target.embed_tokens.weight[torch.tensor([7] + [MASK_ID] * (BLOCK - 1))]
    torch.testing.assert_close(drafter.draft(block, one_shot), drafter.draft(block, pieces))


@pytest.mark.parametrize("inside", [False, True], ids=["between-chunks", "inside-a-chunk"])
def test_prefill_stops_when_asked(pair, monkeypatch, inside):
    """A cancelled request stops prefilling at the next chunk, or at the end of the one it was stopped inside (the
    eager layers run one at a time, and a chunk stopped between two of them runs the others: the sliding rings hold
    its first keys in place of the window before it); the caches keep the chunks done (the prefix cache takes them
    back), and nothing is decoded."""
    from dflash_agent.engine.decode import speculative

    monkeypatch.setattr(speculative, "PREFILL_CHUNK", 8)
    _, _, target, drafter, _ = pair
    prompt = _prompts(20)[5] + _prompts(20)[9]  # 30 tokens: chunks end at 8, 16, 24, 30
    chunks_done: list[int] = []
    checks = []

    def stop() -> bool:
        if len(chunks_done) == 2:
            checks.append(1)
        return len(checks) > inside  # inside: one check later, which is after the third chunk's first layer

    decoder = RequestDecoder(StepRunner(target), target.new_cache(N_CTX), Sampler(SamplingParams()), drafter=drafter,
                             drafter_cache=drafter.new_cache(N_CTX), spec=SpecConfig())
    assert prefill(decoder, prompt, on_chunk=lambda position, _: chunks_done.append(position), stop=stop) is False
    held = 24 if inside else 16
    assert chunks_done == [8, 16, 24][:held // 8]
    assert decoder.cache.length == decoder.drafter_cache.length == held
    assert list(decode(decoder, 0)) == [] and decoder.finish(0) == prompt[:held]
    whole = RequestDecoder(StepRunner(target), target.new_cache(N_CTX), Sampler(SamplingParams()))
    assert prefill(whole, prompt, stop=lambda: False) is True and whole.cache.length == len(prompt)
    # a decoder stopped goes on from what its caches hold, as one given that prefix
    prefill(decoder, prompt, cached=held, on_chunk=lambda *_: None)
    assert decoder.cache.length == len(prompt)
    assert list(decode(decoder, 8)) == list(decode(whole, 8))


def test_drafter_matches_reference_forward(pair):
    ref_target, ref_drafter, target, drafter, _ = pair
    ids = torch.tensor(_prompts(20)[3])
    n = ids.shape[0]
    out = target(ids, target.new_cache(N_CTX), capture=tuple(TARGET_LAYER_IDS))
    features = torch.cat([out.captured[i] for i in TARGET_LAYER_IDS], -1)
    cache = drafter.new_cache(N_CTX)
    drafter.append_context(features, cache)
    block = torch.tensor([11] + [MASK_ID] * (BLOCK - 1))
    ours = drafter.draft(target.embed_tokens.weight[block], cache)
    with torch.no_grad():
        ref = ref_drafter(
            target_hidden=features[None], noise_embedding=ref_target.get_input_embeddings().weight[block][None],
            position_ids=torch.arange(n + BLOCK)[None],
        )[0]
        ref_logits = ref_drafter.compute_logits(ref[1:], ref_target.lm_head)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.logits(ours[1:], target.output_weight), ref_logits, atol=1e-4, rtol=1e-4)


def test_drafter_rings_draft_as_the_reference_over_a_long_context(pair):
    """The drafter's sliding layers keep a ring of window + slack slots: wrapped many times over a long context, fed
    in uneven pieces, rolled back within the slack, and restored from a snapshot, a draft is the reference's over
    the whole context; a rollback past the slack is refused."""
    ref_target, ref_drafter, target, drafter, _ = pair
    ids = torch.randint(5, VOCAB, (100,), generator=torch.Generator().manual_seed(9))
    out = target(ids, target.new_cache(N_CTX), capture=tuple(TARGET_LAYER_IDS))
    features = torch.cat([out.captured[i] for i in TARGET_LAYER_IDS], -1)
    block = torch.tensor([11] + [MASK_ID] * (BLOCK - 1))
    embeds = target.embed_tokens.weight[block]

    def reference(n: int) -> torch.Tensor:
        with torch.no_grad():
            return ref_drafter(target_hidden=features[None, :n],
                               noise_embedding=ref_target.get_input_embeddings().weight[block][None],
                               position_ids=torch.arange(n + BLOCK)[None])[0]

    cache = DrafterCache(drafter.config, N_CTX, torch.device("cpu"), torch.float32, slack=BLOCK)
    assert cache.ring_slots == DRAFT_WINDOW + BLOCK and cache.k[0].shape[0] == cache.ring_slots
    assert cache.k[2].shape[0] == N_CTX  # the full layer keeps every position
    for start, end in ((0, 7), (7, 60), (60, 61), (61, 100)):
        drafter.append_context(features[start:end], cache)
        if end == 60:
            full, rings = cache.full_snapshot(60, "cpu"), cache.ring_snapshot("cpu")
    torch.testing.assert_close(drafter.draft(embeds, cache), reference(100), atol=1e-4, rtol=1e-4)
    cache.rollback(100 - BLOCK)
    torch.testing.assert_close(drafter.draft(embeds, cache), reference(100 - BLOCK), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="no longer hold the window"):
        cache.rollback(100 - BLOCK - DRAFT_WINDOW)
    cache.restore(60, full, rings)
    torch.testing.assert_close(drafter.draft(embeds, cache), reference(60), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="no longer hold the window"):
        cache.restore(30, None, None)


def test_bounded_drafter_drafts_as_the_reference_over_the_last_tokens(pair):
    """--draft-ctx W: every layer reads at most the last W tokens, the full (bidirectional) one counting back from
    the block's last position. With W past a sliding window and a block, a draft over a long context is the
    reference's over its last W - BLOCK tokens at their own positions, through rings that wrap, rolled back and
    restored."""
    ref_target, ref_drafter, target, drafter, _ = pair
    window = DRAFT_WINDOW + BLOCK + 3
    bounded = drafter.with_context_window(window)
    assert bounded.config.window == (DRAFT_WINDOW, DRAFT_WINDOW, window)
    assert drafter.config.window[2] is None and bounded.fc is drafter.fc  # the same weights
    ids = torch.randint(5, VOCAB, (100,), generator=torch.Generator().manual_seed(11))
    out = target(ids, target.new_cache(N_CTX), capture=tuple(TARGET_LAYER_IDS))
    features = torch.cat([out.captured[i] for i in TARGET_LAYER_IDS], -1)
    block = torch.tensor([11] + [MASK_ID] * (BLOCK - 1))
    embeds = target.embed_tokens.weight[block]

    def reference(n: int) -> torch.Tensor:
        first = n + BLOCK - window  # the oldest key the block's last position (n + BLOCK - 1) sees
        with torch.no_grad():
            return ref_drafter(target_hidden=features[None, first:n],
                               noise_embedding=ref_target.get_input_embeddings().weight[block][None],
                               position_ids=torch.arange(first, n + BLOCK)[None])[0]

    cache = bounded.new_cache(N_CTX)
    assert all(k.shape[0] == cache.ring_slots < N_CTX for k in cache.k)  # every layer a ring
    for start, end in ((0, 7), (7, 60), (60, 61), (61, 100)):
        bounded.append_context(features[start:end], cache)
        if end == 60:
            full, rings = cache.full_snapshot(60, "cpu"), cache.ring_snapshot("cpu")
    torch.testing.assert_close(bounded.draft(embeds, cache), reference(100), atol=1e-4, rtol=1e-4)
    cache.rollback(100 - BLOCK)
    torch.testing.assert_close(bounded.draft(embeds, cache), reference(100 - BLOCK), atol=1e-4, rtol=1e-4)
    cache.restore(60, full, rings)
    torch.testing.assert_close(bounded.draft(embeds, cache), reference(60), atol=1e-4, rtol=1e-4)
    # the whole context differs: the bound is real
    whole = drafter.new_cache(N_CTX)
    drafter.append_context(features, whole)
    assert not torch.allclose(drafter.draft(embeds, whole), reference(100), atol=1e-3)


def test_bounded_drafter_stays_lossless(pair):
    _, _, target, drafter, _ = pair
    bounded = drafter.with_context_window(BLOCK + 2)
    drafted = 0
    for prompt in _prompts(12):
        ours, stats = _decode(target, bounded, prompt, 40, SpecConfig(block=BLOCK, ngram=False))
        plain, _ = _decode(target, None, prompt, 40, SpecConfig(enabled=False))
        assert ours == plain
        drafted += stats.drafted
    assert drafted > 0
    with pytest.raises(DrafterError, match="shorter than the drafter's block"):
        drafter.with_context_window(BLOCK - 1)


def _chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of a two-sample chi-square test that two samples come from one distribution."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        total = a[k] + b[k]
        for count, n in ((a[k], na), (b[k], nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    dof = len(keys) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.parametrize("source", ["dflash", "ngram"])
def test_sampling_distribution_is_unchanged(pair, source):
    """Rejection sampling is lossless: the joint distribution of the tokens after the first, with
    speculation, matches plain sampling (two-sample chi-square over many seeds)."""
    _, _, target, drafter, _ = pair
    params = {"temperature": 1.0, "top_k": 3}
    if source == "ngram":
        # Every token occurs in the prompt, so a one-token lookup always has something to propose.
        prompt, spec = list(range(5, VOCAB)), SpecConfig(block=4, ngram_min=1, ngram_max=2)
    else:
        prompt, spec = _prompts(20)[4], SpecConfig(block=4, ngram=False)
    use_drafter = drafter if source == "dflash" else None
    runs = 500
    with_spec, plain = Counter(), Counter()
    drafted = 0
    for seed in range(runs):
        out, stats = _decode(target, use_drafter, prompt, 3, spec, SamplingParams(seed=seed, **params))
        with_spec[tuple(out[1:3])] += 1
        drafted += stats.drafted
        out, _ = _decode(target, None, prompt, 3, SpecConfig(enabled=False), SamplingParams(seed=runs + seed, **params))
        plain[tuple(out[1:3])] += 1
    assert drafted > 0
    assert _chi_square_p(with_spec, plain) > 1e-3


def test_ngram_index_proposes_latest_earlier_continuation():
    index = NgramIndex(2, 3)
    index.extend([1, 2, 3, 4, 1, 2, 3, 5, 1, 2])
    # Suffix [1, 2] last occurred before position 6, followed by 3, 5, 1, 2.
    assert index.propose(3) == [3, 5, 1]
    index.extend([9])
    assert index.propose(3) == []


def test_ngram_index_copies_only_after_a_long_match():
    index = NgramIndex(2, 3, copy_n=4)
    index.extend([1, 2, 3, 4, 5, 6, 7, 9, 2, 3, 4, 5])
    # the last four tokens occurred before, followed by 6, 7, 9, 2, ...: drafts as long as the match
    assert index.copy(3) == [6, 7, 9] and index.copy(50) == [6, 7, 9, 2]
    copying = NgramIndex(2, 3, copy_n=4)
    copying.extend([5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6])  # six tokens of the copy so far
    assert copying.copy(50) == [7, 8, 9, 1, 2, 3] and copying.copy(4) == [7, 8, 9, 1]
    index.extend([8])  # [5, 8] never occurred: no match of any length
    assert index.copy(3) == [] and index.propose(3) == []
    index.extend([1, 2])
    assert index.copy(3) == [] and index.propose(2) == [3, 4]  # a short match proposes; a copy needs four


def test_a_repeat_drafts_past_the_end_of_the_sequence():
    """An output that keeps writing the same line: the match is the repeat's own tail, and its continuation runs on
    into the drafts (llama.cpp's ngram-mod does the same), not just to the sequence's end."""
    index = NgramIndex(2, 3, copy_n=4)
    index.extend([7, 1, 2, 1, 2, 1, 2, 1, 2])
    assert index.propose(5) == [1, 2, 1, 2, 1]
    assert index.copy(6) == [1, 2, 1, 2, 1, 2]  # the match reaches back six tokens


def test_controller_plays_copies_only_where_a_long_match_is():
    controller = DraftPolicy(7, drafter=True, ngram=True, fixed=None, max_lookup=64, copy=True)
    assert controller.arms == [Arm(Source.AR, 0), Arm(Source.COPY, 32), Arm(Source.COPY, 64), Arm(Source.DFLASH, 2),
                               Arm(Source.DFLASH, 4), Arm(Source.DFLASH, 7), Arm(Source.NGRAM, 4), Arm(Source.NGRAM, 8),
                               Arm(Source.NGRAM, 16)]
    seconds = {arm: 0.02 + 0.01 * arm.k for arm in controller.arms}
    # long matches are copies under way and land; short ones (records sharing a layout) go wrong, as the rest
    tokens = {arm: 65 if arm == Arm(Source.COPY, 64) else 1 for arm in controller.arms}
    for step in range(300):
        copy = (0, 20, 64)[step % 3]
        arm = controller.choose(ngram_available=True, copy_available=copy)
        assert arm.source is not Source.COPY or arm == Arm(Source.COPY, 64 if copy >= 32 else 32)
        assert copy or arm.source is not Source.COPY
        controller.record(arm, tokens[arm], seconds[arm])
    assert controller.choose(ngram_available=True, copy_available=40) == Arm(Source.COPY, 64)
    assert controller.choose(ngram_available=True, copy_available=20) == Arm(Source.AR, 0)  # learnt apart
    assert controller.choose(ngram_available=True, copy_available=0) == Arm(Source.AR, 0)


def test_copy_memory_drafts_what_an_earlier_request_wrote():
    memory = CopyMemory(4, max_tokens=40)
    prompt, output = [9, 9, 1, 2, 3, 4], [5, 6, 7, 8, 10, 11]
    memory.add(prompt + output, len(prompt))
    index = NgramIndex(2, 3, copy_n=4, memory=memory)
    index.extend([3, 3, 1, 2, 3, 4])  # the same last four prompt tokens, then what the earlier request wrote
    assert index.copy(50) == [5, 6, 7, 8]  # as long as the match: four tokens
    index.extend([5, 6])
    assert index.copy(3) == [7, 8, 10] and index.copy(50) == [7, 8, 10, 11]  # the match grew; the output's end
    assert NgramIndex(2, 3, copy_n=4).copy(50) == []  # no memory, no match
    own = NgramIndex(2, 3, copy_n=4, memory=memory)
    own.extend([0, 1, 2, 3, 4, 12, 13, 0, 1, 2, 3, 4])  # its own occurrence matches five back, the memory's four
    assert own.copy(50) == [12, 13, 0, 1, 2]
    memory.add([1, 2, 3, 4, 20, 21, 22], 4)  # a later output after the same four tokens wins
    assert NgramIndex(2, 3, copy_n=4, memory=memory).copy(50) == []  # too short a sequence to match four
    later = NgramIndex(2, 3, copy_n=4, memory=memory)
    later.extend([1, 2, 3, 4])
    assert later.copy(50) == [20, 21, 22]
    for i in range(6):  # outputs of 20 tokens each: the oldest go, within 40 tokens
        memory.add([1, 2, 3, 4] + [30 + i] * 16, 4)
    gone = NgramIndex(2, 3, copy_n=4, memory=memory)
    gone.extend([3, 4, 5, 6])
    assert gone.copy(50) == [] and memory.tokens <= 40


def test_a_repeated_request_drafts_its_earlier_output_losslessly(pair):
    """The same prompt again: the second request drafts copies of what the first wrote (from the scheduler's memory
    of outputs), and both give what plain decoding gives."""
    _, _, target, _, _ = pair
    prompt = _prompts(20)[5]
    plain, _ = _decode(target, None, prompt, 60, SpecConfig(enabled=False))
    engine = Engine(target, word_tokenizer(VOCAB, stop_ids=()), N_CTX, spec=SpecConfig(block=BLOCK))

    async def run():
        final = None
        ids: list[int] = []
        async for event in engine.generate(GenerateRequest(prompt, max_tokens=60, cache_prompt=False)):
            ids += getattr(event, "ids", []) or []
            final = event
        return ids, final

    try:
        first, _ = asyncio.run(run())
        second, final = asyncio.run(run())
    finally:
        engine.close()
    assert first == plain and second == plain
    assert final.spec.by_source["copy"][2] >= 40  # nearly all of it drafted and accepted as copies


def test_engine_reports_drafting(pair):
    _, _, target, drafter, _ = pair
    engine = Engine(target, word_tokenizer(VOCAB), N_CTX, drafter=drafter, spec=SpecConfig(block=BLOCK))

    async def run():
        events = [e async for e in engine.generate(GenerateRequest(_prompts(20)[6], max_tokens=30))]
        return events[-1]

    try:
        final = asyncio.run(run())
    finally:
        engine.close()
    assert final.timings.draft_n > 0
    assert final.timings.draft_n_accepted == final.spec.accepted
    assert final.spec.acceptance_length_mean >= 1.0


def test_bad_drafter_checkpoints(tmp_path):
    with pytest.raises(DrafterError, match="no config.json"):
        load_drafter(tmp_path, 64, 4, VOCAB, torch.device("cpu"), torch.float32)
    save_drafter(tmp_path / "d", dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": [0, 9]})
    with pytest.raises(DrafterError, match="target layer 9"):
        load_drafter(tmp_path / "d", 64, 4, VOCAB, torch.device("cpu"), torch.float32)
    with pytest.raises(DrafterError, match="hidden size"):
        load_drafter(tmp_path / "d", 32, 12, VOCAB, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("mode", ["q8", "q4"])
def test_quantized_drafter_stays_close(pair, mode):
    _, _, target, _, drafter_dir = pair
    full = load_drafter(drafter_dir, 64, 4, VOCAB, torch.device("cpu"), torch.float32)
    quant = load_drafter(drafter_dir, 64, 4, VOCAB, torch.device("cpu"), torch.float32, quantize=mode)
    ids = torch.tensor(_prompts(20)[2])
    out = target(ids, target.new_cache(N_CTX), capture=tuple(TARGET_LAYER_IDS))
    features = torch.cat([out.captured[i] for i in TARGET_LAYER_IDS], -1)
    block = target.embed_tokens.weight[torch.tensor([5] + [MASK_ID] * (BLOCK - 1))]
    results = []
    for d in (full, quant):
        cache = d.new_cache(N_CTX)
        d.append_context(features, cache)
        results.append(d.draft(block, cache))
    rel = (results[0] - results[1]).norm() / results[0].norm()
    assert rel < (0.05 if mode == "q8" else 0.3)
    weight_bytes = sum(b.numel() * b.element_size() for n, b in quant.named_buffers() if n.endswith("qweight"))
    full_bytes = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if "proj" in n or "fc" in n)
    assert weight_bytes <= full_bytes / (4 if mode == "q8" else 6)  # q4 pads rows to groups of 32


def test_stop_token_and_string_inside_a_block(pair):
    """A stop met in the middle of an accepted block ends the output exactly where plain decoding ends it."""
    from dflash_agent.engine import StopCriteria

    _, _, target, drafter, _ = pair
    prompt = _prompts(20)[8]
    plain, _ = _decode(target, None, prompt, 30, SpecConfig(enabled=False))
    stop_token = plain[12]
    tokenizer = word_tokenizer(VOCAB)
    stop_string = tokenizer.decode(plain[7:9])

    def run(spec, stop):
        engine = Engine(target, tokenizer, N_CTX, drafter=drafter if spec.enabled else None, spec=spec)

        async def go():
            return [e async for e in engine.generate(GenerateRequest(prompt, stop=stop, max_tokens=30))]

        try:
            return asyncio.run(go())
        finally:
            engine.close()

    for stop in (StopCriteria(token_ids=frozenset({stop_token})), StopCriteria(strings=(stop_string,))):
        with_spec = run(SpecConfig(block=BLOCK), stop)
        without = run(SpecConfig(enabled=False), stop)
        assert _text(with_spec) == _text(without)
        assert with_spec[-1].finish_reason == without[-1].finish_reason == "stop"
        assert with_spec[-1].stop == without[-1].stop
        assert with_spec[-1].usage.completion_tokens == without[-1].usage.completion_tokens


def _text(events):
    return "".join(e.text_delta for e in events[:-1])


def _simulate(controller: DraftPolicy, seconds: dict, tokens: dict, steps: int) -> dict:
    """Play `steps` steps with fixed per-arm step times and committed tokens; returns seconds spent per arm."""
    spent: Counter = Counter()
    for _ in range(steps):
        arm = controller.choose(ngram_available=True)
        controller.record(arm, tokens[arm], seconds[arm])
        spent[arm] += seconds[arm]
    return spent


def test_controller_stops_drafting_that_does_not_pay_and_bounds_exploration():
    """On a CPU a verified block costs several decode steps: with drafts that rarely land, the controller
    settles on plain decoding, and re-measuring the other arms costs at most its exploration budget."""
    controller = DraftPolicy(15, drafter=True, ngram=True, fixed=None)
    arms = controller.arms
    assert arms == [Arm(Source.AR, 0), Arm(Source.DFLASH, 2), Arm(Source.DFLASH, 4), Arm(Source.DFLASH, 8),
                    Arm(Source.DFLASH, 15), Arm(Source.NGRAM, 4), Arm(Source.NGRAM, 8), Arm(Source.NGRAM, 15)]
    seconds = {Arm(Source.AR, 0): 0.02, Arm(Source.DFLASH, 2): 0.05, Arm(Source.DFLASH, 4): 0.06,
               Arm(Source.DFLASH, 8): 0.1, Arm(Source.DFLASH, 15): 0.2, Arm(Source.NGRAM, 4): 0.05,
               Arm(Source.NGRAM, 8): 0.08, Arm(Source.NGRAM, 15): 0.2}
    tokens = {arm: 1 if arm.source is Source.AR else 2 for arm in arms}
    spent = _simulate(controller, seconds, tokens, 4000)
    assert controller.bandit.samples(Arm(Source.DFLASH, 15)) < 10  # measured once, then rarely
    assert spent[Arm(Source.AR, 0)] / sum(spent.values()) > 0.95
    # time an arm spent, less what plain decoding would have taken for the tokens it committed
    wasted = sum(spent[a] * (1 - tokens[a] / seconds[a] * seconds[Arm(Source.AR, 0)]) for a in arms)
    # the exploration budget, plus measuring each of the 7 other arms at first
    assert wasted / sum(spent.values()) < DraftPolicy.EXPLORE_BUDGET + 0.015


def test_controller_returns_to_an_arm_that_starts_to_pay():
    controller = DraftPolicy(8, drafter=False, ngram=True, fixed=None)
    assert controller.arms == [Arm(Source.AR, 0), Arm(Source.NGRAM, 4), Arm(Source.NGRAM, 8)]
    seconds = {Arm(Source.AR, 0): 0.02, Arm(Source.NGRAM, 4): 0.04, Arm(Source.NGRAM, 8): 0.05}
    misses = {Arm(Source.AR, 0): 1, Arm(Source.NGRAM, 4): 1, Arm(Source.NGRAM, 8): 1}
    _simulate(controller, seconds, misses, 200)  # prompt lookup misses
    assert controller.choose(ngram_available=True) == Arm(Source.AR, 0)
    copying = {Arm(Source.AR, 0): 1, Arm(Source.NGRAM, 4): 4, Arm(Source.NGRAM, 8): 8}
    spent = _simulate(controller, seconds, copying, 400)
    assert spent[Arm(Source.NGRAM, 8)] > spent[Arm(Source.AR, 0)] + spent[Arm(Source.NGRAM, 4)]


def test_controller_measures_close_arms_more_than_once():
    controller = DraftPolicy(8, drafter=False, ngram=True, fixed=None)
    seconds = {Arm(Source.AR, 0): 0.02, Arm(Source.NGRAM, 4): 0.03, Arm(Source.NGRAM, 8): 0.1}
    _simulate(controller, seconds, {arm: 1 for arm in seconds}, 8)
    assert controller.bandit.samples(Arm(Source.NGRAM, 4)) >= DraftPolicy.MIN_SAMPLES  # 0.67x of the best: a closer look
    assert controller.bandit.samples(Arm(Source.NGRAM, 8)) == 1  # 0.2x: once is enough
