"""kernels.triton.quant_tuning: every tile it may choose computes the product (and keeps rows apart), the choice is the
cheapest timed, and choices are kept per GPU. Timing itself needs CUDA (the last test)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from gguf import GGMLQuantizationType

from dflash_agent.engine.formats.quant import PackedTensor, dequantize
from tests.helpers.quant import K, N, check, random_weight

T = GGMLQuantizationType


def _candidates(qt, qtype, device: torch.device) -> list:
    """The tiles to run: every candidate on a GPU; under the interpreter, where warps and stages change nothing,
    one per (columns, blocks a step)."""
    shapes = qt.tile_shapes(qtype)
    if device.type == "cpu":
        shapes = list({(s.block_n, s.blocks): s for s in shapes}.values())
    return shapes


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_every_candidate_tile_computes_the_product_and_keeps_rows_apart(kernels, qtype) -> None:
    qm, qt = kernels.load("triton.quant_matmul"), kernels.load("triton.quant_tuning")
    dev = kernels.device
    raw = random_weight(qtype, N, K, seed=11).to(dev)
    w = dequantize(raw.cpu(), qtype, (N, K))
    x = torch.randn(9, K, device=dev)
    for shape in _candidates(qt, qtype, dev):
        steps = qm.k_steps(qtype, K, shape)
        for split in [s for s in qt.SPLITS if steps % s == 0]:
            tile = qm.TileChoice(shape, split)
            block = qm.quant_matmul(x[4:9], raw, qtype, N, tile=tile)
            check(block.cpu(), x[4:9].cpu(), w)
            alone = [qm.quant_matmul(x[i:i + 1], raw, qtype, N, tile=tile) for i in range(4)]
            together = qm.quant_matmul(x, raw, qtype, N, one_token_rows=4, tile=tile)
            assert all(torch.equal(together[i:i + 1], alone[i]) for i in range(4)), tile
            assert torch.equal(together[4:], block), tile
    # prompt chunks (more than 16 rows of one sequence) keep the 64-row tiles whatever the tile
    many = torch.randn(20, K, device=dev)
    tile = qm.TileChoice(qt.tile_shapes(qtype)[-1], 1)
    assert torch.equal(qm.quant_matmul(many, raw, qtype, N, tile=tile), qm.quant_matmul(many, raw, qtype, N))


def test_a_tile_that_does_not_fit_k_is_refused(kernels) -> None:
    qm = kernels.load("triton.quant_matmul")
    raw = random_weight(T.Q4_K, N, K, seed=0).to(kernels.device)
    x = torch.randn(1, K, device=kernels.device)
    with pytest.raises(ValueError, match="K of 2 steps does not split 4 ways"):
        qm.quant_matmul(x, raw, T.Q4_K, N, tile=qm.TileChoice(qm.launch_shape(1, T.Q4_K), 4))
    with pytest.raises(ValueError, match="a tuned tile has 16 rows"):
        qm.quant_matmul(x, raw, T.Q4_K, N, tile=qm.TileChoice(qm.decode_shape(T.Q4_K), 1))


def test_choose_tile_takes_the_cheapest_shape_then_split(kernels) -> None:
    qm, qt = kernels.load("triton.quant_matmul"), kernels.load("triton.quant_tuning")
    n, k, sms = 5376, 21504, 132  # a down projection: 84 tiles of 64 columns, 168 steps of 128 values
    shapes = qt.tile_shapes(T.Q4_0)
    default = qm.launch_shape(16, T.Q4_0)
    assert shapes[0] == default and len(shapes) == len(set(shapes)) == 24
    fastest = qm.LaunchShape(16, 32, 8, 8, num_stages=3)

    from triton.runtime.errors import OutOfResources

    def cost(choice) -> float:
        if choice.shape.block_n == 128:
            raise OutOfResources(300000, 232448, "shared memory")  # does not launch on this card
        return (10.0 if choice.shape == fastest else 20.0) + abs(choice.split - 2)

    calls: list = []
    best, measured = qt.choose_tile(T.Q4_0, n, k, sms, lambda c: calls.append(c) or cost(c))
    assert best == qm.TileChoice(fastest, 2)
    default_split = qm.default_split(T.Q4_0, n, k, default, sms)
    assert measured == {"default_us": cost(qm.TileChoice(default, default_split)), "best_us": 10.0,
                        "timed": len(set(calls))}
    # the default warms up, then every shape once at its default split, then the fastest shape at the splits not
    # yet timed
    steps = qm.k_steps(T.Q4_0, k, fastest)
    assert calls[0] == calls[1] == qm.TileChoice(default, default_split)
    assert len(calls) - 1 == len(set(calls)) == 24 + sum(1 for s in qt.SPLITS if steps % s == 0) - 1

    def unfit(choice) -> float:
        raise OutOfResources(1, 0, "registers")

    best, measured = qt.choose_tile(T.Q4_0, n, k, sms, unfit)
    assert best == qm.TileChoice(default, default_split) and measured["best_us"] == float("inf")

    def broken(choice) -> float:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):  # a GPU in trouble is not an unfit tile
        qt.choose_tile(T.Q4_0, n, k, sms, broken)


def test_tile_choices_are_kept_per_gpu(kernels, tmp_path, caplog) -> None:
    qm, qt = kernels.load("triton.quant_matmul"), kernels.load("triton.quant_tuning")
    path = tmp_path / "tuning" / "kernel-tuning.json"
    raw = torch.empty(0, dtype=torch.uint8)  # the cost stands in for timing: no kernel runs here
    fastest = qm.LaunchShape(16, 128, 4, qm.launch_shape(16, T.Q4_K).blocks, num_stages=2)
    timed: list[str] = []

    def cost_on(gpu: str):
        def cost(choice) -> float:
            timed.append(gpu)
            return (1.0 if choice.shape == fastest else 5.0) + (0.0 if choice.split == 2 else 0.5)
        return cost

    h200 = qt.TileTuning("NVIDIA H200", 132, path)
    assert h200.kept(T.Q4_K, 8192, 4096, torch.bfloat16) is None
    assert h200.choose(raw, T.Q4_K, 8192, 4096, torch.bfloat16, cost_on("h200")) == qm.TileChoice(fastest, 2)
    n_timed = len(timed)
    again = qt.TileTuning("NVIDIA H200", 132, path)  # the next load: read, not timed
    assert again.kept(T.Q4_K, 8192, 4096, torch.bfloat16) == qm.TileChoice(fastest, 2)
    assert again.choose(raw, T.Q4_K, 8192, 4096, torch.bfloat16, cost_on("h200")) == qm.TileChoice(fastest, 2)
    assert len(timed) == n_timed
    # another card, another activation dtype or matrix shape: timed
    qt.TileTuning("NVIDIA GeForce RTX 4090", 128, path).choose(raw, T.Q4_K, 8192, 4096, torch.bfloat16,
                                                               cost_on("4090"))
    again.choose(raw, T.Q4_K, 8192, 4096, torch.float16, cost_on("fp16"))
    assert {"4090", "fp16"} <= set(timed)
    entries = json.loads(path.read_text())
    assert len(entries) == 3 and all(e["best_us"] == 1.0 < e["default_us"] for e in entries.values())
    # an entry that is not a tile (a split K does not allow), or a file that is not JSON: timed again, with a warning
    key = next(k for k in entries if k.startswith("NVIDIA H200") and k.endswith("bfloat16"))
    entries[key]["split"] = 3
    path.write_text(json.dumps(entries))
    timed.clear()
    with caplog.at_level(logging.WARNING):
        qt.TileTuning("NVIDIA H200", 132, path).choose(raw, T.Q4_K, 8192, 4096, torch.bfloat16, cost_on("h200"))
        assert timed and "not a tile" in caplog.text
        # a tile size read back as 64.0 is not a tile either
        entries = json.loads(path.read_text())
        entries[key]["block_n"] = float(entries[key]["block_n"])
        path.write_text(json.dumps(entries))
        assert qt.TileTuning("NVIDIA H200", 132, path).kept(T.Q4_K, 8192, 4096, torch.bfloat16) is None
        # a shape no tile of which runs serves the default, and is not kept (timed again at the next load)
        from triton.runtime.errors import OutOfResources

        def unfit(choice) -> float:
            raise OutOfResources(1, 0, "shared memory")

        tuning = qt.TileTuning("NVIDIA H200", 132, path)
        assert tuning.choose(raw, T.Q6_K, 4096, 4096, torch.bfloat16, unfit).shape == qm.launch_shape(1, T.Q6_K)
        assert "could be timed" in caplog.text and tuning.kept(T.Q6_K, 4096, 4096, torch.bfloat16) is None
        assert not any("Q6_K" in kept for kept in json.loads(path.read_text()))
        path.write_text("{not json")
        fresh = qt.TileTuning("NVIDIA H200", 132, path)
        assert fresh.choices == {} and "ignoring the kernel tuning file" in caplog.text


def test_a_packed_weight_multiplies_with_its_tile(kernels, monkeypatch) -> None:
    from dflash_agent.engine.model.packed import PackedWeight

    qm = kernels.load("triton.quant_matmul")
    raw = random_weight(T.Q4_0, N, K, seed=5)
    weight = PackedWeight(PackedTensor(raw, T.Q4_0, (N, K)), torch.float32)
    weight.tile = qm.TileChoice(qm.LaunchShape(16, 32, 8, 8, num_stages=3), 2)
    seen = []
    real = qm.quant_matmul_launch
    monkeypatch.setattr(qm, "quant_matmul_launch", lambda *a, **kw: seen.append(kw.get("tile")) or real(*a, **kw))
    x = torch.randn(3, K)
    y = torch.nn.functional.linear(x, weight)
    assert seen == [weight.tile]
    assert torch.equal(y, qm.quant_matmul(x, raw, T.Q4_0, N, tile=weight.tile))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="timing a tile needs CUDA")
def test_tiles_are_timed_on_the_gpu(tmp_path) -> None:
    from dflash_agent.engine.model.packed import TILE_TUNING_FILE, PackedWeight, choose_cuda_tiles
    from dflash_agent.kernels.triton import quant_matmul as qm
    from dflash_agent.kernels.triton.quant_tuning import tile_shapes

    n, k = 2048, 4096  # TUNED_WEIGHTS: the smallest that is timed
    raw = random_weight(T.Q4_K, n, k, seed=2).cuda()
    weights = [PackedWeight(PackedTensor(raw, T.Q4_K, (n, k)), torch.bfloat16) for _ in range(2)]
    path = tmp_path / TILE_TUNING_FILE
    choose_cuda_tiles(weights, path)
    tile = weights[0].tile
    assert tile is not None and tile is weights[1].tile and tile.shape in tile_shapes(T.Q4_K)
    (entry,) = json.loads(path.read_text()).values()
    assert entry["best_us"] <= entry["default_us"] < float("inf")
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    y = torch.nn.functional.linear(x, weights[0])
    exact = x.double() @ dequantize(raw.cpu(), T.Q4_K, (n, k)).cuda().double().T
    assert torch.allclose(y.double(), exact, rtol=2e-2, atol=2e-2 * float(exact.abs().max()))
    alone = qm.quant_matmul(x[:1], raw, T.Q4_K, n, tile=tile)
    assert torch.equal(alone, y[:1])
