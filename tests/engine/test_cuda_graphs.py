"""The steps engine.backends.cuda captures, run eagerly on the CPU against the model's own forward.

Capturing needs CUDA; what can go wrong without it is the device-side plan the captured step makes
(padding to a bucket, positions from a buffer, the rings' slot map updated on the device, full caches
attended whole and masked by position). `capture_graph` is replaced by a stand-in whose replay runs the step
again and copies its outputs into the first run's tensors, which is what a graph replay amounts to.
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash_agent.engine.backends import cuda as cuda_graphs
from dflash_agent.engine.backends.cuda import BUCKETS, DraftStepGraph, TargetStepGraphs
from dflash_agent.engine.cache.drafter_cache import DrafterCache
from dflash_agent.engine.load.weights import build_model
from dflash_agent.engine.model.drafter import init_drafter_checkpoint, load_drafter
from dflash_agent.engine.runner import StepRunner
from tests.helpers.graphs import EagerGraph
from tests.helpers.packed import VOCAB, tiny_family_config, tiny_packed_checkpoint


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0)


@pytest.fixture(autouse=True)
def eager_capture(monkeypatch):
    def capture(step, pool):
        step()  # the warm-up run
        outputs = step()
        return EagerGraph(step, outputs), outputs

    monkeypatch.setattr(cuda_graphs, "capture_graph", capture)


@pytest.mark.parametrize("layout", ["dense", "ple"])
def test_target_steps_match_forward(layout) -> None:
    ckpt = tiny_packed_checkpoint(config=None if layout == "dense" else tiny_family_config(layout))
    eager = build_model(ckpt, "cpu", torch.float32, progress=False)
    model = build_model(ckpt, "cpu", torch.float32, progress=False)
    graphed = StepRunner(model, graphs=TargetStepGraphs(model))
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (80,))
    caches = [eager.new_cache(64), graphed.new_cache(64)]
    for model, cache in zip((eager, graphed), caches):
        model.forward(ids[:5], cache)  # prefill stays eager (no bucket fits 5 here: logits of the last token only)
    # decode steps and verify blocks of every padding amount, with captured layers and rollbacks, past the
    # window (8) and around the ring (8 + 16 slots)
    pos, step, held = 5, 0, []
    while pos < 56:
        T = [1, 3, 5, 1, 7, 16, 2][step % 7]
        block = ids[pos : pos + T]
        outs = [model.forward(block, cache, logits_at=torch.arange(T), capture=(0, 1))
                for model, cache in zip((eager, graphed), caches)]
        # float32; the two attend through different SDPA calls (masks vs positions), so sums round differently
        close(outs[1].logits, outs[0].logits)
        held.append((outs[1].logits, outs[0].logits))
        for layer in (0, 1):
            close(outs[1].captured[layer], outs[0].captured[layer])
        keep = max(1, T // 2)
        for cache in caches:
            cache.rollback(pos + keep)
        pos, step = pos + keep, step + 1
    for got, want in held:  # what each step returned, after the later ones wrote the graphs' logits buffer
        close(got, want)
    assert caches[1].length == caches[0].length == pos
    assert {bucket for _, bucket, _ in graphed.graphs.graphs} == set(BUCKETS)


def test_target_graphs_decline_what_they_cannot_replay() -> None:
    model = build_model(tiny_packed_checkpoint(), "cpu", torch.float32, progress=False)
    graphs = TargetStepGraphs(model)
    cache = model.new_cache(64)
    model(torch.arange(4), cache)
    assert graphs.replay(torch.arange(17), cache, None, ()) is None  # past the largest bucket
    assert graphs.replay(torch.arange(2), cache, torch.arange(0), ()) is None  # no logits wanted
    assert graphs.replay(torch.arange(4), cache, None, ()) is None  # one row of a block: the head's row, eagerly
    assert graphs.replay(torch.arange(1), cache, None, ()) is not None
    other = model.new_cache(64)  # another slot's cache: a graph of its own, beside the first
    assert graphs.replay(torch.arange(1), other, None, ()) is not None and other.length == 1
    assert {key[0] for key in graphs.graphs} == {id(cache), id(other)}
    near_end = model.new_cache(8)
    model(torch.arange(6), near_end)
    assert TargetStepGraphs(model).replay(torch.arange(3), near_end, torch.arange(3), ()) is None  # padding past max_len


@pytest.mark.parametrize("layout", ["dense", "moe", "ple"])
def test_several_requests_decode_rows_replay_a_graph_per_combination_of_caches(layout) -> None:
    """The slots' batched decode step as a graph (replay_groups): three caches at different lengths, past the window
    and around the rings, each row's logits, greedy pick and captured layers as the model's own forward of that cache
    alone gives; one graph per combination of caches (and captured layers), reused across steps; 26B-A4B's experts
    and E2B / E4B's per-layer inputs and shared K / V too."""
    from dflash_agent.engine.model.gemma import RowGroup

    ckpt = tiny_packed_checkpoint(config=None if layout == "dense" else tiny_family_config(layout))
    # float64: the two attend through different SDPA calls (the slots up to the cache's end under a mask, or the whole
    # cache masked by position), whose float32 sums differ by an ulp in the first layer's attention output, and E2B /
    # E4B's four layers (the shared K / V's attention the most) grow that to ~1e-5 of the logits (the CPU's vector
    # width decides by how much); in float64 each row comes out as its forward alone gives it, while a wrong mask or
    # a ring slot lost moves far more than the tolerance
    eager = build_model(ckpt, "cpu", torch.float64, progress=False)
    graphed = build_model(ckpt, "cpu", torch.float64, progress=False)
    graphs = TargetStepGraphs(graphed)
    torch.manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (3, 9, 20)]
    pairs = [(eager.new_cache(64), graphed.new_cache(64)) for _ in prompts]
    for prompt, (a, b) in zip(prompts, pairs, strict=True):
        eager(prompt, a)
        graphed(prompt, b)
    for step in range(12):
        members = [0, 1, 2] if step % 3 else [2, 0]  # two combinations, in the scheduler's order
        ids = torch.randint(0, VOCAB, (len(members),))
        greedy = [i == 1 for i in members]
        # the scheduler asks a decode row's logits as logits_at = [0]; None means the same
        groups = [RowGroup(ids[j:j + 1], pairs[i][1], torch.arange(1) if step % 2 else None, greedy=greedy[j])
                  for j, i in enumerate(members)]
        outs = graphs.replay_groups(groups, (0,))
        assert outs is not None
        for j, i in enumerate(members):
            want = eager(ids[j:j + 1], pairs[i][0], capture=(0,))
            close(outs[j].captured[0], want.captured[0])
            if greedy[j]:
                assert outs[j].tokens == [int(want.logits.argmax())]
            else:
                close(outs[j].logits, want.logits)
    assert [a.length for a, _ in pairs] == [b.length for _, b in pairs] == [15, 17, 32]
    assert [b.ring_pos.tolist() for _, b in pairs] == [a.ring_pos.tolist() for a, _ in pairs]
    assert len(graphs.group_graphs) == 2
    assert graphs.replay_groups([RowGroup(torch.arange(1), pairs[1][1])], ()) is None  # one request: replay's graphs
    no_logits = [RowGroup(torch.arange(1), pairs[0][1], torch.arange(0)), RowGroup(torch.arange(1), pairs[1][1])]
    assert graphs.replay_groups(no_logits, ()) is None
    # a MoE block's tiles by expert are sized on the host, so its blocks run eagerly, alone or beside decode rows
    block = [RowGroup(torch.arange(2), pairs[0][1], torch.arange(2)), RowGroup(torch.arange(1), pairs[1][1])]
    assert (graphs.replay_groups(block, ()) is None) == (layout == "moe")
    assert (graphs.replay(torch.arange(2), pairs[2][1], torch.arange(2), ()) is None) == (layout == "moe")


@pytest.mark.parametrize("layout", ["dense", "ple"])
def test_verification_blocks_beside_decode_rows_replay_a_graph_per_combination(monkeypatch, layout) -> None:
    """Several requests' verification blocks (2..16 tokens, each padded to its bucket) and decode rows in one graph:
    each group's logits, greedy picks and captured layers as its cache's forward alone gives them, after rollbacks of
    the rejected drafts as the scheduler's commit makes them, past the window and around the rings (whose slots the
    padding writes), for blocks asking some of their rows in any order, and steps of blocks only; one graph per
    combination of caches and their rows' buckets, the least recently used dropped past MAX_GROUP_GRAPHS; every
    graph's logits in one buffer of a block a slot, while what a replay returned stays as it was after the next."""
    from dflash_agent.engine.model.gemma import RowGroup

    monkeypatch.setattr(cuda_graphs, "MAX_GROUP_GRAPHS", 4)
    capture, captured = cuda_graphs.capture_graph, []
    monkeypatch.setattr(cuda_graphs, "capture_graph", lambda step, pool: captured.append(step) or capture(step, pool))
    ckpt = tiny_packed_checkpoint(config=None if layout == "dense" else tiny_family_config(layout))
    # float64: a CPU GEMM rounds float32 sums by how many rows it is given, which the padding changes (a GPU's tile
    # does not: tests/kernels), while a wrong mask or a ring slot lost to the padding moves far more than that
    eager = build_model(ckpt, "cpu", torch.float64, progress=False)
    graphed = build_model(ckpt, "cpu", torch.float64, progress=False)
    graphs = TargetStepGraphs(graphed, slots=3)
    torch.manual_seed(5)
    pairs = [(eager.new_cache(128), graphed.new_cache(128)) for _ in range(3)]
    for n, (a, b) in zip((4, 11, 2), pairs, strict=True):
        prompt = torch.randint(0, VOCAB, (n,))
        eager(prompt, a)
        graphed(prompt, b)
    # each step's tokens per cache: steps 0 and 2 form one combination of buckets with blocks of other lengths
    lengths = [[1, 3, 16], [5, 2, 3], [1, 4, 13], [1, 16, 1], [9, 4, 1], [2, 1, 7]]
    kinds, captures, held = [], 0, []
    for step in range(25):
        sizes = lengths[step % len(lengths)]
        members = [2, 0, 1] if step % 2 else [0, 1, 2]  # the scheduler's order, not the graph's
        groups = []
        for i in members:
            T = sizes[i]
            asked = torch.arange(T) if T == 1 or step % 3 else torch.arange(T).flip(0)[:max(2, T // 2)]
            groups.append(RowGroup(torch.randint(0, VOCAB, (T,)), pairs[i][1],
                                   None if T == 1 and step % 3 == 0 else asked, greedy=(i + step) % 2 == 0))
        kind = [(i, BUCKETS.index(next(b for b in BUCKETS if b >= sizes[i])))
                for i in sorted(members, key=lambda i: sizes[i] > 1)]
        captures += kind not in kinds[-4:]
        kinds = [k for k in kinds if k != kind] + [kind]
        outs = graphs.replay_groups(groups, (0, 1))
        assert outs is not None
        for group, out, i in zip(groups, outs, members, strict=True):
            eager_cache, graphed_cache = pairs[i]
            T = group.ids.shape[0]
            want = eager(group.ids, eager_cache, logits_at=group.logits_at, capture=(0, 1))
            for layer in (0, 1):
                close(out.captured[layer], want.captured[layer])
            if group.greedy:
                assert out.tokens == want.logits.argmax(-1).tolist()
            else:
                close(out.logits, want.logits)
                held.append((out.logits, want.logits))
            assert graphed_cache.length == eager_cache.length
            keep = max(1, T // 2)  # the verified prefix a commit keeps
            for cache in pairs[i]:
                cache.rollback(cache.length - T + keep)
            assert graphed_cache.rings_hold(graphed_cache.length)
    for got, want in held:  # not views of the buffer the later replays wrote
        close(got, want)
    assert [a.length for a, _ in pairs] == [b.length for _, b in pairs]
    assert min(a.length for a, _ in pairs) > 24 + 8  # around every ring (8 + 16 slots) and past the window
    assert len(graphs.group_graphs) == 4 and len(captured) == captures < 25
    # one buffer of a block a slot, made once (the memory plan's)
    assert graphs.logits.shape[0] == 3 * BUCKETS[-1]
    assert {g.logits.untyped_storage().data_ptr() for g in graphs.group_graphs.values()} == {graphs.logits.data_ptr()}

    cache = pairs[0][1]

    def beside_a_row(block: RowGroup) -> list[RowGroup]:
        return [block, RowGroup(torch.arange(1), pairs[1][1])]

    # a block asking one row's logits of a dense head runs eagerly (its GEMM may choose a kernel by the rows; a packed
    # head's replays, tests/kernels/test_packed_model.py); a block past the cache's end declines too
    assert graphs.replay_groups(beside_a_row(RowGroup(torch.arange(3), cache)), ()) is None
    near_end = graphed.new_cache(cache.length + 3)
    graphed(torch.arange(cache.length), near_end)
    assert graphs.replay_groups(beside_a_row(RowGroup(torch.arange(3), near_end, torch.arange(3))), ()) is None
    assert graphs.replay_groups(beside_a_row(RowGroup(torch.arange(17), cache, torch.arange(17))), ()) is None


@pytest.mark.parametrize("bounded", [False, True], ids=["whole context", "draft-ctx"])
def test_draft_graph_matches_drafter(tmp_path, bounded) -> None:
    ckpt = tiny_packed_checkpoint()
    target = build_model(ckpt, "cpu", torch.float32, progress=False)
    cfg = ckpt.config
    # two causal sliding layers with a window shorter than the context, then a bidirectional full layer
    path = init_drafter_checkpoint(tmp_path / "drafter", cfg.hidden_size, cfg.num_layers, mask_token_id=1,
                                   num_layers=3, block_size=6, sliding_window=4)
    raw = json.loads((path / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [0, 1, 1]  # the default rule is meant for deeper targets
    (path / "config.json").write_text(json.dumps(raw))
    drafter = load_drafter(path, cfg.hidden_size, cfg.num_layers, cfg.vocab_size, torch.device("cpu"),
                           torch.float32)
    if bounded:  # the full layer bidirectional over a window too, counted back from the block's last position
        drafter = drafter.with_context_window(8)
    # rings of the window and a block's slack: the context wraps them, and the block's keys overwrite their oldest
    cache = DrafterCache(drafter.config, 64, torch.device("cpu"), torch.float32, slack=6)
    assert cache.ring_slots == (14 if bounded else 10)
    features = torch.randn(11, len(drafter.config.target_layer_ids) * cfg.hidden_size)
    drafter.append_context(features, cache)
    graph = DraftStepGraph(drafter, target.output_weight, cache, block=6)
    for anchor in (3, 50):
        length = cache.length
        block = torch.tensor([anchor] + [1] * 5)
        embeds = target.embed_tokens.weight[block]
        want = drafter.logits(drafter.draft(embeds, cache)[1:], target.output_weight).argmax(-1)
        assert torch.equal(graph.draft(embeds), want)
        assert cache.length == length  # the block is not committed
        # nor does it disturb what an eager draft reads: the window before it, not the block's slots
        assert torch.equal(drafter.logits(drafter.draft(embeds, cache)[1:], target.output_weight).argmax(-1), want)
        drafter.append_context(features[:3], cache)  # the next context overwrites the block's slots
