"""engine.formats.quant must match gguf-py's numpy dequantizers bit for bit."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf import quants as gq

from dflash_agent.engine.formats.quant import (
    SUPPORTED_TYPES,
    PackedTensor,
    UnsupportedTensorType,
    dequantize,
    from_numpy,
)
from tests.helpers.quant import FP16_FIELDS

T = GGMLQuantizationType

REQUIRED = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K}

# types gguf-py can also quantize, so real data can make the round trip
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]


def assert_bit_exact(ours: torch.Tensor, ref: np.ndarray, what: str = "") -> None:
    expected = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    assert ours.dtype == torch.float32, what
    assert ours.shape == expected.shape, what
    # compare bit patterns, which is stricter than torch.equal (it sees signed zeros);
    # NaNs only need to sit in the same places: their payloads are not portable
    # (torch's CPU fp16->fp32 returns one canonical NaN, numpy keeps sign and payload)
    if torch.equal(ours.view(torch.int32), expected.view(torch.int32)):
        return
    same = (ours.view(torch.int32) == expected.view(torch.int32)) | (ours.isnan() & expected.isnan())
    if not bool(same.all()):
        i = int((~same).flatten().nonzero()[0])
        a, b = ours.flatten()[i].item(), expected.flatten()[i].item()
        raise AssertionError(f"{what}: {int((~same).sum())} mismatches, first at flat index {i}: {a!r} != {b!r}")


def finite_fp16(rng: np.random.Generator, n: int) -> np.ndarray:
    # any finite half: zeros, subnormals, negatives and large values included
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    inf_or_nan = (bits & 0x7C00) == 0x7C00
    bits[inf_or_nan] &= ~np.uint16(0x4000)
    return bits.view(np.float16)


def random_blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    n_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        blocks[:, off : off + 2] = finite_fp16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def test_supported_types() -> None:
    assert REQUIRED <= SUPPORTED_TYPES
    assert set(FP16_FIELDS) == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(7, 512), (2, 3, 256), (1024,)], ids=str)
def test_random_blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> None:
    raw = random_blocks(qtype, shape, seed=hash((qtype.value, shape)) & 0xFFFF)
    ours = dequantize(torch.from_numpy(raw), qtype, shape)
    assert_bit_exact(ours, gq.dequantize(raw, qtype), qtype.name)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_random_bytes_everywhere(qtype: GGMLQuantizationType) -> None:
    # inf/NaN scales too: specials must land on the same elements as in gguf-py
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = 4096
    raw = np.random.default_rng(qtype.value).integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    specials = np.array([0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x0000, 0x8000], dtype=np.uint16)
    for i, off in enumerate(FP16_FIELDS[qtype]):
        # make sure every special value meets every other one, whatever the random bytes did
        col = np.tile(np.repeat(specials, len(specials) ** i), len(specials) ** (1 - i))
        raw[: col.size, off : off + 2] = col.view(np.uint8).reshape(-1, 2)
    raw, shape = raw.reshape(-1), (n_blocks * block_size,)
    ours = dequantize(torch.from_numpy(raw), qtype, shape)
    with np.errstate(invalid="ignore"):  # inf * 0, inf - inf
        ref = gq.dequantize(raw, qtype)
    # the specials did get exercised (plain float types only hit inf by chance)
    assert bool(ours.isnan().any()) and (bool(ours.isinf().any()) or not FP16_FIELDS[qtype])
    assert_bit_exact(ours, ref, qtype.name)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_round_trip_real_data(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 512)).astype(np.float32) * np.logspace(-4, 3, 16, dtype=np.float32)[:, None]
    x[3] = 0.0  # all-zero blocks take the d == 0 branch in the quantizers
    x[4, :40] = -x[4, :40]
    packed = gq.quantize(x, qtype)
    ours = dequantize(torch.from_numpy(packed), qtype, x.shape)
    assert_bit_exact(ours, gq.dequantize(packed, qtype), qtype.name)
    # sanity: the round trip is lossy only by the quantization error
    assert float((ours - torch.from_numpy(x)).abs().max()) <= float(np.abs(x).max()) * 0.1


def test_strided_misaligned_and_typed_sources() -> None:
    qtype, shape = T.Q4_K, (3, 512)
    raw = random_blocks(qtype, shape)
    ref = gq.dequantize(raw, qtype)
    # a column slice of a wider array is not contiguous
    wide = np.zeros((shape[0], raw.shape[1] + 16), dtype=np.uint8)
    wide[:, 8 : 8 + raw.shape[1]] = raw
    strided = torch.from_numpy(wide)[:, 8 : 8 + raw.shape[1]]
    assert not strided.is_contiguous()
    assert_bit_exact(dequantize(strided, qtype, shape), ref, "strided")
    # an odd storage offset can't be viewed as fp16/fp32 in place
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw).flatten()
    assert_bit_exact(dequantize(buf[1:], qtype, shape), ref, "misaligned")
    # F32/F16 arrive from GGUFReader as typed arrays, not bytes
    f16 = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float16)
    assert_bit_exact(dequantize(torch.from_numpy(f16), T.F16, (4, 8)), gq.dequantize(f16, T.F16), "typed f16")


def test_read_only_memmap(tmp_path: Path) -> None:
    qtype, shape = T.Q6_K, (2, 768)
    raw = random_blocks(qtype, shape)
    path = tmp_path / "blocks.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = from_numpy(mm)
        packed = PackedTensor(t, qtype, shape)
        out = packed.dequantize()
    assert t.data_ptr() == mm.ctypes.data  # zero-copy
    assert_bit_exact(out, gq.dequantize(raw, qtype), "memmap")
    # F32 must not hand back an alias of the (read-only) source
    f32 = np.arange(8, dtype=np.float32)
    f32.setflags(write=False)
    src = from_numpy(f32)
    assert dequantize(src, T.F32, (8,)).data_ptr() != src.data_ptr()


def test_packed_tensor() -> None:
    qtype, shape = T.Q5_0, (4, 64)
    raw = torch.from_numpy(random_blocks(qtype, shape))
    p = PackedTensor(raw, qtype, shape)
    assert p.nbytes == raw.numel() == 4 * 2 * 22
    assert p.to("cpu").qtype == qtype and p.to("cpu").shape == shape
    ref = dequantize(raw, qtype, shape)
    assert torch.equal(p.dequantize(), ref)
    assert torch.equal(p.dequantize(torch.bfloat16), ref.to(torch.bfloat16))
    with pytest.raises(ValueError, match="needs 176 bytes"):
        PackedTensor(raw[:2], qtype, shape)


def test_bad_shapes() -> None:
    raw = torch.zeros(34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block size"):
        dequantize(raw, T.Q8_0, (2, 16))
    with pytest.raises(ValueError, match="needs 68 bytes"):
        dequantize(raw, T.Q8_0, (2, 32))


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.Q8_K, T.I32])
def test_unsupported_type(qtype: GGMLQuantizationType) -> None:
    raw = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(UnsupportedTensorType, match=f"GGUF tensor type {qtype.name} is not supported") as e:
        dequantize(raw, qtype, (256,))
    assert "Q4_K" in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(UnsupportedTensorType, match=qtype.name):
        PackedTensor(raw, qtype, (256,))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=lambda t: t.value), ids=lambda t: t.name)
def test_cuda_matches(qtype: GGMLQuantizationType) -> None:
    shape = (64, 1024)
    raw = random_blocks(qtype, shape, seed=qtype.value)
    p = PackedTensor(torch.from_numpy(raw), qtype, shape).to("cuda")
    out = p.dequantize()
    assert out.device.type == "cuda"
    assert_bit_exact(out.cpu(), gq.dequantize(raw, qtype), qtype.name)


@pytest.fixture(scope="module")
def gemma_reader(embedded_gguf) -> GGUFReader:
    return GGUFReader(embedded_gguf)


def test_embedded_gguf_all_tensors(gemma_reader: GGUFReader) -> None:
    seen: set[str] = set()
    for t in gemma_reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape))
        ours = dequantize(from_numpy(t.data), t.tensor_type, shape)
        assert tuple(ours.shape) == shape, t.name
        assert_bit_exact(ours, gq.dequantize(t.data, t.tensor_type), t.name)
        seen.add(t.tensor_type.name)
        del ours
    assert seen == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}
