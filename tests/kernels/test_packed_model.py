"""The CUDA code path of the model, run on the CPU through Triton's interpreter: packed GGUF weights through
kernels.triton.quant_matmul and attention through kernels.attention (model.Attention's kernel dispatch, by
positions), against the plain CPU model (dequantized weights, SDPA with masks)."""

from __future__ import annotations

import pytest
import torch

from dflash_agent.engine.load.weights import build_model
from dflash_agent.engine.runner import StepRunner
from dflash_agent.kernels.dispatch import CPU_KERNELS_ENV
from tests.helpers.packed import run_steps, tiny_family_config, tiny_packed_checkpoint


@pytest.mark.parametrize("cache_kind", ["model", "q8"])
def test_kernel_path_matches_cpu_model(kernels, cache_kind) -> None:
    ckpt = tiny_packed_checkpoint()
    packed = build_model(ckpt, kernels.device, torch.float32, progress=False, packed=True)
    kernel_logits = [logits.cpu() for logits in run_steps(packed, cache_kind)]
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(CPU_KERNELS_ENV, raising=False)  # the reference: the engine's own CPU path
        plain = build_model(ckpt, "cpu", torch.float32, progress=False)
        expected = run_steps(plain, cache_kind)
    for got, want in zip(kernel_logits, expected, strict=True):
        # float32 throughout; only the order of the sums differs (the q8 cache is the same int8 either way)
        torch.testing.assert_close(got, want, atol=2e-5 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("kind", ["moe", "ple"])
def test_gemma4_family_on_the_kernel_path(kernels, kind) -> None:
    """26B-A4B's experts (two grouped launches a layer: decode steps' GEMV rows, longer steps' tiles by expert) and
    E2B / E4B's per-layer inputs and shared KV on the kernel path, against the plain CPU model."""
    ckpt = tiny_packed_checkpoint(config=tiny_family_config(kind))
    packed = build_model(ckpt, kernels.device, torch.float32, progress=False, packed=True)
    qm, grouped = kernels.load("triton.quant_matmul"), []
    launch = qm.grouped_quant_matmul
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qm, "grouped_quant_matmul", lambda *a: grouped.append(a[-1]) or launch(*a))
        kernel_logits = [logits.cpu() for logits in run_steps(packed)]
    # run_steps: a prefill, a decode step, a verify block and another decode step, over 2 MoE layers
    assert grouped == ([False] * 4 + [True] * 4 + [False] * 4 + [True] * 4 if kind == "moe" else [])
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(CPU_KERNELS_ENV, raising=False)
        plain = build_model(ckpt, "cpu", torch.float32, progress=False)
        expected = run_steps(plain)
    for got, want in zip(kernel_logits, expected, strict=True):
        # a token's FFN sums the dense MLP's and its experts' outputs, each in the kernels' own order
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)



@pytest.mark.parametrize("kind,kv_dtype", [("dense", "model"), ("dense", "q8"), ("moe", "model"), ("ple", "model")])
def test_several_sequences_in_one_step_come_out_as_each_alone(kernels, kind, kv_dtype) -> None:
    """forward_groups on the Triton kernels (concurrent requests' slots): one forward over three sequences' decode rows
    and verification blocks, in the scheduler's order (a block before decode rows), the decode rows and the blocks
    in shared 16-row tiles (a MoE's decode rows in one grouped GEMV launch): every logit and greedy pick bit for bit what each group's forward
    alone gives, over the dense layout, 26B-A4B's experts (a float32 router: a matmul per sequence) and E2B / E4B's
    per-layer inputs and shared KV; the decode rows attend each its own cache in one launch a layer
    (JointAttention), int8 caches too. Three steps from empty caches, so the later ones attend to what the first
    wrote, the last all decode rows at three lengths; the family's layouts and int8 caches take the first step only
    (the interpreter takes 5-20 s a forward)."""
    from dflash_agent.engine.model import gemma as model_module
    from dflash_agent.engine.model.gemma import RowGroup

    config = None if kind == "dense" else tiny_family_config(kind)
    model = build_model(tiny_packed_checkpoint(config=config), kernels.device, torch.float32, progress=False,
                        packed=True)
    for layer in model.layers:  # a MoE GGUF's routers are float32 matrices (llama.cpp's ffn_gate_inp)
        if layer.experts is not None:
            layer.router.proj.weight = layer.router.proj.weight.packed.dequantize(torch.float32)
    torch.manual_seed(3)
    steps = [  # (new tokens, logits_at, greedy) per sequence
        [(3, torch.arange(3), False), (1, None, True), (1, None, False)],
        [(1, torch.arange(0), True), (2, torch.tensor([1]), True), (4, torch.tensor([0, 3]), False)],
        [(1, None, True), (1, torch.arange(1), False), (1, None, False)],
    ]  # the second step's first row asks for no logits: neither logits nor picks come back, as from forward
    if kind == "moe":  # two blocks beside a decode row: each block's experts take tiles of their own
        steps = [[(3, torch.arange(3), False), (1, None, True), (2, torch.arange(2), False)]]
    elif kind == "ple" or kv_dtype == "q8":  # two decode rows: one attention launch over their caches (shared too)
        steps = [steps[0]]
    batched, alone = ([model.new_cache(16, kv_dtype) for _ in steps[0]] for _ in range(2))
    joint_rows = []
    attend = model_module.rows_cache_attention
    for step in steps:
        ids = [torch.randint(0, 64, (n,), device=kernels.device) for n, _, _ in step]
        groups = [RowGroup(i, cache, None if a is None else a.to(kernels.device), greedy)
                  for i, cache, (_, a, greedy) in zip(ids, batched, step, strict=True)]
        assert StepRunner(model).batches(groups)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_module, "rows_cache_attention", lambda q, *a: joint_rows.append(len(q)) or attend(q, *a))
            together = StepRunner(model).forward_groups(groups)
        for got, i, cache, (_, a, greedy) in zip(together, ids, alone, step, strict=True):
            want = model(i, cache, None if a is None else a.to(kernels.device), greedy=greedy)
            assert got.tokens == want.tokens
            assert (got.logits is None) == (want.logits is None)
            assert got.logits is None or torch.equal(got.logits, want.logits)
        assert [c.length for c in batched] == [c.length for c in alone]
    decode_rows = [sum(n == 1 for n, _, _ in step) for step in steps]
    assert joint_rows == [n for n in decode_rows if n > 1 for _ in model.layers]


def test_slots_graph_attends_decode_rows_in_one_launch_beside_a_padded_block(kernels, monkeypatch) -> None:
    """The slots' graph (cuda_graphs.replay_groups) on the Triton kernels: the decode rows' plans, made on the device,
    joined into one attention launch a layer over each row's whole cache (JointAttention), beside another request's
    verification block padded to its bucket (3 tokens to 4; padded to 16, the attention's row tile would change);
    every logit bit for bit what the eager step of its cache alone gives, one ring wrapped."""
    from dflash_agent.engine.backends import cuda as cuda_graphs
    from dflash_agent.engine.model import gemma as model_module
    from dflash_agent.engine.model.gemma import RowGroup
    from tests.helpers.graphs import EagerGraph

    # a capture computes the step once (CUDA's warm-up run does); each replay computes it again
    monkeypatch.setattr(cuda_graphs, "capture_graph", lambda step, pool: (EagerGraph(step, out := step()), out))
    model = build_model(tiny_packed_checkpoint(), kernels.device, torch.float32, progress=False, packed=True)
    torch.manual_seed(6)
    pairs = []
    for n in (5, 27, 9):  # the rings hold 24 slots
        eager, graphed = model.new_cache(48), model.new_cache(48)
        model(torch.randint(0, 64, (n,), device=kernels.device), eager)
        graphed.restore(n, eager.full_snapshot(n, kernels.device), eager.ring_snapshot(kernels.device))
        pairs.append((eager, graphed))
    joint_rows = []
    attend = model_module.rows_cache_attention
    monkeypatch.setattr(model_module, "rows_cache_attention", lambda q, *a: joint_rows.append(len(q)) or attend(q, *a))
    ids = [torch.randint(0, 64, (n,), device=kernels.device) for n in (1, 3, 1)]  # the scheduler's order
    asked = [None, torch.arange(3, device=kernels.device), None]
    outs = cuda_graphs.TargetStepGraphs(model).replay_groups(
        [RowGroup(i, graphed, a) for i, a, (_, graphed) in zip(ids, asked, pairs, strict=True)], ())
    assert outs is not None and joint_rows == [2] * (2 * len(model.layers))  # the capture and the replay
    for i, (eager, graphed) in enumerate(pairs):
        assert torch.equal(outs[i].logits, model(ids[i], eager, asked[i]).logits)
        assert graphed.length == eager.length
    for eager, graphed in pairs[::2]:  # the block's padding leaves positions past its end in its ring
        assert graphed.ring_pos.tolist() == eager.ring_pos.tolist()
    # a block asking one row's logits (a prompt's last chunk beside decode rows) replays a graph too: the packed
    # head takes its one row in the 16-row tile, as alone
    ids = [torch.randint(0, 64, (n,), device=kernels.device) for n in (1, 3)]
    asked = [None, torch.tensor([2], device=kernels.device)]
    groups = [RowGroup(i, graphed, a) for i, a, (_, graphed) in zip(ids, asked, pairs, strict=False)]
    outs = cuda_graphs.TargetStepGraphs(model).replay_groups(groups, ())
    assert outs is not None
    for i, (eager, _) in enumerate(pairs[:2]):
        assert torch.equal(outs[i].logits, model(ids[i], eager, asked[i]).logits)


@pytest.mark.parametrize("kind,kv_dtype", [("dense", "model"), ("dense", "q8"), ("moe", "model"), ("ple", "model")])
def test_graphs_captured_on_a_gpu_replay_what_eager_steps_give(kernels, kind, kv_dtype) -> None:
    """Real CUDA-graph captures (the other graph tests stand an eager replay in for one): a slot's own decode step and
    verification block, several slots' decode rows, and blocks beside decode rows, the combinations formed again
    replaying their graphs over caches that have moved on, after rollbacks; every logit and captured layer bit for bit
    what the eager step of its cache alone gives. What only a capture shows: a host synchronisation in the step, or a
    length or position baked in when it was captured. 26B-A4B's layout captures its decode steps only (its blocks'
    tiles by expert are sized on the host); E2B / E4B's captures all."""
    if kernels.device.type != "cuda":
        pytest.skip("captures CUDA graphs")
    from dflash_agent.engine.backends.cuda import TargetStepGraphs
    from dflash_agent.engine.model.gemma import RowGroup

    device = kernels.device
    config = None if kind == "dense" else tiny_family_config(kind)
    model = build_model(tiny_packed_checkpoint(config=config), device, torch.float32, progress=False, packed=True)
    graphs = TargetStepGraphs(model, slots=3)
    torch.manual_seed(7)
    pairs = []
    for n in (5, 27, 9):  # the rings hold 24 slots
        eager, graphed = model.new_cache(96, kv_dtype), model.new_cache(96, kv_dtype)
        model(torch.randint(0, 64, (n,), device=device), eager)
        graphed.restore(n, eager.full_snapshot(n, device), eager.ring_snapshot(device))
        pairs.append((eager, graphed))
    steps = [[1], [3], [1, 1, 1], [1, 4, 1], [1], [3], [1, 1, 1], [2, 1, 7], [1, 3, 1], [1, 1, 1]]  # tokens per cache
    if kind == "moe":
        steps = [sizes for sizes in steps if max(sizes) == 1]
    for sizes in steps:
        ids = [torch.randint(0, 64, (n,), device=device) for n in sizes]
        # a block of 3 asks its last row's logits only (a prompt's last chunk): graphed too, the head being packed
        asked = [torch.arange(n, device=device) if n != 3 else torch.tensor([2], device=device) for n in sizes]
        if len(sizes) == 1:
            outs = [graphs.replay(ids[0], pairs[0][1], asked[0], (0,))]
        else:
            outs = graphs.replay_groups([RowGroup(i, graphed, a) for i, a, (_, graphed) in
                                         zip(ids, asked, pairs, strict=False)], (0,))
        assert outs is not None and all(out is not None for out in outs), sizes
        for out, i, a, n, (eager, graphed) in zip(outs, ids, asked, sizes, pairs, strict=False):
            want = model(i, eager, a, capture=(0,))
            assert torch.equal(out.logits, want.logits) and torch.equal(out.captured[0], want.captured[0]), sizes
            assert graphed.length == eager.length
            for cache in (eager, graphed):  # a commit keeps the verified prefix
                cache.rollback(cache.length - n + max(1, n // 2))
    assert (len(graphs.graphs), len(graphs.group_graphs)) == ((1, 1) if kind == "moe" else (2, 3))


def test_decode_rows_attend_apart_where_alone_they_would_not_take_the_kernel(kernels, monkeypatch) -> None:
    """GemmaModel.joint_offsets joins the decode rows' attention only where each row alone takes the same Triton
    kernel: not in eager steps whose full layers would go to flash-attn (a graphed step attends by position, so it
    still joins; int8 caches never go there), nor over caches of another layout."""
    from dflash_agent.engine.model import gemma as model_module

    model = build_model(tiny_packed_checkpoint(), kernels.device, torch.float32, progress=False, packed=True)
    caches, q8 = [model.new_cache(16) for _ in range(2)], [model.new_cache(16, "q8") for _ in range(2)]
    offsets = model.joint_offsets(caches, eager=True)
    assert offsets is not None and offsets.shape == (len(model.layers), 2, 4) and not offsets[:, 0].any()
    monkeypatch.setattr(model_module, "flash_attn_takes", lambda *args: True)
    assert model.joint_offsets(caches, eager=True) is None
    assert model.joint_offsets(caches, eager=False) is not None and model.joint_offsets(q8, eager=True) is not None
    assert model.joint_offsets([*caches, model.new_cache(24)], eager=False) is None
    assert model.joint_offsets([caches[0], q8[0]], eager=False) is None
