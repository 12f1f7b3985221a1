"""The packed-GGUF matmul kernels against dequantize-then-matmul (engine.formats.quant, bit-exact with gguf-py).

Shapes are small because the interpreter is slow: K = 2 super-blocks of 256, N = 48 (a partial tile for
every launch shape), and 1 / 5 / 16 / 40 rows (decode, verification, a full verify tile, prefill).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from dflash_agent.engine.formats.quant import dequantize
from tests.helpers.quant import K, N, check, random_weight

T = GGMLQuantizationType
TYPES = [T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


def run(kernels, x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType, n: int) -> torch.Tensor:
    """The kernel on the fixture's device, result back on the CPU."""
    qm = kernels.load("triton.quant_matmul")
    return qm.quant_matmul(x.to(kernels.device), raw.to(kernels.device), qtype, n).cpu()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_float32_matches_dequantize_then_matmul(kernels, qtype, rows) -> None:
    raw = random_weight(qtype, N, K, seed=qtype.value)
    x = torch.randn(rows, K)
    check(run(kernels, x, raw, qtype, N), x, dequantize(raw, qtype, (N, K)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_half_activations(kernels, dtype, qtype, rows) -> None:
    raw = random_weight(qtype, N, K, seed=1)
    x = torch.randn(3, rows, K).to(dtype)[1]  # a view with a storage offset
    check(run(kernels, x, raw, qtype, N), x, dequantize(raw, qtype, (N, K)))


def test_leading_dims_and_wider_k(kernels) -> None:
    # K = 5 * 32: Q8_0 steps over one block at a time; leading dims are flattened and restored
    raw = random_weight(T.Q8_0, 20, 160, seed=3)
    x = torch.randn(2, 3, 160)
    y = run(kernels, x, raw, T.Q8_0, 20)
    assert y.shape == (2, 3, 20)
    check(y.reshape(6, 20), x.reshape(6, 160), dequantize(raw, T.Q8_0, (20, 160)))


def test_bad_inputs(kernels) -> None:
    qm = kernels.load("triton.quant_matmul")
    raw = random_weight(T.Q4_0, N, K, seed=0)
    with pytest.raises(ValueError, match="no packed matmul kernel for Q4_1"):
        qm.quant_matmul(torch.randn(1, K), raw, T.Q4_1, N)
    with pytest.raises(ValueError, match="multiple of 256"):
        qm.quant_matmul(torch.randn(1, 96), raw, T.Q4_K, N)
    with pytest.raises(ValueError, match="expected 13824 contiguous uint8 bytes"):
        qm.quant_matmul(torch.randn(1, K), raw[:-18], T.Q4_0, N)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        qm.quant_matmul(torch.randn(1, K).double(), raw, T.Q4_0, N)


def test_split_k_fills_the_sms_with_splits_that_divide_k(kernels) -> None:
    qm = kernels.load("triton.quant_matmul")
    assert qm.split_k(programs=2688, steps=21, sms=132) == 1  # a gate projection fills an H200 as it is
    assert qm.split_k(programs=672, steps=84, sms=132) == 4  # a down projection: 4 x 672 programs
    assert qm.split_k(programs=6, steps=21, sms=132) == 1  # 21 steps split no way evenly
    assert qm.split_k(programs=1, steps=1024, sms=132) == qm.MAX_SPLIT
    # the tests' shapes take both paths: N = 48 decode rows split K = 512 (4 steps of 128) four ways, K = 160 not at all
    x = torch.empty(1, K, device="meta")
    plan = qm.quant_matmul_launch(x, torch.empty(N * K // 32 * 18, dtype=torch.uint8, device="meta"), T.Q4_0,
                                  torch.empty(1, N, device="meta"))
    assert plan.partials is not None and plan.partials.shape == (4, 1, N) and plan.launch.grid[2] == 4
    assert plan.total is not None and plan.total.meta["SPLIT"] == 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_split_partials_add_in_split_order_and_round_once(kernels, dtype) -> None:
    """The split K's sum: float32 partials added in split order, whatever the rows, rounded once to y's dtype, into
    a y whose rows are strided (a view), past one program's outputs."""
    qm, dev = kernels.load("triton.quant_matmul"), kernels.device
    if dtype == torch.bfloat16 and dev.type != "cuda":
        pytest.skip("Triton's interpreter converts to bfloat16 by truncating")
    from dflash_agent.kernels.triton.triton_support import Launch

    partials = (torch.randn(8, 3, 1500, generator=torch.Generator().manual_seed(3)) * 1e3).to(dev)
    y = torch.full((3, 1600), -1.0, dtype=dtype, device=dev)[:, :1500]
    Launch(qm._sum_splits_kernel, (2, 3), (partials, y, 3, 1500, y.stride(0)), dict(SPLIT=8, BLOCK=qm.SUM_BLOCK))()
    want = partials[0].clone()
    for s in range(1, 8):
        want += partials[s]
    assert torch.equal(y.cpu(), want.to(dtype).cpu())


def test_launch_shapes(kernels) -> None:
    qm = kernels.load("triton.quant_matmul")
    for qtype in TYPES:
        # a decode row takes the verification tile: one shape (so one rounding) for every step of <= 16 rows
        assert qm.launch_shape(1, qtype) == qm.launch_shape(16, qtype) and qm.launch_shape(1, qtype).block_m == 16
        assert not qm.launch_shape(1, qtype).gemv
        assert qm.launch_shape(17, qtype).block_m == 64
        assert qm.decode_shape(qtype).gemv and qm.decode_shape(qtype).block_m == 1
    assert set(TYPES) == set(qm.SUPPORTED_TYPES)


@pytest.mark.parametrize(("qtype", "dtype"), [(t, torch.float32) for t in TYPES] + [
    (T.Q4_0, torch.bfloat16), (T.Q4_K, torch.bfloat16)], ids=lambda v: getattr(v, "name", str(v)))
def test_decode_rows_of_several_sequences_come_out_as_each_alone(kernels, qtype, dtype) -> None:
    """Concurrent requests' decode rows in one launch (16-row tiles, each weight loaded and unpacked once for all of
    them) and verification blocks beside them: every row bit for bit what its sequence's step alone gives, for 1 to
    11 decode rows, and past one tile (3 + 9 rows beside 5 + 4 + 16), K split the same way (four ways at N = 48)
    whatever the rows. On a GPU (bench --gpu-check) this is the check that bfloat16 tensor-core tiles keep their rows
    apart."""
    qm = kernels.load("triton.quant_matmul")
    dev = kernels.device
    raw = random_weight(qtype, N, K, seed=7).to(dev)
    x = torch.randn(11 + 25, K, device=dev).to(dtype)
    alone = [qm.quant_matmul(x[i:i + 1], raw, qtype, N) for i in range(11)]
    blocks = [(11, 16), (16, 20), (20, 36)]  # three verification blocks, 5, 4 and 16 rows
    alone_blocks = [qm.quant_matmul(x[a:b], raw, qtype, N) for a, b in blocks]
    for rows in (1, 3, 8, 11):
        together = qm.quant_matmul(x[:rows], raw, qtype, N, one_token_rows=rows)
        assert all(torch.equal(together[i:i + 1], alone[i]) for i in range(rows)), rows
    mixed = torch.cat((x[:3], x[11:36]))
    out = qm.quant_matmul(mixed, raw, qtype, N, one_token_rows=3)
    assert all(torch.equal(out[i:i + 1], alone[i]) for i in range(3))
    assert torch.equal(out[3:8], alone_blocks[0]) and torch.equal(out[8:12], alone_blocks[1])
    assert torch.equal(out[12:28], alone_blocks[2])
    if dtype == torch.float32:
        check(out.cpu(), mixed.cpu(), dequantize(raw.cpu(), qtype, (N, K)))
    # one sequence's row and 28 rows of several take the same tile, K split the same way
    one = qm.quant_matmul_launch(x[:1], raw, qtype, torch.empty(1, N, device=dev)).launch
    batch = qm.quant_matmul_launch(mixed, raw, qtype, torch.empty(28, N, device=dev), several_sequences=True).launch
    assert one.meta == batch.meta and one.grid[2] == batch.grid[2] and batch.grid[1] == 2
    with pytest.raises(ValueError, match="29 one-token rows of a \\[28, 512\\] batch"):
        qm.quant_matmul(mixed, raw, qtype, N, one_token_rows=29)


def test_quant_linear_q4_is_q4_0_blocks_and_runs_on_the_kernel(kernels) -> None:
    """The drafter's q4 weights are GGUF Q4_0 blocks (gguf-py reads them back as QuantLinear does), within half a
    step of the weights, and where Triton runs QuantLinear multiplies them without expanding them."""
    from gguf.quants import dequantize as gguf_dequantize

    from dflash_agent.engine.model.quant_linear import QuantLinear

    w = torch.randn(N, K)
    layer = QuantLinear(w, "q4")
    expanded = layer.dequantize()
    assert torch.equal(expanded, torch.from_numpy(gguf_dequantize(layer.qweight.numpy(), T.Q4_0)))
    steps = layer.qweight.view(N, -1, 18)[..., :2].contiguous().view(torch.float16).float()  # [N, groups, 1]
    assert ((expanded - w).view(N, -1, 32).abs() <= steps * 0.5 * (1 + 2.0**-10)).all()
    x = torch.randn(3, K)
    y = layer.to(kernels.device)(x.to(kernels.device)).cpu()
    check(y, x, expanded)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 5, 24])
@pytest.mark.parametrize("per_pair", [False, True], ids=["gate-up", "down"])
def test_grouped_experts_match_each_expert_alone(kernels, qtype, tokens, per_pair) -> None:
    """A MoE layer's chosen experts in one launch (grouped_quant_matmul): a decode step's pairs as GEMV rows; a
    verification block's and a prompt's grouped by expert into padded 16- and 64-row tiles (24 tokens of 4 experts,
    top 2: some expert has more than 16 rows). Every pair is x's row times its expert's matrix: a token's row for
    each of its experts (the gate and up projection), or a row of its own (the down projection)."""
    qm = kernels.load("triton.quant_matmul")
    experts, top = 4, 2
    raw = torch.cat([random_weight(qtype, N, K, seed=e) for e in range(experts)])
    chosen = torch.stack([torch.randperm(experts, generator=torch.Generator().manual_seed(t))[:top]
                          for t in range(tokens)]).reshape(-1)
    rows = torch.arange(tokens * top) if per_pair else torch.arange(tokens).repeat_interleave(top)
    x = torch.randn(rows.shape[0] if per_pair else tokens, K)
    got = qm.grouped_quant_matmul(x.to(kernels.device), raw.to(kernels.device), qtype, experts, N,
                                  rows.to(kernels.device), chosen.to(kernels.device), single=tokens == 1).cpu()
    bytes_per = raw.numel() // experts
    for p in range(rows.shape[0]):
        e = int(chosen[p])
        w = dequantize(raw[e * bytes_per:(e + 1) * bytes_per], qtype, (N, K))
        check(got[p:p + 1], x[rows[p]:rows[p] + 1], w)
    with pytest.raises(ValueError, match="contiguous uint8 bytes"):
        qm.grouped_quant_matmul(x.to(kernels.device), raw[:-1].to(kernels.device), qtype, experts, N,
                                rows.to(kernels.device), chosen.to(kernels.device))
