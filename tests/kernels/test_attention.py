"""The cache-attention kernel against its PyTorch reference (SDPA with the position mask), on the GPU or interpreted.

Cases follow the engine's caches: full-attention layers (slot = position, possibly a preallocated
cache longer than the sequence), sliding rings (a slot -> position map with empty and stale slots),
head_dim 256 and 512, GQA groups of 2 and 8, decode / verification / prefill, int8 (q8) caches.
"""

from __future__ import annotations

import pytest
import torch

from dflash_agent.engine.cache.kv_cache import LayerKV
from dflash_agent.kernels.dispatch import CPU_KERNELS_ENV

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def full_layer(T: int, end: int, S: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype,
               window: int | None = None):
    """Queries at positions end-T..end-1 over a cache of S >= end slots (slots past end hold garbage);
    with a window, a sliding layer whose cache is in position order."""
    q = torch.randn(T, heads, d).to(dtype)
    k = torch.randn(S, kv_heads, d).to(dtype)
    v = torch.randn(S, kv_heads, d).to(dtype)
    k[end:] = 1e4  # anything read past the sequence end would swamp the result
    return q, k, v, torch.arange(end - T, end), None


def ring(T: int, end: int, window: int, slack: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype):
    """A ring of window + slack slots after writing positions 0..end-1, plus stale positions past end
    (rolled-back drafts) in some slots and empty ones (-1) when the ring has not filled."""
    slots = window + slack
    k_pos = torch.full((slots,), -1)
    for p in range(end + 3):  # 3 stale positions past the end
        k_pos[p % slots] = p
    q = torch.randn(T, heads, d).to(dtype)
    k = torch.randn(slots, kv_heads, d).to(dtype)
    v = torch.randn(slots, kv_heads, d).to(dtype)
    return q, k, v, torch.arange(end - T, end), k_pos


def on_device(kernels, fn, *args):
    """fn(*args) with every tensor argument on the fixture's device, the result back on the CPU."""
    moved = [a.to(kernels.device) if isinstance(a, torch.Tensor) else a for a in args]
    return fn(*moved).cpu()


def check(out: torch.Tensor, ref: torch.Tensor, v: torch.Tensor) -> None:
    """Outputs are convex combinations of V rows: float32 softmax and sums leave errors far below 1e-5
    of max|v|; half types round the probabilities and the output, one unit roundoff of max|v| each,
    plus float32 accumulation over the keys."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    vmax = float(v.float().abs().max())
    tol = (1e-5 if out.dtype == torch.float32 else 4 * UNIT_ROUNDOFF[out.dtype]) * vmax
    err = float((out.float() - ref.float()).abs().max())
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


CASES = {
    # name: (builder, args)
    "decode-full-d512-gqa8": (full_layer, dict(T=1, end=37, S=64, heads=8, kv_heads=1, d=512)),
    "verify-full-d512-gqa8": (full_layer, dict(T=16, end=50, S=64, heads=8, kv_heads=1, d=512)),
    "verify5-full-d256": (full_layer, dict(T=5, end=20, S=20, heads=4, kv_heads=2, d=256)),
    "decode-split-chunks": (full_layer, dict(T=1, end=1100, S=1200, heads=2, kv_heads=1, d=64)),
    "verify-split-chunks": (full_layer, dict(T=3, end=700, S=1030, heads=4, kv_heads=2, d=64)),
    "prefill-full": (full_layer, dict(T=40, end=60, S=64, heads=4, kv_heads=2, d=64)),
    # late queries see nothing in the first key tiles: the online softmax starts from all-masked tiles
    "prefill-window": (full_layer, dict(T=40, end=200, S=200, heads=4, kv_heads=2, d=64, window=8)),
    "decode-ring-d256": (ring, dict(T=1, end=45, window=16, slack=4, heads=4, kv_heads=2, d=256)),
    "verify-ring-wrapped": (ring, dict(T=4, end=70, window=16, slack=4, heads=4, kv_heads=2, d=256)),
    "decode-ring-not-full": (ring, dict(T=1, end=9, window=16, slack=4, heads=4, kv_heads=2, d=256)),
    # rings longer than RING_KEYS_PER_CHUNK: chunks of their own, and chunks of only empty slots while not yet full
    "decode-ring-split-chunks": (ring, dict(T=1, end=700, window=300, slack=16, heads=2, kv_heads=1, d=64)),
    "verify-ring-split-chunks": (ring, dict(T=4, end=450, window=200, slack=16, heads=4, kv_heads=2, d=64)),
    "decode-ring-split-not-full": (ring, dict(T=1, end=100, window=300, slack=16, heads=2, kv_heads=1, d=64)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(kernels, case, dtype) -> None:
    attn = kernels.load("attention")
    build, args = CASES[case]
    q, k, v, q_pos, k_pos = build(**args, dtype=dtype)
    window = args.get("window")
    scale = 1.0 if args["d"] >= 256 else args["d"] ** -0.5  # Gemma 4 uses 1.0
    if args["d"] >= 256:
        q = q / args["d"] ** 0.5  # keep logits O(1) so the softmax is not one-hot
    out = on_device(kernels, attn.cache_attention, q, k, v, q_pos, k_pos, window, scale)
    ref = attn.cache_attention_reference(q.float(), k.float(), v.float(), q_pos, k_pos, window, scale)
    check(out, ref.to(dtype), v[: args.get("end", v.shape[0])])


def quantize_int8(x: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over runs of d / blocks values of each slot's head: [S, kv, d], [S, kv, blocks]."""
    S, kv, d = x.shape
    runs = x.reshape(S, kv, blocks, d // blocks)
    scale = runs.abs().amax(-1).clamp_min(1e-12) / 127
    q = torch.round(runs / scale[..., None]).to(torch.int8).reshape(S, kv, d)
    return q, scale


@pytest.mark.parametrize("per_32", [False, True], ids=["scale-per-head", "scale-per-32"])
@pytest.mark.parametrize("builder", ["decode-full-d512-gqa8", "verify-ring-wrapped"])
def test_int8_cache(kernels, builder, per_32) -> None:
    attn = kernels.load("attention")
    build, args = CASES[builder]
    q, k, v, q_pos, k_pos = build(**args, dtype=torch.float32)
    q = q / args["d"] ** 0.5
    blocks = args["d"] // 32 if per_32 else 1
    (kq, ks), (vq, vs) = quantize_int8(k, blocks), quantize_int8(v, blocks)
    if blocks == 1:  # the [S, kv] form of one scale per head
        ks, vs = ks[..., 0], vs[..., 0]
    window = args.get("window")
    out = on_device(kernels, attn.cache_attention, q, kq, vq, q_pos, k_pos, window, 1.0, ks, vs)
    ref = attn.cache_attention_reference(q, kq, vq, q_pos, k_pos, window, 1.0, k_scale=ks, v_scale=vs)
    check(out, ref, v)
    # and the reference expands the cache as written: scale x int8
    kq_ref = kq.float() * (ks if ks.dim() == 3 else ks[..., None]).repeat_interleave(args["d"] // blocks, -1)
    assert float((kq_ref - k).abs().max()) <= float(k.abs().max()) / 127


@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
@pytest.mark.parametrize("builder", ["decode-full-d512-gqa8", "verify-full-d512-gqa8", "decode-split-chunks"])
def test_keys_rebuilt_from_the_values_a_cache_keeps(kernels, builder, cache) -> None:
    """A cache that keeps V alone (attention_k_eq_v's full layers): the kernel rebuilds each key as rope(V * w) at its
    position, as the reference does from the same values, and as attending over those keys stored gives; several
    caches' rows in one launch come out as each alone."""
    attn, at = kernels.load("attention"), kernels.load("triton.attention_triton")
    torch.manual_seed(3)
    build, args = CASES[builder]
    d = args["d"]
    dtype = torch.float32 if cache == "float32" else torch.bfloat16
    q, _, v, q_pos, _ = build(**args, dtype=torch.float32)
    q = (q / d ** 0.5).to(dtype)
    # a Gemma 4 full layer's RoPE: a quarter of the pairs rotate, the exponent over the whole head
    angles = d // 8
    inv_freq = torch.cat((1e6 ** (-2 * torch.arange(angles) / d), torch.zeros(d // 2 - angles)))
    keys_from = attn.KeysFromValues(torch.rand(d) + 0.5, inv_freq.float())
    stored, scales, values = v.to(dtype), [], v.to(dtype).float()
    keys = keys_from.keys(values, torch.arange(v.shape[0]), torch.float32)
    out = on_device(kernels, lambda *a: attn.cache_attention(*a, keys_from=attn.KeysFromValues(
        keys_from.weight.to(kernels.device), keys_from.inv_freq.to(kernels.device))),
        q, stored, stored, q_pos, None, None, 1.0, *scales)
    ref = attn.cache_attention_reference(q.float(), keys, values, q_pos, None, None, 1.0)
    check(out, ref.to(dtype), values[: args["end"]])
    rebuilt = attn.cache_attention_reference(q.float(), stored, stored, q_pos, None, None, 1.0, *scales,
                                             keys_from=keys_from)
    check(rebuilt, ref, values[: args["end"]])
    if args["T"] == 1:  # two caches' decode rows in one launch, each as its own launch gives it
        dev = kernels.device
        caches = [[stored.to(dev).clone(), *(x.to(dev) for x in scales[:1])] for _ in range(2)]
        tensors = [[c[0], c[0], *(c[1:] * 2)] for c in caches]
        offsets = torch.tensor(attn.cache_offsets(tensors), device=dev)
        on_dev = attn.KeysFromValues(keys_from.weight.to(dev), keys_from.inv_freq.to(dev))
        rows_q, rows_pos = torch.cat([q, q]).to(dev), torch.cat([q_pos, q_pos - 5]).to(dev)
        together = at.rows_attention_launch(rows_q, *tensors[0][:2], rows_pos, None, None, 1.0, offsets,
                                            *tensors[0][2:], keys_from=on_dev).run()
        for t, row in enumerate(tensors):
            alone = attn.cache_attention(rows_q[t:t + 1], *(x[: int(rows_pos[t]) + 1] for x in row[:2]),
                                         rows_pos[t:t + 1], None, None, 1.0,
                                         *(x[: int(rows_pos[t]) + 1] for x in row[2:]), keys_from=on_dev)
            assert torch.equal(together[t:t + 1], alone), f"row {t}"
    if kernels.device.type == "cuda" or "TRITON_INTERPRET" in __import__("os").environ:
        with pytest.raises(ValueError, match="in the model's dtype"):  # 8-bit caches keep their keys
            vq, vs = quantize_int8(v, d // 32)
            at.cache_attention_launch(q, vq, vq, q_pos, None, None, 1.0, vs, vs, keys_from)


def test_visibility_rule(kernels) -> None:
    attn = kernels.load("attention")
    q_pos = torch.tensor([5, 6])
    k_pos = torch.tensor([-1, 2, 3, 4, 5, 6, 7])
    got = attn.visibility(q_pos, k_pos, window=3)
    want = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    assert torch.equal(got, want)
    assert bool(attn.visibility(q_pos, k_pos, None)[1, 1])  # no window: every earlier key


def test_cpu_without_interpreter_uses_reference(monkeypatch) -> None:
    # outside the interpreter a CPU tensor never reaches Triton (there is no CPU backend): bit-equal to SDPA
    from dflash_agent.kernels import attention

    monkeypatch.delenv(CPU_KERNELS_ENV, raising=False)  # the module-scoped fixture may have set it
    q, k, v, q_pos, k_pos = full_layer(2, 8, 8, 4, 2, 32, torch.float32)
    out = attention.cache_attention(q, k, v, q_pos, k_pos, None, 0.2)
    assert torch.equal(out, attention.cache_attention_reference(q, k, v, q_pos, k_pos, None, 0.2))


@pytest.mark.parametrize("T, S, heads, kv_heads, window, lead", [
    (300, 300, 4, 1, 512, ()),  # a prefill chunk from an empty cache: the causal triangle
    (200, 700, 8, 2, 256, ()),  # a chunk after cached keys, a sliding window narrower than the chunk's reach
    (129, 400, 4, 4, None, (2,)),  # full attention, no grouping, a batch of two
])
def test_blocked_attention_matches_sdpa(T, S, heads, kv_heads, window, lead) -> None:
    """The CPU's many-row path (GEMMs over each block's visible keys) against SDPA under the same mask, including
    rows that see no key at all (zeros, as SDPA gives) and keys past every query's reach."""
    from dflash_agent.kernels.attention import BLOCKED_ROWS, grouped_attention, visibility

    assert T >= BLOCKED_ROWS
    torch.manual_seed(T)
    d = 64
    q = torch.randn(*lead, T, heads, d)
    k, v = torch.randn(*lead, S, kv_heads, d), torch.randn(*lead, S, kv_heads, d)
    k_pos = torch.arange(S)
    k_pos[S // 3:S // 3 + 5] = -1  # empty slots
    mask = visibility(torch.arange(S - T - 40, S - 40), k_pos, window)  # the last 40 keys: in no query's reach
    mask[7] = False  # a row that sees nothing
    group = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(-2, -3), k.repeat_interleave(group, dim=-2).transpose(-2, -3),
        v.repeat_interleave(group, dim=-2).transpose(-2, -3), attn_mask=mask, scale=0.125).transpose(-2, -3)
    got = grouped_attention(q, k, v, mask, 0.125)
    assert got.shape == expected.shape
    assert torch.equal(got[..., 7, :, :], torch.zeros_like(got[..., 7, :, :]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "q8"])
@pytest.mark.parametrize("layer", ["full", "ring"])
def test_rows_of_several_caches_come_out_as_each_alone(kernels, layer, cache) -> None:
    """Several requests' decode rows in one launch (rows_attention_launch: the server's slots), each over its own
    cache tensors: bit for bit what the row's own launch gives, a full layer's over its cache up to its position (as an
    eager step passes it: one pass, or chunks where it is long) and a ring's over the whole ring; and the new keys
    written by one launch land where each cache's own write puts them."""
    attn, at = kernels.load("attention"), kernels.load("triton.attention_triton")
    torch.manual_seed(5)
    dtype = torch.float32 if cache == "float32" else torch.bfloat16
    heads, kv_heads, d, window = 4, 2, 256, (None if layer == "full" else 200)
    slots = 1100 if layer == "full" else 210  # a full cache of three key chunks, a ring of two
    ends = [37, 1050, 600] if layer == "full" else [30, 500, 247]  # rings: not yet full, wrapped, wrapped
    rows = []
    for end in ends:
        k, v = torch.randn(slots, kv_heads, d), torch.randn(slots, kv_heads, d)
        if layer == "full":
            k[end:] = 1e4  # anything read past the row's position would swamp it
            k_pos = None
        else:
            k_pos = torch.full((slots,), -1)
            for p in range(end + 2):  # 2 stale positions past the end, as rolled-back drafts leave
                k_pos[p % slots] = p
        tensors = [*quantize_int8(k, d // 32), *quantize_int8(v, d // 32)] if cache == "q8" else [k, v]
        rows.append(([t.to(dtype) if t.is_floating_point() else t for t in tensors], k_pos))
    if cache == "q8":  # cache_offsets takes keys, values, then their scales
        rows = [([kq, vq, ks, vs], k_pos) for (kq, ks, vq, vs), k_pos in rows]
    q = (torch.randn(len(ends), heads, d) / d**0.5).to(dtype)
    q_pos = torch.tensor(ends) - 1
    dev = kernels.device
    rows = [([t.to(dev) for t in tensors], None if k_pos is None else k_pos.to(dev)) for tensors, k_pos in rows]
    q, q_pos = q.to(dev), q_pos.to(dev)
    offsets = attn.cache_offsets([tensors for tensors, _ in rows])
    assert offsets is not None and offsets[0] == [0, 0, 0, 0]
    offsets = torch.tensor(offsets, device=dev)
    first = rows[0][0]
    k_pos = None if layer == "full" else torch.stack([k_pos for _, k_pos in rows])
    together = at.rows_attention_launch(q, first[0], first[1], q_pos, k_pos, window, 1.0, offsets,
                                        *first[2:]).run()
    for t, ((tensors, row_k_pos), end) in enumerate(zip(rows, ends, strict=True)):
        seen = slice(None) if layer == "ring" else slice(0, end)
        kv = [x[seen] for x in tensors]
        alone = attn.cache_attention(q[t:t + 1], kv[0], kv[1], q_pos[t:t + 1], row_k_pos, window, 1.0, *kv[2:])
        assert torch.equal(together[t:t + 1], alone), f"row {t}"
        if t == 1:  # and what the reference makes of it
            ref = attn.cache_attention_reference(q[t:t + 1].float().cpu(), *(x.cpu() for x in kv[:2]),
                                                 q_pos[t:t + 1].cpu(), None if row_k_pos is None else row_k_pos.cpu(),
                                                 window, 1.0, *(x.cpu() for x in kv[2:]))
            values = kv[1].float() if cache != "q8" else kv[1].float() * kv[3].float().repeat_interleave(32, -1)
            check(alone.cpu(), ref.to(dtype), values.cpu())
    # the new keys: one launch a tensor pair (LayerKV.write_rows), each row as its own LayerKV.write puts it
    new_k, new_v = torch.randn(2, len(ends), kv_heads, d, device=dev).to(dtype)
    slot = torch.tensor([3, 17, 0], device=dev)
    want = [LayerKV(*(x.clone() for x in tensors[:2]), layer == "ring", *(x.clone() for x in tensors[2:]))
            for tensors, _ in rows]
    for t, layer_kv in enumerate(want):
        layer_kv.write(slot[t:t + 1], new_k[t:t + 1], new_v[t:t + 1])
    LayerKV(*first[:2], layer == "ring", *first[2:]).write_rows(slot, new_k, new_v, offsets)
    for (tensors, _), layer_kv in zip(rows, want, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(tensors, layer_kv.storage(), strict=True))


def test_a_ring_splits_into_shorter_chunks_than_a_full_cache(kernels) -> None:
    """Decode programs: a sliding ring of the 31B's shape (1040 slots, 16 KV heads) splits at RING_KEYS_PER_CHUNK, so
    one row makes more programs than an H200 has SMs; a full cache keeps KEYS_PER_CHUNK, whose partials the memory
    plan sizes by the context."""
    at, dispatch = kernels.load("triton.attention_triton"), kernels.load("dispatch")
    meta = torch.device("meta")
    q, q_pos = torch.empty(1, 32, 256, device=meta), torch.empty(1, dtype=torch.long, device=meta)
    kv = torch.empty(1040, 16, 256, device=meta)
    ring = at.cache_attention_launch(q, kv, kv, q_pos, torch.empty(1040, dtype=torch.long, device=meta), 1024, 1.0)
    full = at.cache_attention_launch(q, kv, kv, q_pos, None, None, 1.0)
    chunks = -(-1040 // dispatch.RING_KEYS_PER_CHUNK)
    assert ring.launch.grid == (1, chunks, 16) and chunks * 16 > 132
    assert full.launch.grid == (1, -(-1040 // dispatch.KEYS_PER_CHUNK), 16)
