"""kernels.cpu.cpu_dot: the library the install built (test_cpu_dot_build.py has its variants and the builder),
its activation quantization and matmuls against plain float32 arithmetic (tests/engine/test_cpu_packed.py checks
them on every GGUF format)."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import Q4_K

from dflash_agent.kernels.cpu import cpu_dot

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")


@pytest.fixture
def lib():
    built = cpu_dot.load()
    assert built is not None, "pip install -e . builds the kernels (setup.py)"
    return built


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_dot.DISABLE_ENV, "0")
    assert cpu_dot.load() is None


def test_activations_are_int16_per_block_of_32(lib):
    x = torch.randn(3, 128) * torch.logspace(-3, 2, 128)
    acts = lib.quantize(x)
    assert acts.xq.dtype == torch.int16 and acts.xs.shape == (3, 4) and acts.xsum.shape == (3, 4)
    back = (acts.xq.float().view(3, 4, 32) * acts.xs[..., None]).view(3, 128)
    assert float((back - x).abs().max()) <= float(acts.xs.max()) / 2 + 1e-9  # within half a step of its block
    torch.testing.assert_close(acts.xsum, acts.xq.float().view(3, 4, 32).sum(-1) * acts.xs)
    with pytest.raises(ValueError, match="multiple of 32"):
        lib.quantize(torch.randn(2, 40))


def _layout(bits: int, group: int, with_m: bool, offset: int = 0, scales: str = "f32", n: int = 37, k: int = 512):
    """A random IntMatrix of a layout and the float32 weight it stands for. scales "f16": float16 scales (as Q4_0 /
    Q5_0 / Q8_0 store them), negative, subnormal and zero ones among them; "k": Q4_K / Q5_K super-block headers,
    the weight from gguf-py's own reading of their 6-bit scales and mins; "q6": Q6_K super-block tails, the weight
    from gguf-py's dequantization of Q6_K blocks holding them."""
    g = torch.Generator().manual_seed(bits * 100 + group + with_m + offset + len(scales))
    if bits == 8:
        values = torch.randint(-128, 128, (n, k), generator=g)
    else:
        values = torch.randint(0, 1 << bits, (n, k), generator=g)
    d = torch.rand(n, k // group, generator=g)
    m = torch.randn(n, k // group, generator=g) if with_m else None
    if scales == "f16":
        d = (d - 0.25).half()
        d[0, :4] = torch.tensor([6e-8, -3e-6, 6.1e-5, 0.0])  # float16 subnormals, the smallest normal, zero
    elif scales == "k":
        supers = torch.rand(n * k // 256, 2, generator=g).mul(1e-3).half()
        header = torch.cat([supers.view(torch.uint8).view(-1, 4),
                            torch.randint(0, 256, (n * k // 256, 12), generator=g, dtype=torch.uint8)], 1)
        block = np.zeros((n * k // 256, 144), np.uint8)  # a Q4_K block: the header, then 128 bytes of weights
        block[:, :16] = header.numpy()
        sc, mn = Q4_K.get_scale_min(block[:, 4:16])
        gguf_d, gguf_min = (block[:, i:i + 2].view(np.float16).astype(np.float32) for i in (0, 2))
        d = header.reshape(n, -1)
        w = (values.float().view(n, -1, 8, 32) * torch.from_numpy((gguf_d * sc).reshape(n, -1, 8, 1))
             - torch.from_numpy((gguf_min * mn).reshape(n, -1, 8, 1))).reshape(n, k)
        return cpu_dot.IntMatrix.pack(values, d, None, bits, group, offset), w
    if scales == "q6":
        tails = torch.cat([torch.randint(-128, 128, (n * k // 256, 16), generator=g).to(torch.int8).view(torch.uint8),
                           torch.rand(n * k // 256, 1, generator=g).mul(1e-3).half().view(torch.uint8)], 1)
        block = np.zeros((n * k // 256, 210), np.uint8)  # a Q6_K block: ql, qh, then the tail
        ql = np.zeros((n * k // 256, 2, 64), np.uint8)
        qh = np.zeros((n * k // 256, 2, 32), np.uint8)
        for half in range(2):  # ggml's Q6_K: in each 128 values, runs v0..v3 of 32; ql low | high, qh 2 bits each
            v = values.view(-1, 2, 4, 32)[:, half].numpy().astype(np.uint8)
            ql[:, half, :32] = (v[:, 0] & 15) | (v[:, 2] & 15) << 4
            ql[:, half, 32:] = (v[:, 1] & 15) | (v[:, 3] & 15) << 4
            qh[:, half] = (v[:, 0] >> 4) | (v[:, 1] >> 4) << 2 | (v[:, 2] >> 4) << 4 | (v[:, 3] >> 4) << 6
        block[:, :128], block[:, 128:192], block[:, 192:] = ql.reshape(-1, 128), qh.reshape(-1, 64), tails.numpy()
        w = torch.from_numpy(gguf.quants.dequantize(block.reshape(n, -1), gguf.GGMLQuantizationType.Q6_K).copy())
        return cpu_dot.IntMatrix.pack(values, tails.reshape(n, -1), None, bits, group, offset), w.view(n, k)
    w = ((values - offset).float().view(n, -1, group) * d.float()[..., None]
         + (0 if m is None else m[..., None])).view(n, k)
    return cpu_dot.IntMatrix.pack(values, d, m, bits, group, offset), w


LAYOUTS = {"u4 m": (4, 32, True), "u4 Q4_0": (4, 32, False, 8, "f16"), "u4 Q4_K": (4, 32, False, 0, "k"),
           "u5 Q5_0": (5, 32, False, 16, "f16"), "u5 m": (5, 32, True), "u5 Q5_K": (5, 32, False, 0, "k"),
           "s8 Q8_0": (8, 32, False, 0, "f16"), "s8 m": (8, 32, True), "s8 16": (8, 16, False),
           "u6 Q6_K": (6, 16, False, 32, "q6")}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_matmul_is_the_float_matmul_and_dequantize_is_exact(lib, layout):
    matrix, w = _layout(*layout)
    x = torch.randn(7, matrix.k)  # a tile of 4 rows and 3 left over; 37 weight rows: panels of 16, 16 and 5
    y = lib.matmul(lib.quantize(x), matrix)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-3 * float((x @ w.T).abs().max()))
    for row in range(7):  # each row alone gives the same bits
        assert torch.equal(lib.matmul(lib.quantize(x[row:row + 1]), matrix), y[row:row + 1])
    assert torch.equal(lib.linear(x, matrix), y)
    assert torch.equal(lib.dequantize(matrix), w)
    assert torch.equal(lib.dequantize(matrix.rows(5, 9)), w[5:9])
    assert torch.equal(lib.dequantize(matrix, torch.tensor([8, 0, 36, 8])), w[[8, 0, 36, 8]])
    with pytest.raises(IndexError, match="row 37 of a matrix of 37"):
        lib.dequantize(matrix, torch.tensor([3, 37]))


@pytest.mark.parametrize(("layout", "k"), [("u4 Q4_K", 512), ("u4 Q4_0", 512), ("u4 Q4_0", 704)])
def test_q4_blocks_past_the_on_stack_order_give_each_rows_bits(lib, layout, k):
    """Q4_K's and Q4_0's activations are reordered once per matmul, on the stack up to 32768 values and in memory
    past it: a block of 72 rows (a verify step's) gives each row the bits it has alone; Q4_0 rows of 704 end in 6
    blocks past the last 8 (26B-A4B's experts are 704 wide)."""
    matrix, w = _layout(*LAYOUTS[layout], k=k)
    x = torch.randn(72, matrix.k)
    y = lib.matmul(lib.quantize(x), matrix)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-3 * float((x @ w.T).abs().max()))
    for row in (0, 9, 71):
        assert torch.equal(lib.matmul(lib.quantize(x[row:row + 1]), matrix), y[row:row + 1])


def test_layouts_are_checked():
    q, d = torch.zeros(2, 16, dtype=torch.uint8), torch.ones(2, 1)
    with pytest.raises(ValueError, match="high bits"):
        cpu_dot.IntMatrix(q, d, None, bits=5)
    with pytest.raises(ValueError, match="the 6-bit layout is Q6_K's"):  # float32 scales
        cpu_dot.IntMatrix(torch.zeros(2, 128, dtype=torch.uint8), torch.ones(2, 16), None, bits=6, group=16,
                          qh=torch.zeros(2, 8, 2, dtype=torch.int32), offset=32)
    with pytest.raises(ValueError, match="without offsets m, not torch.float16"):
        cpu_dot.IntMatrix(q, d.half(), torch.ones(2, 1), bits=4)
    with pytest.raises(ValueError, match="K-quant headers scale 4- or 5-bit rows of a multiple of 256"):
        cpu_dot.IntMatrix(q, torch.zeros(2, 16, dtype=torch.uint8), None, bits=4)  # rows of 32 values
    with pytest.raises(ValueError, match="no offset"):
        cpu_dot.IntMatrix(torch.zeros(2, 32, dtype=torch.int8), d, None, bits=8, offset=3)
    with pytest.raises(ValueError, match="groups of 16"):
        cpu_dot.IntMatrix(q, torch.ones(2, 2), torch.ones(2, 2), bits=8, group=16)


@pytest.mark.parametrize("n", [1, 7, 9, 65537, 262145])
def test_argmax_is_torchs(lib, n):
    """The first of equal maxima, and a NaN above every number, as torch.argmax has it."""
    gen = torch.Generator().manual_seed(n)
    for trial in range(12):
        x = torch.randn(n, generator=gen)
        if trial % 3 == 0:
            x = x.round()  # many ties for the largest
        if trial % 4 == 1:
            x[torch.randint(n, (2,), generator=gen)] = float("nan")
        if trial == 2:
            x[:] = float("-inf")
        assert lib.argmax(x) == int(torch.argmax(x)), (n, trial)


def test_a_threads_kernel_count_changes_no_result(lib):
    """`using` sets the calling thread's kernel thread count (the scheduler's per-step choice); every output is
    computed whole by one thread, so the results are the same bits on any count."""
    w = cpu_dot.IntMatrix.pack(torch.randint(0, 16, (301, 512)), torch.rand(301, 16).half(), None, 4, offset=8)
    x = torch.randn(9, 512)
    results = []
    for threads in (1, 2, 3):
        with lib.using(threads):
            assert lib.threads() == threads
            y = lib.linear(x, w)
            results.append((y, lib.argmax(y.flatten())))
    assert lib.threads() == torch.get_num_threads()  # outside: torch's count
    assert all(torch.equal(y, results[0][0]) and i == results[0][1] for y, i in results)


def test_released_threads_end_and_the_next_region_starts_new_ones(lib):
    """A thread's OpenMP pool (its parallel regions' threads, kept waiting for the next region) ends when it releases
    it: the process then has fewer threads, and the kernels work as before, with a new pool."""
    import threading

    def os_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    w = cpu_dot.IntMatrix.pack(torch.randint(-127, 128, (4096, 256)), torch.rand(4096, 8), None, 8)
    x = torch.randn(8, 256)
    result = {}

    def on_a_thread():  # a thread of its own: no pool from earlier tests, and no other thread's pool touched
        torch.set_num_threads(3)
        expected = lib.matmul(lib.quantize(x), w)
        with_pool = os_threads()
        lib.release_threads()
        result["released"] = with_pool - os_threads()
        result["same"] = torch.equal(lib.matmul(lib.quantize(x), w), expected)
        lib.release_threads()

    threads = torch.get_num_threads()
    try:
        worker = threading.Thread(target=on_a_thread)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    # its pool's 2 threads at least: another test's thread ending meanwhile (a server's) counts too
    assert result["released"] >= 2 and result["same"]


def test_tensors_are_allocated_in_a_huge_page_arena():
    arena = cpu_dot.HugePageArena(3 * cpu_dot.HugePageArena.ALIGN + 96 * 32 + 96 * 2 * 4)
    if not arena.enabled:
        pytest.skip("this kernel takes no transparent huge page advice")
    made = [arena.empty((96, 32), torch.uint8), arena.empty((96, 2), torch.int32)]
    base = arena._memory.data_ptr()
    for t in made:
        assert t.data_ptr() % cpu_dot.HugePageArena.ALIGN == 0
        assert base <= t.data_ptr() and t.data_ptr() + t.nbytes <= base + arena._memory.nbytes
    beyond = arena.empty((1 << 20,), torch.uint8)  # once full, torch's own memory
    assert not base <= beyond.data_ptr() < base + arena._memory.nbytes


@pytest.fixture(params=["best", "generic"])
def each_build(request):
    """The build this machine loads, and the scalar C build (the vector and scalar quantizers differ in code)."""
    if request.param == "best":
        return cpu_dot.load()
    path = cpu_dot.prebuilt("generic")
    if path is None:
        pytest.skip("no generic build installed")
    return cpu_dot.open_library(path)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_nan_activation_makes_its_row_nan_and_no_other(each_build, layout):
    """As float32's matmul: the vector max drops a NaN, which then came out as plausible finite numbers."""
    matrix, _ = _layout(*layout)
    x = torch.randn(7, matrix.k)
    clean = each_build.linear(x, matrix)
    x[2, 37] = float("nan")
    y = each_build.linear(x, matrix)
    assert torch.isnan(y[2]).all()
    others = [0, 1, 3, 4, 5, 6]  # in the tile with it and after it
    assert torch.equal(y[others], clean[others])
    assert torch.isnan(each_build.quantize(x).xs[2, 1])


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_an_infinite_activation_never_gives_a_finite_number(each_build, layout):
    """inf or NaN as float32 gives (an infinity was quantized as -32768: a flipped sign)."""
    matrix, w = _layout(*layout)
    x = torch.randn(7, matrix.k)
    clean = each_build.linear(x, matrix)
    x[1, 70], x[5, 3] = float("inf"), float("-inf")
    y, ref = each_build.linear(x, matrix), x @ w.T
    for row in (1, 5):
        assert not torch.isfinite(y[row]).any()
        infinite = torch.isinf(y[row])
        assert torch.equal(y[row][infinite], ref[row][infinite])  # where an infinity survives, float32's sign
    others = [0, 2, 3, 4, 6]
    assert torch.equal(y[others], clean[others])


def test_a_block_too_small_for_a_float32_scale_still_quantizes(each_build):
    """32767 / amax overflows below amax ~ 1e-34: every value was then -32768 (and undefined behaviour in C)."""
    x = torch.randn(2, 64)
    x[0, :32] *= 1e-37
    acts = each_build.quantize(x)
    q = acts.xq[0, :32]
    assert int(q.abs().max()) == 32767 and torch.equal(q.sign(), x[0, :32].sign().to(torch.int16))
    back = q.double() * float(acts.xs[0, 0])
    assert float((back - x[0, :32].double()).abs().max()) <= 1e-3 * float(x[0, :32].abs().max())
    assert torch.equal(acts.xq[1], each_build.quantize(x[1:]).xq[0])


def test_shapes_dtypes_and_devices_are_checked_before_c_reads_them(lib):
    """C reads through bare pointers: a width that is not the matrix's read past the activations (or the norm),
    which the address sanitizer reported as heap-buffer-overflows."""
    matrix, w = _layout(8, 32, True, k=256)
    narrow, head = torch.randn(1, 64), matrix.struct()
    for call in (lambda: lib.linear(narrow, matrix), lambda: lib.linear(torch.randn(256), matrix),
                 lambda: lib.gemm_int8(narrow, matrix), lambda: lib.matmul(lib.quantize(narrow), matrix), lambda: lib.norm_linear(narrow, torch.ones(256),
                                                                                            1e-6, head)):
        with pytest.raises(ValueError, match="against a matrix of 256 inputs"):
            call()
    with pytest.raises(ValueError, match="multiple of 32"):
        lib.quantize(torch.randn(64))
    with pytest.raises(ValueError, match=r"the norm weight must be a contiguous CPU torch.float32 tensor \[256\]"):
        lib.norm_linear(torch.randn(1, 256), torch.ones(64), 1e-6, head)
    with pytest.raises(ValueError, match="the norm weight"):
        lib.norm_linear(torch.randn(1, 256), torch.ones(256, dtype=torch.float64), 1e-6, head)
    with pytest.raises(ValueError, match="CPU tensors, not meta"):
        lib.linear(torch.empty(1, 256, device="meta"), matrix)
    with pytest.raises(ValueError, match="empty"):
        lib.argmax(torch.empty(0))
    with pytest.raises(ValueError, match="1-D CPU tensor"):
        lib.dequantize(matrix, torch.tensor([[0, 1]]))
    acts = lib.quantize(torch.randn(2, 256))
    with pytest.raises(ValueError, match="xs must be"):
        lib.matmul(cpu_dot.QuantizedActivations(acts.xq, acts.xs[:1], acts.xsum), matrix)
    # another dtype or layout is converted, as documented
    x = torch.randn(256, 3).T
    assert not x.is_contiguous()
    assert torch.equal(lib.linear(x, matrix), lib.linear(x.contiguous(), matrix))
    assert torch.equal(lib.linear(x.double(), matrix), lib.linear(x.contiguous(), matrix))
    norm = torch.rand(256)
    assert torch.equal(lib.norm_linear(x, norm, 1e-6, head), lib.norm_linear(x.contiguous(), norm, 1e-6, head))


# The int8 prompt GEMM (CpuDot.gemm_int8, cpu_dot.c's dfa_gemm_i8): int8 activations per block of 32 against the
# weights' own integers, each row's GEMM_OUTLIERS channels of largest |x| in float32 on the exactly dequantized weights.

def _int8_reference(x: torch.Tensor, w: torch.Tensor, outliers: int = 16) -> torch.Tensor:
    """The int8 GEMM's arithmetic in float64: each row's outlier channels out of its blocks, each block at
    amax / 127 rounded to nearest even, the outliers' products exact."""
    order = torch.sort(-x.abs().nan_to_num(0.0), dim=1, stable=True).indices  # the first of equals first
    taken = order[:, :min(outliers, x.shape[1] // 32)]
    kept = torch.zeros_like(x, dtype=torch.bool).scatter_(1, taken, True)
    blocks = torch.where(kept, 0.0, x).double().view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)).clamp(-127, 127)
    return (q * scale).view_as(x) @ w.double().T + torch.where(kept, x, 0.0).double() @ w.double().T


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_int8_gemm_is_int8_arithmetic_with_the_outliers_in_float(each_build, layout):
    matrix, w = _layout(*layout)
    x = torch.randn(19, matrix.k)  # two tiles of 8 and 3 rows; 37 weight rows: panels of 16, 16 and 5
    x[:, 5] *= 40  # outlier channels, as Gemma's normed activations have
    x[:, 300] *= -60
    y, exact = each_build.gemm_int8(x, matrix), x.double() @ w.double().T
    assert y.shape == (19, 37) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _int8_reference(x, w), rtol=0, atol=1e-5 * float(exact.abs().max()))
    error = float((y - exact).norm() / exact.norm())
    assert 1e-5 < error < 1e-2  # int8's rounding, not the exact path's


@pytest.mark.parametrize("layout", ["u4 Q4_K", "u6 Q6_K", "s8 Q8_0"])
def test_an_int8_gemm_row_does_not_depend_on_the_rows_called_with_it(each_build, layout):
    """Each row picks its own outlier channels: a prompt's rows come out the same whichever chunk holds them (a
    prefix-cache hit moves the chunks' starts), bit for bit."""
    matrix, _ = _layout(*LAYOUTS[layout])
    x = torch.randn(45, matrix.k)
    x[:20, 5] *= 40  # channels far larger in some rows than in others: a choice over the call's rows would differ
    x[20:, 300] *= -60
    x[30:, 77] *= 100
    whole = each_build.gemm_int8(x, matrix)
    for start, end in ((0, 1), (3, 20), (17, 45), (20, 33), (44, 45)):
        assert torch.equal(each_build.gemm_int8(x[start:end], matrix), whole[start:end]), (start, end)
    assert torch.equal(each_build.gemm_int8(x.flip(0), matrix), whole.flip(0))


def _outlier_picks(k: int) -> torch.Tensor:
    """Rows whose outlier channels are hard to pick: ties (the first of equals is taken), a row of equal values (every
    channel a candidate), one of zeros, few large values among many, a wide spread."""
    g = torch.Generator().manual_seed(5)
    ties = torch.randn(k, generator=g).sign()
    ties[[9, 100, k - 1]] = 4.0
    spread = torch.randn(k, generator=g) * torch.logspace(-3, 3, k)
    few = torch.randn(k, generator=g)
    few[torch.randperm(k, generator=g)[:40]] *= 30
    rounded = (torch.randn(k, generator=g) * 4).round()  # many equal magnitudes near the top
    return torch.stack([ties, torch.ones(k), torch.zeros(k), few, spread, rounded, -rounded])


@pytest.mark.parametrize("layout", ["u4 Q4_K", "s8 Q8_0"])
def test_int8_gemm_picks_each_row_s_outliers_as_the_reference_does(each_build, layout):
    matrix, w = _layout(*LAYOUTS[layout])
    x = _outlier_picks(matrix.k)
    y, exact = each_build.gemm_int8(x, matrix), x.double() @ w.double().T
    torch.testing.assert_close(y.double(), _int8_reference(x, w), rtol=0, atol=1e-5 * float(exact.abs().max()))


def test_every_build_gives_the_int8_gemm_the_same_bits():
    """The same integer sums and the same float operations per output, in the same order, on every ISA."""
    # only the builds this CPU runs: an AVX-512 build on an AVX2 machine dies of an illegal instruction
    paths = [cpu_dot.prebuilt(v) for v in cpu_dot.VARIANTS if cpu_dot.supports(v)]
    builds = [cpu_dot.open_library(path) for path in paths if path is not None]
    if len(builds) < 2:
        pytest.skip("fewer than two builds this CPU runs are installed")
    for layout in LAYOUTS.values():
        matrix, _ = _layout(*layout)
        x = torch.cat([torch.randn(13, matrix.k) * torch.logspace(-2, 1, matrix.k), _outlier_picks(matrix.k)])
        first = builds[0].gemm_int8(x, matrix)
        for other in builds[1:]:
            assert torch.equal(other.gemm_int8(x, matrix), first), (layout, other.simd)


@pytest.mark.parametrize("layout", ["u4 Q4_K", "u6 Q6_K", "s8 Q8_0"])
def test_int8_gemm_propagates_nan_and_inf(each_build, layout):
    matrix, w = _layout(*LAYOUTS[layout])
    x = torch.randn(11, matrix.k)
    clean = each_build.gemm_int8(x, matrix)
    x[2, 37] = float("nan")
    y = each_build.gemm_int8(x, matrix)
    assert torch.isnan(y[2]).all()
    others = [r for r in range(11) if r != 2]
    assert torch.equal(y[others], clean[others])  # a NaN picks no outlier channel: the other rows unchanged
    x[2, 37], x[5, 70] = 0.0, float("-inf")
    y, ref = each_build.gemm_int8(x, matrix), x @ w.T
    assert not torch.isfinite(y[5]).any()
    infinite = torch.isinf(ref[5])  # where float32 gives an infinity, the same one (its weight's sign kept)
    assert infinite.any() and torch.equal(y[5][infinite], ref[5][infinite])
    assert torch.isfinite(y[others[:4]]).all()


# The LM-head screen (CpuDot.norm_head_argmax, cpu_layer.c): each row's pick is the one the whole head gives
# (norm_linear, then argmax: the first largest logit), on the vector and the scalar build, for a Q8_0 head (its own
# integers) and requantized ones, through outlier channels, exact ties and ties closer than the screen's bound.

SCREEN_EPS = 1e-6


def _whole_head(lib, x, norm, matrix):
    return [lib.argmax(row) for row in lib.norm_linear(x, norm, SCREEN_EPS, matrix.struct())]


def _aligned(lib, matrix, norm, rows):
    """Activation rows whose normed values point along head rows `rows` (their logits the largest, or nearly)."""
    w = lib.dequantize(matrix, torch.tensor(rows))
    return w / norm * 10


@pytest.mark.parametrize("layout", ["s8 Q8_0", "u4 Q4_K", "u6 Q6_K", "s8 m"])
def test_the_screen_picks_what_the_whole_head_picks(each_build, layout):
    lib = each_build
    matrix, _ = _layout(*LAYOUTS[layout], n=1000, k=512)  # 1000 rows: the last pair of panels part padding
    duplicate = matrix._mapped(lambda t: torch.cat([t[:600], t[10:11], t[601:]]))  # row 600 = row 10: exact ties
    g = torch.Generator().manual_seed(3)
    norm = torch.rand(512, generator=g) * 2 + 0.5
    norm[7] = 60.0  # an outlier channel, as Gemma's final norms have
    x = torch.cat([torch.randn(40, 512, generator=g), torch.randn(8, 512, generator=g) * 1e-30,
                   _aligned(lib, duplicate, norm, [10, 600, 999, 0, 31, 32])])
    x[5:9, 100] = 500.0  # outlier activations
    screen = cpu_dot.HeadScreen.of(lib, duplicate)
    assert (screen.err is None) == (layout == "s8 Q8_0")  # Q8_0: its own integers, exactly
    picks = lib.norm_head_argmax(x, norm, SCREEN_EPS, duplicate.struct(), screen)
    whole = _whole_head(lib, x, norm, duplicate)
    assert all(p == w for p, w in zip(picks, whole, strict=True) if p is not None)
    assert sum(p is None for p in picks) <= 2, picks  # only rows whose logits crowd the bound fall back
    assert 600 not in picks and 600 not in whole  # a tie goes to the first, as argmax's
    if layout in ("s8 Q8_0", "u6 Q6_K"):  # no offsets: the aligned row's logit is the largest, tied
        assert whole[-6] == picks[-6] == 10


def test_near_ties_are_settled_by_the_exact_logits(each_build):
    """Head rows one integer apart: their logits differ by far less than the screen's bound, and the exact
    computation of the candidates decides."""
    lib = each_build
    values = torch.randint(-100, 100, (300, 256), generator=torch.Generator().manual_seed(5))
    for r in range(40, 104):
        values[r] = values[40]
        values[r, r % 256] += 1 if r % 2 else -1
    d = torch.full((300, 8), 1e-3).half()
    matrix = cpu_dot.IntMatrix.pack(values, d, None, 8, 32)
    norm = torch.ones(256)
    x = _aligned(lib, matrix, norm, list(range(40, 104))) + torch.randn(64, 256) * 1e-3
    picks = lib.norm_head_argmax(x, norm, SCREEN_EPS, matrix.struct(), cpu_dot.HeadScreen.of(lib, matrix))
    assert picks == _whole_head(lib, x, norm, matrix)
    assert all(40 <= p < 104 for p in picks)


def test_rows_the_screen_cannot_bound_are_left_to_the_whole_head(each_build):
    lib = each_build
    matrix, _ = _layout(*LAYOUTS["s8 Q8_0"], n=64, k=256)
    screen = cpu_dot.HeadScreen.of(lib, matrix)
    x = torch.randn(4, 256)
    x[1, 3], x[2, 9] = float("nan"), float("inf")
    x[3] = 0.0  # every logit 0: a tie of the whole vocabulary, past the candidates a row may have
    picks = lib.norm_head_argmax(x, torch.ones(256), SCREEN_EPS, matrix.struct(), screen)
    assert picks[0] == _whole_head(lib, x[:1], torch.ones(256), matrix)[0]
    assert picks[1] is None and picks[2] is None
    assert picks[3] in (None, 0)


def test_a_screen_of_another_head_is_refused(each_build):
    lib = each_build
    matrix, _ = _layout(*LAYOUTS["s8 Q8_0"], n=64, k=256)
    other, _ = _layout(*LAYOUTS["s8 Q8_0"], n=65, k=256)
    with pytest.raises(ValueError, match="a screen of"):
        lib.norm_head_argmax(torch.randn(2, 256), torch.ones(256), SCREEN_EPS, matrix.struct(),
                             cpu_dot.HeadScreen.of(lib, other))
