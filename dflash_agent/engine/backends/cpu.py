"""Decode and verification steps on the CPU: the decoder layers in one call into kernels.cpu.cpu_dot's C layer,
the final norm and LM head in another, the embedding rows read by id in C.

With every matrix repacked for the C matmuls (engine.model.packed), a decode step of the eager model spends
more time dispatching PyTorch's small ops (norms, RoPE, attention of one token) than in the matmuls; the C
layer does the same computation per token row. It takes the steps the eager path would run with
the "kernel" cache plan (a few new tokens, a float32 cache); prefill, int8 caches and anything else stay on
the eager layers, which remain the reference the tests hold this path to.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import time

import torch

from ...kernels.cpu.cpu_dot import CpuDot, HeadScreen, IntMatrix, LayerCache, LayerWeights, Matrix
from ..cache.kv_cache import LayerKV
from ..host_memory import available_ram_bytes
from ..limits import MAX_ROWS, SCREEN_ROWS
from ..model.packed import CpuDotWeight, PackedWeight, cpu_dot

log = logging.getLogger(__name__)

SCREEN_BYTES_PER_WEIGHT = 1.375  # a HeadScreen's: the integers, and three floats per block of 32
# the builds with a vector screen (cpu_layer.c): AVX-512 VNNI's vpdpbusd, AVX2's vpmaddubsw on 7-bit activations
SCREEN_SIMD = frozenset({"avx512", "avx2"})
SCREEN_SHARE = 0.1  # of the available RAM at most for the screen: a 31B's head would take 1.4 GB


def _int_matrix(weight) -> IntMatrix | None:
    """The matrix of a weight repacked for the C matmuls (None: it is not)."""
    if not isinstance(weight, PackedWeight) or not isinstance(weight.cpu, CpuDotWeight):
        return None
    return weight.cpu.matrix


def _struct(matrix: IntMatrix, keep: list) -> Matrix:
    """matrix's C struct, its tensors added to keep: the struct holds bare pointers, and a weight re-placed or
    reloaded after `build` must not free memory C still reads."""
    keep.extend(matrix.tensors())
    return matrix.struct()


def _float(tensor: torch.Tensor, keep: list) -> int:
    tensor = tensor.float().contiguous()
    keep.append(tensor)
    return tensor.data_ptr()


def _add_experts(weights: LayerWeights, layer, config, keep: list, norm) -> bool:
    """A MoE layer's router and routed experts into its LayerWeights (False: its expert stacks are not repacked for
    the C matmuls, one matrix per expert). The router may be repacked or float: llama.cpp keeps it in float."""
    stacks = [layer.experts.gate_up_proj, layer.experts.down_proj]
    if not all(isinstance(s, PackedWeight) and s.experts is not None for s in stacks):
        return False
    found = [[_int_matrix(m) for m in s.experts] for s in stacks]
    if any(m is None for f in found for m in f):
        return False
    gate_up, down = ((Matrix * len(f))(*(_struct(m, keep) for m in f)) for f in found)
    keep += [gate_up, down]
    router = layer.router
    router_matrix = _int_matrix(router.proj.weight)
    if router_matrix is not None:
        weights.router = _struct(router_matrix, keep)
    elif isinstance(router.proj.weight, PackedWeight):
        return False
    else:
        weights.router_w = _float(router.proj.weight, keep)
    weights.router_scale = _float(router.scale, keep)
    weights.expert_scale = _float(router.per_expert_scale, keep)
    weights.expert_gate_up, weights.expert_down = ctypes.addressof(gate_up), ctypes.addressof(down)
    weights.post_ff_norm_1 = norm(layer.post_feedforward_layernorm_1)
    weights.pre_ff_norm_2 = norm(layer.pre_feedforward_layernorm_2)
    weights.post_ff_norm_2 = norm(layer.post_feedforward_layernorm_2)
    weights.experts, weights.top_k, weights.expert_width = (config.moe.num_experts, config.moe.top_k,
                                                            config.moe.intermediate_size)
    return True


class CpuDecodeLayers:
    """The C layers of one model (see the module doc); `build` gives None when the model does not qualify."""

    def __init__(self, lib: CpuDot, layers: list[LayerWeights], keep: list,
                 inv_freqs: list[torch.Tensor], head: tuple[torch.Tensor, Matrix, float] | None = None,
                 embedding: tuple[CpuDotWeight, torch.Tensor] | None = None,
                 screen: HeadScreen | None = None) -> None:
        self.lib, self.layers = lib, (LayerWeights * len(layers))(*layers)
        self._keep = keep  # every tensor and array the structs point into (norm weights, matrices)
        # each distinct RoPE once (float32, contiguous) and which one each layer takes
        index: dict[int, int] = {}
        self._rope_of_layer = [index.setdefault(id(f), len(index)) for f in inv_freqs]
        distinct = {index[id(f)]: f for f in inv_freqs}
        self._inv_freqs = [distinct[i].float().contiguous() for i in range(len(index))]
        self._head = head  # (final norm as applied, LM head, eps) when the head is repacked for the C matmuls
        self._embedding = embedding  # (the repacked embedding, its scale) likewise
        self._screen = screen  # the head's screen for greedy blocks (vector builds: the scalar one would not pay)
        self._screen_struct = None if screen is None else screen.struct()
        self._unit_norm = None if head is None else torch.ones_like(head[0])

    @classmethod
    def build(cls, model) -> CpuDecodeLayers | None:
        """For a float32 model on the CPU whose every layer matrix is repacked for the C matmuls."""
        lib = cpu_dot()
        if lib is None or model.device.type != "cpu" or model.dtype != torch.float32:
            return None
        config, keep, layers = model.config, [], []

        def norm(module) -> int | None:
            if module is None:  # a KV-sharing layer's K norm
                return None
            weight = (module.offset + module.weight.float()).contiguous()
            keep.append(weight)
            return weight.data_ptr()

        for index, (layer, spec) in enumerate(zip(model.layers, config.layers, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            linears = {"q_proj": attn.q_proj, "k_proj": attn.k_proj, "v_proj": attn.v_proj, "o_proj": attn.o_proj,
                       "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
            found = {name: None if m is None else _int_matrix(m.weight) for name, m in linears.items()}
            if any(found[name] is None and m is not None for name, m in linears.items()):
                return None
            matrices = {name: Matrix() if f is None else _struct(f, keep) for name, f in found.items()}
            scalar = 1.0 if layer.layer_scalar is None else float(layer.layer_scalar)
            weights = LayerWeights(
                **matrices,
                input_norm=norm(layer.input_layernorm), post_attn_norm=norm(layer.post_attention_layernorm),
                pre_ff_norm=norm(layer.pre_feedforward_layernorm), post_ff_norm=norm(layer.post_feedforward_layernorm),
                q_norm=norm(attn.q_norm), k_norm=norm(attn.k_norm),
                hidden=config.hidden_size, heads=config.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                intermediate=config.layer_intermediate_size(index), v_norm=int(attn.v_norm is not None),
                eps=config.rms_norm_eps, scale=attn.scale, layer_scalar=scalar,
            )
            if layer.experts is not None and not _add_experts(weights, layer, config, keep, norm):
                return None
            if config.per_layer_input:
                found = [_int_matrix(m.weight) for m in (layer.per_layer_input_gate, layer.per_layer_projection)]
                if None in found:
                    return None
                weights.per_layer_gate, weights.per_layer_proj = (_struct(m, keep) for m in found)
                weights.post_per_layer_norm = norm(layer.post_per_layer_input_norm)
                weights.per_layer_width = config.per_layer_input
            layers.append(weights)
        embedding = model.embed_tokens.weight
        if isinstance(embedding, PackedWeight) and isinstance(embedding.cpu, CpuDotWeight):
            embedding = (embedding.cpu, torch.tensor(config.embed_scale, dtype=torch.float32))
        else:
            embedding = None
        head_matrix = _int_matrix(model.output_weight)
        head = screen = None
        if head_matrix is not None:
            final_norm = (model.norm.offset + model.norm.weight.float()).contiguous()
            head = (final_norm, _struct(head_matrix, keep), config.rms_norm_eps)
            ram = available_ram_bytes()
            fits = ram is None or head_matrix.n * head_matrix.k * SCREEN_BYTES_PER_WEIGHT <= ram * SCREEN_SHARE
            if lib.simd in SCREEN_SIMD and config.final_softcap is None and head_matrix.k % 32 == 0 and fits:
                began = time.perf_counter()
                screen = HeadScreen.of(lib, head_matrix)
                log.info("LM head screen for greedy blocks: %.0f MB in %.1f s", screen.nbytes / 1e6,
                         time.perf_counter() - began)
        return cls(lib, layers, keep, model.layer_inv_freqs(), head, embedding, screen)

    def embed(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Scaled embeddings [T, hidden] float32 of token ids [T] on the CPU, as GemmaModel.embed gives them (None:
        the embedding is not repacked for the C kernels)."""
        if self._embedding is None or ids.dim() != 1 or ids.device.type != "cpu":
            return None
        weight, scale = self._embedding
        return weight.rows(ids).mul_(scale)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The final norm and LM head of rows hidden [T, hidden] float32 in one C call (None: the head is not
        repacked for it, or too many rows); as GemmaModel.logits before its softcap."""
        if self._head is None or hidden.dim() != 2 or hidden.shape[0] > MAX_ROWS or hidden.dtype != torch.float32:
            return None
        norm, matrix, eps = self._head
        return self.lib.norm_linear(hidden.contiguous(), norm, eps, matrix)

    def greedy(self, hidden: torch.Tensor, normed: bool = False) -> list[int | None] | None:
        """Each row's argmax of `logits(hidden)`, the same picks bit for bit, through the head's screen (None: no
        screen, or rows it does not take; a None pick: a row left to the whole head). normed: rows a drafter's own
        norm gave, taken as they are up to a positive scale per row (unit norm weights: a drafter's picks need not
        be the target's to the bit)."""
        if (self._screen is None or hidden.dim() != 2 or not SCREEN_ROWS <= hidden.shape[0] <= MAX_ROWS
                or hidden.dtype != torch.float32):
            return None
        norm, matrix, eps = self._head
        if normed:
            norm, eps = self._unit_norm, 0.0
        return self.lib.norm_head_argmax(hidden.contiguous(), norm, eps, matrix, self._screen, self._screen_struct)

    @staticmethod
    def takes(rows: int, kv: list[LayerKV]) -> bool:
        """Whether a forward of `rows` new tokens over caches `kv` runs here (before its plan is made)."""
        return rows <= MAX_ROWS and all(layer.k_scale is None and layer.keys_from is None
                                        and layer.k.dtype == torch.float32 for layer in kv)

    def forward(self, x: torch.Tensor, plan, kv: list[LayerKV], capture: tuple[int, ...],
                per_layer: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The layers over embeddings x [T, hidden] with a "kernel" StepPlan (engine.model.gemma), in one C call; as
        GemmaModel.layers_forward (per_layer: a PLE model's inputs [T, layers, width])."""
        return self.forward_groups(x, [(plan, kv)], capture, per_layer)

    def forward_groups(self, x: torch.Tensor, groups: list[tuple], capture: tuple[int, ...],
                       per_layer: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The layers over the rows of several sequences in one C call: x [T, hidden] holds each group's rows in
        turn, a group is (its "kernel" StepPlan, its caches), and each row attends to its own group's caches. Every
        weight is read once for all rows; a row's result is what `forward` of its group alone gives. A KV-sharing
        layer's cache is its owner's (the same LayerKV): it reads the keys the owner wrote earlier in the call."""
        x = x.contiguous()
        if per_layer is not None:
            per_layer = per_layer.float().contiguous()
        query = torch.cat([plan.positions for plan, _ in groups]).contiguous()
        bounds = torch.tensor([0, *itertools.accumulate(plan.positions.shape[0] for plan, _ in groups)])
        n, g = len(self.layers), len(groups)
        tables = [self.lib.rope_table(query, inv_freq) for inv_freq in self._inv_freqs]
        keep = [t for pair in tables for t in pair]  # what the structs point into, alive until the call returns
        caches = (LayerCache * (n * g))()
        for j, (plan, kv) in enumerate(groups):
            kinds = {}  # sliding or not -> where that kind of layer writes and which slots it reads
            for sliding, layer_plan in ((False, plan.full), (True, plan.sliding)):
                slots, key_pos = layer_plan.slots.contiguous(), layer_plan.positions.key
                key_pos = None if key_pos is None else key_pos.contiguous()
                keep += [slots, key_pos]
                kinds[sliding] = (slots.data_ptr(), 0 if key_pos is None else key_pos.data_ptr(), layer_plan.end,
                                  layer_plan.positions.window or 0)
            for i, layer_kv in enumerate(kv):
                slots, key_pos, end, window = kinds[layer_kv.sliding]
                k, v, weights = layer_kv.k, layer_kv.v, self.layers[i]
                # C addresses slot s at s * kv_heads * head_dim floats and takes its capacity from here
                if k.shape != v.shape or k.shape[1:] != (weights.kv_heads, weights.head_dim) or not (
                        k.is_contiguous() and v.is_contiguous()):
                    raise ValueError(f"layer {i}'s cache is {tuple(k.shape)} / {tuple(v.shape)}, not contiguous "
                                     f"[slots, {weights.kv_heads}, {weights.head_dim}]")
                caches[i * g + j] = LayerCache(k=k.data_ptr(), v=v.data_ptr(), slots=k.shape[0], write_slots=slots,
                                               key_pos=key_pos, n_keys=k.shape[0] if end is None else end,
                                               window=window)
        captured = {i: torch.empty_like(x) for i in capture if 0 <= i < n}
        pointers = ctypes.c_void_p * n
        cos = pointers(*(tables[r][0].data_ptr() for r in self._rope_of_layer))
        sin = pointers(*(tables[r][1].data_ptr() for r in self._rope_of_layer))
        copies = pointers(*(captured[i].data_ptr() if i in captured else None for i in range(n)))
        self.lib.layers_forward(self.layers, caches, x, query, cos, sin, copies, bounds, per_layer)
        return x, captured
