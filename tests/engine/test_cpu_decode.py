"""engine.backends.cpu: decode and verify steps through the C decoder layer (kernels/cpu/cpu_layer.c) give what the
eager layers give on the same repacked weights, row for row, on Gemma 4's structure (two head sizes, shared
keys and values, value norms, layer scalars, a sliding ring), on 26B-A4B's routed experts, on E2B / E4B's per-layer
inputs and shared K / V, and on the embedded Gemma 3."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from dflash_agent.engine.backends.cpu import SCREEN_SIMD, CpuDecodeLayers
from dflash_agent.engine.formats.quant import dequantize
from dflash_agent.engine.limits import MAX_ROWS
from dflash_agent.engine.load.weights import build_model
from dflash_agent.engine.model.gemma import RowGroup
from dflash_agent.engine.model.packed import PackedWeight, cpu_dot
from dflash_agent.engine.runner import StepRunner
from tests.helpers.packed import VOCAB, run_steps, tiny_family_config, tiny_packed_checkpoint

pytestmark = pytest.mark.skipif(cpu_dot() is None, reason="no C compiler: the CPU kernels cannot be built")


@pytest.fixture(scope="module")
def tiny() -> StepRunner:
    return _runner(tiny_packed_checkpoint())


def _runner(ckpt) -> StepRunner:
    """The step runner of a checkpoint repacked for the C layers, with them."""
    return StepRunner.build(build_model(ckpt, "cpu", torch.float32, progress=False, repack_cpu=True))


def _eager(runner: StepRunner, cache_kind: str = "model"):
    """run_steps on the same model and weights without the C layers."""
    return run_steps(StepRunner(runner.model), cache_kind)


def test_c_layers_match_the_eager_layers_on_gemma4_structure(tiny, monkeypatch):
    config = tiny.config
    assert tiny.cpu is not None
    assert {s.head_dim for s in config.layers} == {64, 128} and any(s.k_eq_v for s in config.layers)
    assert config.v_norm and config.layer_scalar
    calls = []
    forward = CpuDecodeLayers.forward
    monkeypatch.setattr(CpuDecodeLayers, "forward", lambda self, *a: calls.append(a[0].shape[0]) or forward(self, *a))
    c_steps = run_steps(tiny)
    assert calls == [13, 1, 5, 1]  # prefill, decode, a verify block, decode after a rollback: all in C
    for c, eager in zip(c_steps, _eager(tiny), strict=True):
        # float rounding in another order, which can move an activation across an int16 rounding step: measured
        # 5e-5 to 1.1e-4 relative; a wrong norm, RoPE or mask gives 1e-1 and more
        assert (c - eager).norm() / eager.norm() < 1e-3
        assert torch.equal(c.argmax(-1), eager.argmax(-1))


def _family_model(kind: str, float_router: bool = False):
    """tiny_family_config's layout ("moe": 26B-A4B's routed experts; "ple": E2B / E4B's per-layer inputs and shared
    K / V), packed and repacked; float_router: the router's matrix kept in float, as llama.cpp's converter and
    quantizer keep it."""
    ckpt = tiny_packed_checkpoint(config=tiny_family_config(kind))
    if float_router:
        for name, tensor in list(ckpt.tensors.items()):
            if name.endswith("router.proj.weight"):
                ckpt.tensors[name] = dequantize(tensor.raw, tensor.qtype, tensor.shape).float()
    return _runner(ckpt)


@pytest.mark.parametrize(("kind", "float_router"), [("moe", False), ("moe", True), ("ple", False)],
                         ids=["moe", "moe-float-router", "ple"])
def test_c_layers_match_the_eager_layers_on_the_gemma4_family(kind, float_router, monkeypatch):
    """26B-A4B's layers (router, routed experts beside the dense MLP, their three extra norms) and E2B / E4B's (the
    per-layer input, layers reading their owner's K / V, the double-wide MLPs) in the C call: every step of
    run_steps goes there and gives the eager layers' logits."""
    model = _family_model(kind, float_router)
    assert model.cpu is not None
    if kind == "moe":
        assert isinstance(model.model.layers[0].router.proj.weight, PackedWeight) != float_router
    else:
        assert model.model.layers[3].self_attn.k_proj is None and model.config.per_layer_input
    calls = []
    forward = CpuDecodeLayers.forward
    monkeypatch.setattr(CpuDecodeLayers, "forward", lambda self, *a: calls.append(a[0].shape[0]) or forward(self, *a))
    c_steps = run_steps(model)
    assert calls == [13, 1, 5, 1]
    for c, eager in zip(c_steps, _eager(model), strict=True):
        # measured: MoE 4e-5 to 8e-5, PLE up to 7e-4 (its eager steps differ as much from the model dequantized at
        # load); a wrong expert, norm or shared key gives 1e-1
        assert (c - eager).norm() / eager.norm() < 2e-3
        assert torch.equal(c.argmax(-1), eager.argmax(-1))


@pytest.mark.parametrize("model_name", ["tiny", "moe", "ple"])
def test_a_verified_block_gives_what_token_by_token_decoding_gives(model_name, tiny):
    """Every row of a verified block (through each MoE expert with the rows that chose it, through shared K / V in
    one call) gives the logits of decoding it alone."""
    model = tiny if model_name == "tiny" else _family_model(model_name)
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (40,))
    block = model.new_cache(64)
    model.forward(ids[:12], block)
    together = model.forward(ids[12:40], block, logits_at=torch.arange(28)).logits
    single = model.new_cache(64)
    model.forward(ids[:12], single)
    alone = torch.cat([model.forward(ids[i:i + 1], single).logits for i in range(12, 40)])
    assert torch.equal(together, alone)


def test_attention_over_many_key_chunks_matches_eager_and_any_block_size(tiny):
    """A context of several of cpu_layer.c's key chunks (64 slots each, merged per query): decode and a verified
    block agree bit for bit, and both agree with the eager layers' attention."""
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (170,))

    def logits(block: int, runner: StepRunner = tiny) -> torch.Tensor:
        cache = runner.new_cache(256)
        runner.forward(ids[:150], cache)
        return torch.cat([runner.forward(ids[i:i + block], cache, logits_at=torch.arange(block)).logits
                          for i in range(150, 170, block)])

    one, four, five = logits(1), logits(4), logits(5)
    assert torch.equal(one, four) and torch.equal(one, five)
    eager = logits(1, StepRunner(tiny.model))
    assert (one - eager).norm() / eager.norm() < 1e-3


def test_an_int8_cache_and_long_blocks_stay_on_the_eager_layers(tiny, monkeypatch):
    assert not CpuDecodeLayers.takes(1, tiny.new_cache(64, kv_dtype="q8").layers)
    assert not CpuDecodeLayers.takes(MAX_ROWS + 1, tiny.new_cache(256).layers)
    assert CpuDecodeLayers.takes(MAX_ROWS, tiny.new_cache(256).layers)
    calls = []
    forward = CpuDecodeLayers.forward
    monkeypatch.setattr(CpuDecodeLayers, "forward", lambda self, *a: calls.append(a[0].shape[0]) or forward(self, *a))
    q8_steps = run_steps(tiny, "q8")
    assert calls == []
    for c, eager in zip(q8_steps, _eager(tiny, "q8"), strict=True):  # the final norm and head ran in C
        # C's norm sums in another order than torch's, so an int16 activation of the head may round a step apart
        # (1/32767 of its block's largest): 2e-5 seen on a Zen 4 whose torch kernels are AVX-512 ones
        assert (c - eager).norm() / eager.norm() < 1e-4
        assert torch.equal(c.argmax(-1), eager.argmax(-1))


def test_the_final_norm_and_head_run_in_one_c_call_for_a_few_rows(tiny):
    hidden = torch.randn(5, tiny.config.hidden_size)
    fused = tiny.cpu.logits(hidden)
    assert fused is not None and fused.shape == (5, tiny.config.vocab_size)
    torch.testing.assert_close(fused, F.linear(tiny.model.norm(hidden), tiny.model.output_weight), rtol=1e-5,
                               atol=1e-5)
    for row in range(5):  # each row alone gives the same bits (verify steps give what decode steps give)
        assert torch.equal(tiny.cpu.logits(hidden[row:row + 1]), fused[row:row + 1])
    assert tiny.cpu.logits(torch.randn(MAX_ROWS + 1, tiny.config.hidden_size)) is None  # prefill: GEMM


def test_exact_weights_have_no_c_layers():
    ckpt = tiny_packed_checkpoint()
    assert StepRunner.build(build_model(ckpt, "cpu", torch.float32, progress=False)).cpu is None
    assert StepRunner.build(build_model(ckpt, "cpu", torch.bfloat16, progress=False, repack_cpu=True)).cpu is None


def test_embedded_model_decodes_the_same_tokens_through_the_c_layers(embedded_model):
    model = embedded_model
    assert model.cpu is not None
    prompt = torch.tensor([2, 818, 5279, 529, 506, 9893, 3298, 496, 236743] * 6)

    def greedy(runner: StepRunner, n: int) -> tuple[list[int], torch.Tensor]:
        cache = runner.new_cache(256)
        logits = runner.forward(prompt, cache).logits
        tokens, rows = [], []
        for _ in range(n):
            tokens.append(int(logits.argmax()))
            logits = runner.forward(torch.tensor(tokens[-1:]), cache).logits
            rows.append(logits)
        return tokens, torch.cat(rows)

    c_tokens, c_logits = greedy(model, 24)
    eager_tokens, eager_logits = greedy(StepRunner(model.model), 24)
    assert c_tokens == eager_tokens
    assert (c_logits - eager_logits).abs().max() < 0.05  # logits of order 10-30; float rounding order differs


def test_a_cache_shorter_than_the_window_still_decodes_through_the_c_layers(tiny, monkeypatch):
    """A ring as long as the cache never wraps, so decode steps take the C layers (the embedded model's
    window is 512: any shorter context is such a cache)."""
    calls = []
    forward = CpuDecodeLayers.forward
    monkeypatch.setattr(CpuDecodeLayers, "forward", lambda self, *a: calls.append(a[0].shape[0]) or forward(self, *a))
    ids = torch.arange(20) % VOCAB

    def steps(runner: StepRunner) -> torch.Tensor:
        cache = runner.new_cache(20)  # shorter than window + slack: the ring is the whole cache
        assert cache.ring_slots == cache.max_len
        rows = [runner.forward(ids[:12], cache).logits]
        rows += [runner.forward(ids[i:i + 1], cache).logits for i in range(12, 20)]
        return torch.cat(rows)

    c = steps(tiny)
    assert calls == [12] + [1] * 8
    eager = steps(StepRunner(tiny.model))
    assert (c - eager).norm() / eager.norm() < 1e-3 and torch.equal(c.argmax(-1), eager.argmax(-1))


def test_blocks_a_ring_cannot_take_stay_on_the_eager_plan(tiny, monkeypatch):
    """More new tokens than a ring's slack + 1: the sliding layers need the eager "prefill" plan, so the full layers
    keep the eager plan too (not the kernel plan, whose CPU fallback copies keys per head)."""
    calls = []
    monkeypatch.setattr(CpuDecodeLayers, "forward", lambda self, *a: calls.append(a))
    cache = tiny.new_cache(256)
    T = cache.slack + 2
    assert cache.ring_slots < cache.max_len and CpuDecodeLayers.takes(T, cache.layers)
    assert tiny.step_rows(cache) == T - 1
    plan = tiny.model.plan(cache, torch.arange(T), 0, T, c_layers=True)
    assert (plan.full.mode, plan.sliding.mode) == ("cache", "prefill")
    tiny.forward(torch.arange(T) % VOCAB, tiny.new_cache(256))
    assert calls == []


def test_the_c_layers_hold_every_tensor_they_point_into(tiny):
    """The structs keep bare pointers: a weight re-placed (an arena, a reloaded state dict) after build must not
    free memory C still reads."""
    layers = tiny.cpu
    kept = {t.data_ptr() for t in layers._keep}
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down")
    matrices = [getattr(weights, name) for weights in layers.layers for name in names] + [layers._head[1]]
    for matrix in matrices:
        assert {p for p in (matrix.q, matrix.qh, matrix.d, matrix.m) if p} <= kept


def test_a_write_slot_outside_the_cache_is_refused_before_anything_is_written(tiny):
    from dflash_agent.kernels.cpu.cpu_dot import LayerCache

    layers, lib = tiny.cpu, tiny.cpu.lib
    n, slots = len(layers.layers), 4
    q_pos = torch.tensor([3])
    tables = [lib.rope_table(q_pos, f) for f in layers._inv_freqs]
    pointers = ctypes.c_void_p * n
    cos = pointers(*(tables[r][0].data_ptr() for r in layers._rope_of_layer))
    sin = pointers(*(tables[r][1].data_ptr() for r in layers._rope_of_layer))
    caches = [torch.zeros(2, slots, w.kv_heads, w.head_dim) for w in layers.layers]

    def run(write: int, n_keys: int = slots) -> torch.Tensor:
        where = torch.tensor([write])
        structs = (LayerCache * n)(*(LayerCache(k=c[0].data_ptr(), v=c[1].data_ptr(), slots=slots,
                                                write_slots=where.data_ptr(), key_pos=None, n_keys=n_keys, window=0)
                                     for c in caches))
        x = torch.randn(1, tiny.config.hidden_size)
        lib.layers_forward(layers.layers, structs, x, q_pos, cos, sin, pointers())
        return x

    for write, n_keys in ((slots, slots), (-1, slots), (3, slots + 1)):
        with pytest.raises(ValueError, match="outside a layer's KV cache"):
            run(write, n_keys)
    assert all(not c.any() for c in caches)  # refused before any layer wrote
    assert torch.isfinite(run(3)).all() and all(c[:, 3].any() and not c[:, :3].any() for c in caches)


@pytest.mark.parametrize("model_name", ["tiny", "moe", "ple", "embedded"])
def test_rows_of_several_sequences_in_one_step_give_what_each_gives_alone(model_name, tiny, embedded_model):
    """StepRunner.forward_groups: decode rows and verification blocks of four sequences (different lengths, one
    past its sliding window) in one C call give bit for bit the logits and captures of each run alone."""
    from dflash_agent.engine.model.gemma import RowGroup

    model = {"tiny": tiny, "embedded": embedded_model}.get(model_name) or _family_model(model_name)
    vocab = model.config.vocab_size
    window = model.config.sliding_window
    torch.manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,)) for n in (5, 17, 3, window + 9)]
    blocks = [torch.randint(0, vocab, (n,)) for n in (1, 6, 1, 9)]
    capture = (0, len(model.config.layers) - 1)

    def caches():
        out = []
        for prompt in prompts:
            cache = model.new_cache(window + 64)
            for i in range(0, prompt.shape[0], 8):  # prefill in C-sized pieces, so rings wrap as decoding does
                model.forward(prompt[i:i + 8], cache)
            out.append(cache)
        return out

    alone = [model.forward(block, cache, logits_at=torch.arange(block.shape[0]), capture=capture)
             for block, cache in zip(blocks, caches(), strict=True)]
    calls = []
    layers = model.cpu
    forward_groups = layers.forward_groups
    layers.forward_groups = lambda x, groups, *rest: calls.append(len(groups)) or forward_groups(x, groups, *rest)
    try:
        together_caches = caches()
        calls.clear()
        together = model.forward_groups(
            [RowGroup(b, c, torch.arange(b.shape[0])) for b, c in zip(blocks, together_caches, strict=True)], capture)
    finally:
        del layers.forward_groups
    assert calls == [4]  # one C call for all four sequences
    for a, t, cache, prompt, block in zip(alone, together, together_caches, prompts, blocks, strict=True):
        assert torch.equal(a.logits, t.logits)
        assert all(torch.equal(a.captured[i], t.captured[i]) for i in capture)
        assert cache.length == prompt.shape[0] + block.shape[0]
    # and the caches hold what each sequence's own steps wrote: the next step agrees too
    nxt = torch.tensor([1])
    for cache, (block, ref) in zip(together_caches, zip(blocks, caches(), strict=True), strict=True):
        model.forward(block, ref)
        assert torch.equal(model.forward(nxt, cache).logits, model.forward(nxt, ref).logits)


def test_greedy_steps_pick_what_their_logits_pick(embedded_model):
    """StepRunner.forward(greedy=True): a verification block's picks through the head's screen (vector builds) are the
    argmax of each row's logits, alone and beside other sequences' rows (forward_groups, greedy and not)."""
    from dflash_agent.engine.model.gemma import RowGroup

    model = embedded_model
    assert (model.cpu._screen is not None) == (cpu_dot().simd in SCREEN_SIMD)
    torch.manual_seed(11)
    prompt, block = torch.randint(0, 4096, (40,)), torch.randint(0, 4096, (24,))

    def cache():
        c = model.new_cache(128)
        model.forward(prompt, c)
        return c

    logits = model.forward(block, cache(), logits_at=torch.arange(24)).logits
    picks = model.forward(block, cache(), logits_at=torch.arange(24), greedy=True)
    assert picks.logits is None and picks.tokens == [model.argmax(row) for row in logits]
    assert model.forward(block[:1], cache(), greedy=True).tokens == [model.argmax(logits[0])]
    outs = model.forward_groups([RowGroup(block, cache(), torch.arange(24), greedy=True),
                                 RowGroup(block[:5], cache(), torch.arange(5)),
                                 RowGroup(block[:9], cache(), torch.tensor([2, 8]), greedy=True)])
    assert outs[0].tokens == picks.tokens and outs[0].logits is None
    assert torch.equal(outs[1].logits, logits[:5]) and outs[1].tokens is None
    assert outs[2].tokens == [picks.tokens[2], picks.tokens[8]]
    # a row outside a group's tokens is refused before anything runs, never another group's row (nor, graphed, a
    # padding row): the caches keep their lengths
    caches = [cache(), cache()]
    for bad in (torch.tensor([5]), torch.tensor([-1]), torch.tensor([0.0])):
        with pytest.raises(ValueError, match="outside the step's 5 new tokens"):
            model.forward(block[:5], caches[0], logits_at=bad)
        with pytest.raises(ValueError, match="outside the step's 5 new tokens"):
            model.forward_groups([RowGroup(block[:5], caches[0], bad), RowGroup(block[:3], caches[1])])
    assert [c.length for c in caches] == [40, 40]


def test_a_drafters_greedy_drafts_come_from_the_screen(embedded_model):
    """StepRunner.draft_picks: a drafter's normed rows' picks over the LM head, as its logits' argmax gives them."""
    model = embedded_model
    hidden = F.rms_norm(torch.randn(15, model.config.hidden_size), (model.config.hidden_size,))
    picks = model.draft_picks(hidden)
    if model.cpu._screen is None:
        assert picks is None
        return
    assert picks == [model.argmax(row) for row in F.linear(hidden, model.model.output_weight)]
    assert model.draft_picks(hidden[:1]) is None  # one row: the whole head


def test_no_screen_where_it_would_crowd_the_ram(embedded_model, monkeypatch):
    from dflash_agent.engine.backends import cpu as cpu_decode

    if cpu_dot().simd not in SCREEN_SIMD:
        pytest.skip("the screen is built for the vector builds only")
    head = embedded_model.model.output_weight.cpu.matrix
    need = head.n * head.k * cpu_decode.SCREEN_BYTES_PER_WEIGHT / cpu_decode.SCREEN_SHARE
    monkeypatch.setattr(cpu_decode, "available_ram_bytes", lambda: int(need * 0.9))
    assert CpuDecodeLayers.build(embedded_model.model)._screen is None
    monkeypatch.setattr(cpu_decode, "available_ram_bytes", lambda: int(need * 1.1))
    assert CpuDecodeLayers.build(embedded_model.model)._screen is not None


def test_greedy_rows_past_what_one_head_call_takes_are_picked_alike(embedded_model):
    """Two sequences' 65-row blocks in one step: 130 greedy rows, more than the C head takes at once, each picked as
    its block alone picks it (never through the prefill GEMM, whose bfloat16 sums differ)."""
    model = embedded_model
    torch.manual_seed(12)
    prompts = [torch.randint(0, 4096, (n,)) for n in (30, 50)]
    blocks = [torch.randint(0, 4096, (65,)) for _ in prompts]

    def cache(prompt):
        c = model.new_cache(160)
        model.forward(prompt, c)
        return c

    alone = [model.forward(b, cache(p), logits_at=torch.arange(65), greedy=True).tokens for p, b in zip(prompts, blocks)]
    layers, asked = model.cpu, []
    for name in ("greedy", "logits"):
        original = getattr(layers, name)
        setattr(layers, name, lambda hidden, *a, f=original, **k: asked.append(hidden.shape[0]) or f(hidden, *a, **k))
    try:
        together = model.forward_groups([RowGroup(b, cache(p), torch.arange(65), greedy=True)
                                         for p, b in zip(prompts, blocks)])
    finally:
        del layers.greedy, layers.logits
    assert asked and max(asked) <= MAX_ROWS and sum(asked) >= 130, asked
    assert [o.tokens for o in together] == alone
    logits = model.forward(blocks[0], cache(prompts[0]), logits_at=torch.arange(65)).logits
    assert alone[0] == [model.argmax(row) for row in logits]
