"""The packed CPU path (engine.model.packed repacked for torch's int4 / int8 kernels): exact int4 planes,
fidelity against the exact path on the embedded model, and speculation that stays lossless on it."""

from __future__ import annotations

import asyncio
import logging
import platform

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES

from dflash_agent.bench.fidelity import DECODE_STEP, compare, log_probs, texts
from dflash_agent.engine import OptionError, memory_plan
from dflash_agent.engine.decode.speculative import SpecConfig
from dflash_agent.engine.engine import Engine, FinalEvent, GenerateRequest
from dflash_agent.engine.load.tokenizer import Tokenizer
from dflash_agent.engine.load.weights import EMBEDDED_DRAFTER, build_model, open_checkpoint, resolve_model_path
from dflash_agent.engine.memory_plan import checkpoint_weight_bytes, cpu_weights
from dflash_agent.engine.model import packed as packed_linear
from dflash_agent.engine.model.packed import (
    GEMM_ROWS,
    PLANE_TYPES,
    U4_TYPES,
    U5_TYPES,
    U6_TYPES,
    CpuDotWeight,
    CpuInt4,
    CpuInt8,
    PackedWeight,
    _int_groups,
    cpu_dot,
    prefill_dtype,
    products_in_c,
)
from dflash_agent.kernels.cpu import cpu_dot as cpu_dot_module
from dflash_agent.kernels.cpu.cpu_dot import DISABLE_ENV
from tests.helpers.packed import TYPES, pack

T = torch.bfloat16


@pytest.fixture
def torch_kernels(monkeypatch):
    """The fallback of a machine without a C compiler: torch's int4 / int8 kernels."""
    monkeypatch.setenv(DISABLE_ENV, "0")
    cpu_dot.cache_clear()
    yield
    cpu_dot.cache_clear()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_integer_groups_are_the_gguf_weights_exactly(qtype):
    rng = np.random.default_rng(0)
    packed = pack(rng.standard_normal((48, 512)).astype(np.float32), qtype, rng)
    q, d, m, group = _int_groups(packed.raw, qtype, 48, 512)
    w = (q.float().view(48, -1, group) * d[..., None] + (0 if m is None else m[..., None])).view(48, 512)
    assert torch.equal(w, packed.dequantize())  # bit for bit: the kernel reads the checkpoint's own integers


def _layout_in_torch(packed) -> cpu_dot_module.IntMatrix:
    """The layout CpuDot.repack makes, built in torch from the format's integers (_int_groups) by IntMatrix.pack."""
    n, k = packed.shape
    q, d, m, group = _int_groups(packed.raw, packed.qtype, n, k)
    bits, offset, _, _ = cpu_dot_module.REPACK_LAYOUTS[int(packed.qtype)]
    size = GGML_QUANT_SIZES[packed.qtype][1]
    blocks = packed.raw.view(n, -1, size)
    if packed.qtype in U4_TYPES | U5_TYPES and packed.qtype.name.endswith("_K"):
        d = blocks[:, :, :16].reshape(n, -1)  # the super-blocks' headers as the file has them
    elif packed.qtype in U6_TYPES:
        d = blocks[:, :, size - 18:].reshape(n, -1)  # and Q6_K's tails
    else:
        d = d.half()
    values = q if bits == 8 else q + offset if packed.qtype.name != "Q4_0" else q
    return cpu_dot_module.IntMatrix.pack(values, d, None, bits, group, offset)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_repacking_in_one_pass_of_c_gives_the_layout_torch_builds(qtype):
    if cpu_dot() is None:
        pytest.skip("no C compiler: the CPU dot kernels cannot be built")
    rng = np.random.default_rng(2)
    packed = pack(rng.standard_normal((40, 512)).astype(np.float32), qtype, rng)
    ours, ref = cpu_dot().repack(packed.raw, int(qtype), 40, 512), _layout_in_torch(packed)
    assert (ours.bits, ours.group, ours.offset) == (ref.bits, ref.group, ref.offset)
    for name in ("q", "qh", "d"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8)), name
    arena = cpu_dot_module.HugePageArena(cpu_dot_module.repacked_nbytes(int(qtype), 40, 512) + 256)
    placed = cpu_dot().repack(packed.raw, int(qtype), 40, 512, arena.empty)  # straight into an arena
    assert torch.equal(cpu_dot().dequantize(placed), packed.dequantize())
    with pytest.raises(ValueError, match="contiguous bytes"):
        cpu_dot().repack(packed.raw[:-1], int(qtype), 40, 512)
    with pytest.raises(ValueError, match="no CPU layout"):
        cpu_dot().repack(packed.raw, 1, 40, 512)  # F16


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_cpu_dot_matmul_matches_the_dequantized_weight(qtype):
    if cpu_dot() is None:
        pytest.skip("no C compiler: the CPU dot kernels cannot be built")
    rng = np.random.default_rng(0)
    packed = pack(rng.standard_normal((96, 512)).astype(np.float32), qtype, rng)
    weight = PackedWeight(packed, torch.float32)
    weight.repack_for_cpu()
    assert isinstance(weight.cpu, CpuDotWeight)
    assert weight.cpu.matrix.bits == (4 if qtype in U4_TYPES else 5 if qtype in U5_TYPES else 6 if qtype in U6_TYPES
                                      else 8)
    x = torch.randn(5, 512) * torch.linspace(0.01, 30, 512)  # a wide dynamic range, as Gemma's activations have
    ours, ref = F.linear(x, weight), x @ packed.dequantize().T
    assert float((ours - ref).norm() / ref.norm()) < 1e-4  # int16 activations: ~1e-5
    for row in range(5):  # each row is computed alone, whatever the batch: what lossless speculation needs
        assert torch.equal(F.linear(x[row:row + 1], weight), ours[row:row + 1])
    many = torch.randn(GEMM_ROWS + 3, 512)  # prefill: a float32 GEMM on the rows dequantized bit for bit
    torch.testing.assert_close(F.linear(many, weight), many @ packed.dequantize().T, rtol=0, atol=0)
    assert torch.equal(weight.cpu._dequantized(0, 96), packed.dequantize())
    ids = torch.tensor([[5, 95, 0], [5, 17, 64]])  # an embedding lookup reads the repacked rows, exactly
    assert torch.equal(weight[ids], packed.dequantize()[ids])


@pytest.mark.parametrize("prefill", [torch.bfloat16, torch.int8], ids=["bfloat16", "int8"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_prompt_gemms(qtype, prefill):
    """prefill=bfloat16: prompt blocks multiply bf16 roundings of the exact weights and activations (float32 sums, a
    relative error near 2^-8); int8: CpuDot.gemm_int8 (int8 activations against the file's integers, outlier channels
    in float32: near 1e-3). Blocks under GEMM_ROWS rows keep the int16 kernels, bit for bit."""
    if cpu_dot() is None:
        pytest.skip("no C compiler: the CPU dot kernels cannot be built")
    rng = np.random.default_rng(1)
    packed = pack(rng.standard_normal((96, 512)).astype(np.float32), qtype, rng)
    exact, fast = PackedWeight(packed, torch.float32), PackedWeight(packed, torch.float32)
    exact.repack_for_cpu()
    fast.repack_for_cpu(prefill=prefill)
    many = torch.randn(GEMM_ROWS + 3, 512)
    ours, ref = F.linear(many, fast), many @ packed.dequantize().T
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert 1e-5 < float((ours - ref).norm() / ref.norm()) < 1e-2
    if prefill == torch.int8:
        assert torch.equal(ours, cpu_dot().gemm_int8(many, fast.cpu.matrix))
    few = many[:5]
    assert torch.equal(F.linear(few, fast), F.linear(few, exact))
    # only the int8 GEMMs are the kernels' own: torch's may sum by the thread count (ThreadCount keeps its count)
    assert products_in_c([fast]) == (prefill == torch.int8) and not products_in_c([exact])
    assert not products_in_c([fast, torch.randn(4, 4)])
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        fast.repack_for_cpu(prefill=torch.float16)


@pytest.mark.timeout(1800)
def test_int8_prompt_fidelity_against_the_exact_path(embedded, capsys):
    """The int8 prompt GEMMs' top-1 agreement with the exact path on prompt rows (the decode rows are the int16
    kernels', measured in test_fidelity_against_the_exact_path)."""
    lib = cpu_dot()
    if lib is None or lib.simd != "avx512":
        pytest.skip("the int8 GEMM runs its vector code on AVX-512 VNNI only (elsewhere the scalar code: too slow)")
    path, ckpt = embedded
    tokenizer = Tokenizer.from_gguf(path, gguf=ckpt.gguf)
    exact = build_model(ckpt, "cpu", torch.float32, progress=False)
    packed = build_model(ckpt, "cpu", torch.float32, progress=False, repack_cpu=True, prefill=torch.int8)
    for name, ids in texts(tokenizer, 1024).items():
        p, q = log_probs(exact, ids), log_probs(packed, ids)
        agreement = float((p.argmax(-1) == q.argmax(-1)).float().mean())
        kl = (p.exp() * (p - q)).sum(-1)
        with capsys.disabled():
            print(f"\nint8 prompt GEMMs vs exact, {name}: top-1 agreement {agreement:.2%}, mean KL "
                  f"{float(kl.mean()):.2e}, max KL {float(kl.max()):.2e}")
        # measured 98.9% / 99.2% and 4.8e-4 .. 1.2e-3 on a 2-core Xeon VM with VNNI (96.4% without the outlier
        # channels)
        assert agreement >= 0.975 and float(kl.mean()) < 0.003


def test_prefill_dtype_follows_the_cpu(monkeypatch):
    """auto: int8 GEMMs where the kernels' VNNI build runs; bfloat16 only where the CPU multiplies bf16 natively
    (elsewhere they run slower than float32's) and torch's bf16 GEMM is measured faster by BF16_GAIN, or by INT8_GAIN
    where int8 runs (an Emerald Rapids VM that hides AMX has AVX512_BF16 and multiplies bf16 at 0.6x float32's)."""
    vnni = set(cpu_dot_module.VARIANTS["x86_64_v4_vnni"])
    int8 = torch.int8 if platform.machine().lower() in ("x86_64", "amd64") else torch.float32
    for flags, gain, want in (({"avx2", "avx512f"}, 3.0, torch.float32),
                              ({"avx512f", "avx512_bf16"}, 2.5, torch.bfloat16),
                              ({"avx512f", "avx512_bf16"}, 0.6, torch.float32),
                              ({"amx_bf16"}, 1.2, torch.bfloat16), (None, 3.0, torch.float32),
                              (vnni, 3.0, int8), (vnni | {"avx512_bf16"}, 0.66, int8),
                              (vnni | {"avx512_bf16"}, 1.5, int8),
                              (vnni | {"avx512_bf16", "amx_bf16"}, 4.0, torch.bfloat16)):
        monkeypatch.setattr(packed_linear, "cpu_flags", lambda flags=flags: None if flags is None else frozenset(flags))
        monkeypatch.setattr(packed_linear, "bfloat16_gemm_gain", lambda gain=gain: gain)
        assert prefill_dtype("auto") == want, (flags, gain)
        assert prefill_dtype("float32") == torch.float32 and prefill_dtype("bfloat16") == torch.bfloat16
        assert prefill_dtype("int8") == torch.int8
    monkeypatch.undo()
    gain = packed_linear.bfloat16_gemm_gain()  # measured here, once
    assert gain > 0 and packed_linear.bfloat16_gemm_gain() == gain
    with pytest.raises(OptionError, match="unknown prefill dtype 'fp16'"):
        Engine.load(prefill="fp16")


def test_repacked_bytes_per_weight_against_the_gguf(capsys):
    """What the C kernels hold per weight beside what the file holds: the file's own scales (float16 ones, the Q4_K /
    Q5_K super-block headers, the Q6_K tails) and as many bits per weight, so every format repacks at the file's
    size (Q6_K took a byte a weight and a float32 scale per 16 before: 10.0 bits against 6.56)."""
    if cpu_dot() is None:
        pytest.skip("no C compiler: the CPU dot kernels cannot be built")
    rng = np.random.default_rng(0)
    n, k = 64, 1024
    for qtype in TYPES:
        weight = PackedWeight(pack(rng.standard_normal((n, k)).astype(np.float32), qtype, rng), torch.float32)
        weight.repack_for_cpu()
        block, size = GGML_QUANT_SIZES[qtype]
        ours, file = 8 * weight.cpu.nbytes / (n * k), 8 * size / block
        with capsys.disabled():
            print(f"\n{qtype.name}: repacked {ours:.2f} bits per weight, GGUF {file:.2f} ({ours / file:.3f}x)", end="")
        assert ours <= file * 1.02, qtype.name


def test_a_packed_weight_refuses_an_input_of_another_width():
    """F.linear reaches the packed weight through __torch_function__, past torch's own shape check: C read past
    the input (a SEGV, or garbage such as 3.2e34) where a plain tensor raises."""
    if cpu_dot() is None:
        pytest.skip("no C compiler: the CPU dot kernels cannot be built")
    rng = np.random.default_rng(0)
    weight = PackedWeight(pack(rng.standard_normal((8, 64)).astype(np.float32), TYPES[0], rng), torch.float32)
    weight.repack_for_cpu()
    assert isinstance(weight.cpu, CpuDotWeight)
    for x in (torch.randn(1, 4096), torch.randn(2, 3, 32), torch.randn(GEMM_ROWS + 1, 128)):
        with pytest.raises(ValueError, match="against a weight of 64 inputs"):
            F.linear(x, weight)
    assert F.linear(torch.randn(2, 3, 64), weight).shape == (2, 3, 8)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_torch_kernel_fallback_matches_the_dequantized_weight(qtype, torch_kernels):
    rng = np.random.default_rng(0)
    packed = pack(rng.standard_normal((96, 512)).astype(np.float32), qtype, rng)
    w = packed.dequantize()
    weight = PackedWeight(packed, torch.float32)
    weight.repack_for_cpu()
    assert isinstance(weight.cpu, CpuInt4 if qtype in PLANE_TYPES else CpuInt8)
    x = torch.randn(5, 512).to(T).float()  # what the kernel sees
    ours, ref = F.linear(x, weight), x @ w.T
    rel = float((ours - ref).norm() / ref.norm())
    # planes are exact but for bf16 scales and outputs; int8 requantizes each row onto 255 levels
    assert rel < (0.006 if qtype in PLANE_TYPES else 0.02), rel


def test_torch_kernel_fallback_rescores_the_head_exactly_on_the_best_logits(torch_kernels):
    rng = np.random.default_rng(1)
    packed = pack(rng.standard_normal((4096, 256)).astype(np.float32), TYPES[4], rng)  # Q8_0, like Gemma 3's
    head = PackedWeight(packed, torch.float32)
    head.repack_for_cpu(head=True)
    x = torch.randn(3, 256)
    ours, ref = F.linear(x, head), x @ packed.dequantize().T
    top = ref.topk(8, dim=-1).indices
    torch.testing.assert_close(ours.gather(-1, top), ref.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(head[torch.tensor([3, 7])], packed.dequantize()[[3, 7]])  # embedding rows exact


@pytest.fixture(scope="module")
def embedded():
    path = resolve_model_path("embedded")
    return path, open_checkpoint(path)


@pytest.mark.timeout(3600)  # two full forwards with 262144-wide logits over 2048 tokens: long on a shared 2-core box
def test_fidelity_against_the_exact_path(embedded, capsys):
    path, ckpt = embedded
    tokenizer = Tokenizer.from_gguf(path, gguf=ckpt.gguf)
    exact = build_model(ckpt, "cpu", torch.float32, progress=False)
    packed = build_model(ckpt, "cpu", torch.float32, progress=False, repack_cpu=True, prefill=torch.bfloat16)
    results = [r for name, ids in texts(tokenizer, 1024).items() for r in compare(exact, packed, ids, name, "bf16")]
    with capsys.disabled():
        for r in results:
            print(f"\npacked vs exact, {r.text}, {r.rows} rows: {r.tokens} tokens, top-1 agreement "
                  f"{r.top1_agreement:.2%}, mean KL {r.mean_kl:.2e}, max KL {r.max_kl:.2e}")
    assert sum(r.tokens for r in results if r.rows == "decode") >= 2000
    assert {r.rows for r in results} == {"decode", "prompt bf16"}
    assert DECODE_STEP < GEMM_ROWS  # the packed model is measured on its decode kernels, not the exact GEMM
    for r in results:
        if r.rows == "decode":
            # cpu_dot reads the checkpoint's integers against int16 activations: measured 100% and KL < 1e-5
            assert r.top1_agreement >= 0.99 and r.mean_kl < 0.001, r
        else:  # bf16 weights and activations in the prompt GEMMs: measured 98.5% and KL 6.5e-4 on the Zen 4
            assert r.top1_agreement >= 0.97 and r.mean_kl < 0.003, r


def _greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    async def collect():
        ids = []
        async for event in engine.generate(GenerateRequest(prompt, max_tokens=n)):
            if isinstance(event, FinalEvent):
                return ids
            ids.extend(event.ids)
        raise AssertionError("no final event")

    return asyncio.run(collect())


def test_speculation_is_lossless_on_the_packed_path(embedded_engine):
    import inspect
    import json.decoder

    block = json.loads((EMBEDDED_DRAFTER / "config.json").read_text())["block_size"]
    spec = embedded_engine(1024, spec=SpecConfig(block=block), device="cpu", weights="packed")
    assert isinstance(spec.model.embed_tokens.weight, PackedWeight) and spec.drafter is not None
    plain = Engine(spec.model, spec.tokenizer, spec.n_ctx, spec.model_name, spec=SpecConfig(enabled=False),
                   runner=spec.runner)
    try:
        for text in (inspect.getsource(json.decoder)[:1500], "The history of the printing press"):
            prompt = spec.tokenizer.encode(text, add_bos=True)
            assert _greedy(spec, prompt, 48) == _greedy(plain, prompt, 48)
    finally:
        spec.close()
        plain.close()


def test_long_copy_drafts_are_lossless_across_the_window_and_from_the_prefix_cache(embedded_engine):
    """A module copied back: prompt lookup drafts up to 64 tokens a step, in blocks that cross the embedded model's
    512-token sliding window, first from an empty cache and then resumed from the prefix cache; every run gives
    plain decoding's greedy tokens."""
    from dflash_agent.bench.spec import module_prompt

    plain = embedded_engine(1024, spec=SpecConfig(enabled=False), prefix_cache=False, device="cpu")
    lookup = Engine(plain.model, plain.tokenizer, plain.n_ctx, plain.model_name, spec=SpecConfig(),
                    runner=plain.runner)
    try:
        prompt = module_prompt(plain, 460)
        assert 400 < len(prompt) < 512
        expected = _greedy(plain, prompt, 120)
        for run in range(2):
            events = asyncio.run(lookup.complete(GenerateRequest(prompt, max_tokens=120)))
            assert events.ids == expected
            assert events.final.usage.cached_tokens == (0 if run == 0 else len(prompt))
        stats = events.final.spec
        if plain.runner.cpu is not None:  # the C layers verify 65-row blocks
            assert plain.runner.step_rows(plain.runner.new_cache(1024)) == 65
            assert max(stats.accept_lengths) > 16 and "copy" in stats.by_source
    finally:
        lookup.close()
        plain.close()


def test_the_cpu_default_is_the_packed_path_where_the_kernels_build(embedded_engine):
    if cpu_dot() is None:
        pytest.skip("no C compiler: the CPU dot kernels cannot be built")
    engine = embedded_engine(64, spec=SpecConfig(enabled=False), device="cpu")
    try:
        head = engine.model.embed_tokens.weight
        assert isinstance(head, PackedWeight) and isinstance(head.cpu, CpuDotWeight)
        assert isinstance(engine.model.layers[0].mlp.down_proj.weight.cpu, CpuDotWeight)
    finally:
        engine.close()


@pytest.fixture
def no_vector_build(monkeypatch):
    """A CPU that none of the vector builds covers (the generic scalar build is all it could run): auto mode."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.setattr(cpu_dot_module, "cpu_flags", lambda: frozenset({"fpu", "sse2"}))
    cpu_dot.cache_clear()
    yield
    cpu_dot.cache_clear()


def test_without_vector_kernels_the_cpu_default_is_what_fits_in_ram(no_vector_build, monkeypatch, caplog):
    """weights="auto" there: dequantized where that fits in half the available RAM (its float32 GEMMs prefill
    faster than torch's int4 / int8 kernels), else kept packed for torch's kernels, as a 31B model must be; the
    log says which."""
    assert cpu_dot() is None
    ckpt = open_checkpoint(resolve_model_path("embedded"))
    exact = checkpoint_weight_bytes(ckpt.tensors, torch.float32, packed=False)
    packed = checkpoint_weight_bytes(ckpt.tensors, torch.float32, packed=True)
    assert packed < exact / 2
    assert cpu_weights(ckpt.tensors, torch.float32, c_kernels=True, available_bytes=1) == "packed"
    assert cpu_weights(ckpt.tensors, torch.float32, c_kernels=False, available_bytes=4 * exact) == "exact"
    assert cpu_weights(ckpt.tensors, torch.float32, c_kernels=False, available_bytes=exact) == "packed"

    engine = Engine.load("embedded", device="cpu", ctx_size=64, progress=False, spec=SpecConfig(enabled=False))
    try:
        head = engine.model.embed_tokens.weight
        assert not isinstance(head, PackedWeight) and head.dtype == torch.float32
    finally:
        engine.close()

    # dequantized weights would take more than half of it; packed ones fit beside memory_plan.CPU_RESERVE
    monkeypatch.setattr(memory_plan, "available_ram_bytes", lambda: int(exact * 1.99))
    with caplog.at_level(logging.INFO, logger=memory_plan.__name__):
        engine = Engine.load("embedded", device="cpu", ctx_size=64, progress=False, spec=SpecConfig(enabled=False))
    try:
        assert "kept packed for torch's int4 / int8 kernels" in caplog.text
        head = engine.model.embed_tokens.weight
        assert isinstance(head, PackedWeight) and isinstance(head.cpu, CpuInt4 | CpuInt8)
        assert len(_greedy(engine, engine.tokenizer.encode("def add(a, b):"), 8)) == 8
    finally:
        engine.close()


def _resident_bytes_of_mapping(address: int) -> int:
    """Resident bytes of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "Rss:":
            return int(fields[1]) * 1024
    raise AssertionError("no mapping holds the address")


def test_a_load_holds_one_copy_of_the_weights():
    """Repacking hands the file's pages back as it goes: after the load the mapped GGUF holds next to nothing in
    memory, only the repacked copy does (and the repacked model still gives the file's exact rows)."""
    if cpu_dot() is None or not platform.system() == "Linux":
        pytest.skip("the C kernels and /proc/self/smaps")
    path = resolve_model_path("embedded")
    ckpt = open_checkpoint(path)
    model = build_model(ckpt, "cpu", torch.float32, progress=False, repack_cpu=True)
    assert _resident_bytes_of_mapping(ckpt.gguf.mapping.ctypes.data) < 0.05 * path.stat().st_size  # the header and norms: ~3%
    head = model.embed_tokens.weight
    ids = torch.tensor([2, 105, 4000])
    assert torch.equal(head[ids], head.packed.dequantize()[ids].to(head.dtype))  # the blocks page in again
