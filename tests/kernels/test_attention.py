"""The cache-attention kernel against its PyTorch reference (SDPA with the position mask), on the GPU or interpreted.

Cases follow the engine's caches: full-attention layers (slot = position, possibly a preallocated
cache longer than the sequence), sliding rings (a slot -> position map with empty and stale slots),
head_dim 256 and 512, GQA groups of 2 and 8, decode / verification / prefill, int8 (q8) caches.
"""

from __future__ import annotations

import pytest
import torch

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
