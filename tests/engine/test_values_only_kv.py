"""Full-attention layers of attention_k_eq_v configs keep V alone and rebuild K from it (engine.cache.kv_cache): one
tensor a layer in the model's dtype (8-bit caches keep both), and the same steps as a cache that keeps both."""

from __future__ import annotations

import pytest
import torch

from dflash_agent.engine.cache.kv_cache import KVCache, keeps_values_only
from dflash_agent.engine.load.weights import build_model
from dflash_agent.engine.runner import StepRunner
from tests.helpers.packed import VOCAB, tiny_family_config, tiny_packed_checkpoint


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_packed_checkpoint(), "cpu", torch.float32, progress=False)


def test_a_full_layer_of_a_k_eq_v_config_keeps_one_tensor(model) -> None:
    config = model.config
    values_only = [i for i, spec in enumerate(config.layers) if keeps_values_only(spec)]
    assert values_only == [i for i, spec in enumerate(config.layers) if not spec.sliding]
    one, both = model.new_cache(64), model.new_cache(64, values_only=False)
    for i in values_only:
        layer = one.layers[i]
        assert layer.k is layer.v and len(layer.storage()) == 1 and layer.keys_from is not None
        assert len(layer.kernel_tensors()) == 2  # the kernels still take keys and values
        assert layer.storage()[0].nbytes * 2 == sum(t.nbytes for t in both.layers[i].storage())
    assert all(one.layers[i].storage()[0].shape == both.layers[i].storage()[0].shape for i in range(config.num_layers))
    # an 8-bit cache keeps its keys (the kernel that would rebuild them from int8 values runs out of registers)
    assert all(layer.keys_from is None and len(layer.storage()) == 4 for layer in model.new_cache(64, "q8").layers)
    with pytest.raises(ValueError, match="an 8-bit cache keeps its keys"):
        KVCache(config, 64, kv_dtype="q8", keys_from=model.keys_from_values())
    # sliding layers and configs without attention_k_eq_v keep their keys
    assert not any(keeps_values_only(spec) for spec in config.layers if spec.sliding)
    ple = tiny_family_config("ple")
    assert [i for i, s in enumerate(ple.layers) if keeps_values_only(s)] == [1]  # the shared layer reads layer 1's


def _steps(runner, cache) -> list[torch.Tensor]:
    """Prefill past the sliding window, decode, a verify block, a rollback, decode: each step's logits."""
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (40,))
    out = [runner.forward(ids[:21], cache, logits_at=torch.arange(21)).logits]
    out.append(runner.forward(ids[21:22], cache).logits)
    out.append(runner.forward(ids[22:27], cache, logits_at=torch.arange(5)).logits)
    cache.rollback(24)
    out += [runner.forward(ids[i:i + 1], cache).logits for i in range(27, 40)]  # the ring wraps again
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rebuilt_keys_give_the_steps_stored_keys_give(model, dtype) -> None:
    """K = rope(V * w) rebuilt as attention reads it: float32 to its last bits; bfloat16 within what rounding the
    stored keys (rather than V) costs, 1.6% on this random model, whose logits bfloat16 itself moves 10% from
    float32's."""
    net = model if dtype == torch.float32 else build_model(tiny_packed_checkpoint(), "cpu", dtype, progress=False)
    runner = StepRunner(net)
    kept = _steps(runner, net.new_cache(64, values_only=False))
    rebuilt = _steps(runner, net.new_cache(64))
    for a, b in zip(kept, rebuilt, strict=True):
        assert (a - b).norm() / a.norm() < (1e-5 if dtype == torch.float32 else 3e-2)
        if dtype == torch.float32:
            assert torch.equal(a.argmax(-1), b.argmax(-1))
