"""Decode and verification steps on the CPU, each decoder layer one call into kernels.cpu_dot's C layer.

With every matrix repacked for the C matmuls (engine.packed_linear), a decode step of the eager model spends
more time dispatching PyTorch's small ops (norms, RoPE, attention of one token) than in the matmuls; the C
layer does the same computation per token row in one call. It takes the steps the eager path would run with
the "kernel" cache plan (a few new tokens, a float32 cache); prefill, int8 caches and anything else stay on
the eager layers, which remain the reference the tests hold this path to.
"""

from __future__ import annotations

import torch

from ..kernels.cpu_dot import CpuDot, LayerCache, LayerWeights, Matrix
from .kv_cache import LayerKV
from .packed_linear import GEMM_ROWS, CpuDotWeight, PackedWeight, cpu_dot


def _matrix(linear) -> Matrix | None:
    if linear is None:
        return Matrix()
    weight = linear.weight
    if not isinstance(weight, PackedWeight) or not isinstance(weight.cpu, CpuDotWeight):
        return None
    return weight.cpu.matrix.struct()


class CpuDecodeLayers:
    """The C layers of one model (see the module doc); `build` gives None when the model does not qualify."""

    def __init__(self, lib: CpuDot, layers: list[LayerWeights], keep: list[torch.Tensor]) -> None:
        self.lib, self.layers = lib, layers
        self._keep = keep  # the norm weights the structs point into

    @classmethod
    def build(cls, model) -> CpuDecodeLayers | None:
        """For a float32 model on the CPU whose every layer matrix is repacked for the C matmuls."""
        lib = cpu_dot()
        if lib is None or model.device.type != "cpu" or model.dtype != torch.float32:
            return None
        config, keep, layers = model.config, [], []

        def norm(module) -> int:
            weight = (module.offset + module.weight.float()).contiguous()
            keep.append(weight)
            return weight.data_ptr()

        for layer, spec in zip(model.layers, config.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            matrices = [_matrix(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                                             mlp.up_proj, mlp.down_proj)]
            if any(m is None for m in matrices):
                return None
            scalar = 1.0 if layer.layer_scalar is None else float(layer.layer_scalar)
            layers.append(LayerWeights(
                *matrices,
                norm(layer.input_layernorm), norm(layer.post_attention_layernorm),
                norm(layer.pre_feedforward_layernorm), norm(layer.post_feedforward_layernorm),
                norm(attn.q_norm), norm(attn.k_norm),
                config.hidden_size, config.num_heads, spec.num_kv_heads, spec.head_dim, config.intermediate_size,
                int(attn.v_norm is not None), config.rms_norm_eps, attn.scale, scalar,
            ))
        return cls(lib, layers, keep)

    @staticmethod
    def takes(rows: int, kv: list[LayerKV]) -> bool:
        """Whether a forward of `rows` new tokens over caches `kv` runs here (before its plan is made)."""
        return rows < GEMM_ROWS and all(layer.k_scale is None and layer.k.dtype == torch.float32 for layer in kv)

    def forward(self, x: torch.Tensor, plan, kv: list[LayerKV], tables: list[tuple[torch.Tensor, torch.Tensor]],
                capture: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The layers over embeddings x [T, hidden] with a "kernel" StepPlan (engine.model) and each layer's RoPE
        cos / sin [T, head_dim]; as GemmaModel.layers_forward."""
        x = x.contiguous()
        query = plan.positions.contiguous()
        captured: dict[int, torch.Tensor] = {}
        keep = []  # the index tensors the cache structs point into, alive until the calls return
        for i, (weights, layer_kv, (cos, sin)) in enumerate(zip(self.layers, kv, tables, strict=True)):
            layer_plan = plan.sliding if layer_kv.sliding else plan.full
            slots = layer_plan.slots.contiguous()
            key_pos = layer_plan.positions.key
            if key_pos is not None:
                key_pos = key_pos.contiguous()
            keep += [slots, key_pos]
            cache = LayerCache(
                layer_kv.k.data_ptr(), layer_kv.v.data_ptr(), slots.data_ptr(),
                0 if key_pos is None else key_pos.data_ptr(),
                layer_kv.k.shape[0] if layer_plan.end is None else layer_plan.end,
                layer_plan.positions.window or 0,
            )
            self.lib.layer_forward(weights, cache, x, query, cos.contiguous(), sin.contiguous())
            if i in capture:
                captured[i] = x.clone()
        return x, captured
