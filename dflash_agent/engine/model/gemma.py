"""The Gemma 3 / Gemma 4 text decoder in plain PyTorch, one sequence at a time over a KV cache."""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.attention import (
    KeysFromValues,
    cache_attention,
    flash_attn_takes,
    grouped_attention,
    rows_cache_attention,
    triton_takes,
)
from ...kernels.dispatch import triton_runs
from ..cache.kv_cache import KVCache, LayerKV, keeps_values_only
from ..errors import ContextOverflowError
from ..formats.config import LayerSpec, ModelConfig, MoESpec
from ..limits import DEFAULT_SLACK
from .packed import PackedWeight


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [n, vocab] float32, for the positions asked for
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> its output [T, hidden]
    tokens: list[int] | None = None  # a greedy forward's: each asked-for position's argmax, in place of its logits


@dataclass(frozen=True)
class StepRows:
    """The rows of a step over several sequences on the Triton kernels (StepRunner.forward_groups), as the matmuls
    must see them so each row comes out as its sequence's step alone gives it: `sizes` rows per group in step order,
    the one-token groups (decode rows) first, then blocks of at most VERIFY_ROWS: all in the 16-row tiles, as each
    step alone takes them (a MoE's decode rows take their experts as GEMV rows, as a decode step alone does).
    `attention`: how the decode rows attend in one launch a layer (None: each group on its own)."""

    sizes: tuple[int, ...]
    attention: JointAttention | None = None

    @property
    def one_token(self) -> int:
        """How many leading rows are one-token groups'."""
        return next((i for i, n in enumerate(self.sizes) if n != 1), len(self.sizes))

    def spans(self) -> list[tuple[int, int]]:
        """Each group's [start, end) among the rows."""
        ends = list(itertools.accumulate(self.sizes))
        return [(end - n, end) for n, end in zip(self.sizes, ends, strict=True)]


class Linear(nn.Module):
    """y = x @ W^T with a weight loaded from the checkpoint (no bias anywhere in Gemma)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor, rows: StepRows | None = None) -> torch.Tensor:
        """rows: x [N, in] holds several sequences' steps (batched_linear)."""
        return F.linear(x, self.weight) if rows is None else batched_linear(x, self.weight, rows)


def batched_linear(x: torch.Tensor, weight: torch.Tensor, rows: StepRows) -> torch.Tensor:
    """x [N, in] @ weight^T over several sequences' rows, each row as its sequence's step alone computes it: packed
    weights in one set of launches that keep it so (kernels.triton.quant_matmul), others one matmul per sequence (a
    dense GEMM may choose its kernel, and so its sums, by the number of rows)."""
    if isinstance(weight, PackedWeight):
        return weight.linear(x, rows.one_token)
    return torch.cat([F.linear(x[a:b], weight) for a, b in rows.spans()])


class RMSNorm(nn.Module):
    """Computed in float32; the weight enters as (offset + w), offset 1 for HF Gemma 3 checkpoints."""

    def __init__(self, dim: int, eps: float, offset: float, with_weight: bool = True) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.register_buffer("weight", torch.empty(dim) if with_weight else None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        """With cos / sin [T, d], x is [..., T, heads, d] and the normed rows are rotated (`rotate`) too. With
        residual, residual + the norm (times scale, if given): a decoder layer's residual stream, in the norm's
        launch on the Triton path (a decode step of the 31B makes 180 launches fewer)."""
        # the kernel has no backward: training (the drafter trainer trains its norms) stays in PyTorch
        if triton_runs(x) and not (torch.is_grad_enabled() and (x.requires_grad or self.weight is not None
                                                                 and self.weight.requires_grad)):
            from ...kernels.triton.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, self.offset, cos, sin, residual, scale)
        weight = None if self.weight is None else self.offset + self.weight.float()
        y = F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).type_as(x)
        y = y if cos is None else rotate(y, cos, sin)
        if residual is not None:
            y = residual + y
        return y if scale is None else y * scale


Result = TypeVar("Result")


def run_to_end(steps: Generator[object, None, Result]) -> Result:
    """What a stepwise computation (forward_steps, layer_steps) returns, run without pausing."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style RoPE (dim i pairs with i + d/2); x [..., T, heads, d], cos/sin [T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_tables(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [T, 2 * len(inv_freq)] for `rotate` at positions [T], computed in float32."""
    freqs = positions[:, None].float() * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.num_heads = config.num_heads
        self.scale = config.attn_scale
        hidden, d, nkv = config.hidden_size, spec.head_dim, spec.num_kv_heads
        eps, offset = config.rms_norm_eps, config.norm_offset
        self.q_proj = Linear(hidden, config.num_heads * d)
        self.q_norm = RMSNorm(d, eps, offset)
        self.o_proj = Linear(config.num_heads * d, hidden)
        # a layer that shares another's K / V has no K / V weights of its own
        owns_kv = spec.kv_source is None
        self.k_proj = Linear(hidden, nkv * d) if owns_kv else None
        self.v_proj = Linear(hidden, nkv * d) if owns_kv and not spec.k_eq_v else None
        self.k_norm = RMSNorm(d, eps, offset) if owns_kv else None
        self.v_norm = RMSNorm(d, eps, offset, with_weight=False) if owns_kv and config.v_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | list[LayerKV],
        plan: LayerPlan | list[LayerPlan], shared: dict[int, StepKeys] | list[dict[int, StepKeys]] | None = None,
        index: int = 0, rows: StepRows | None = None,
    ) -> torch.Tensor:
        """x [..., T, hidden] (a leading batch dimension needs a batched kv and an SDPA plan). `shared` carries the
        keys each layer attended over to the layers that share them (KV-sharing models only). rows: x [N, hidden]
        holds several sequences' steps, and kv, plan and shared hold one of each per sequence."""
        lead, d = x.shape[:-1], self.spec.head_dim
        q = self.q_norm(self.q_proj(x, rows).view(*lead, self.num_heads, d), cos, sin)
        k = v = None
        if self.k_proj is not None:
            k_raw = self.k_proj(x, rows).view(*lead, -1, d)
            v = k_raw if self.v_proj is None else self.v_proj(x, rows).view(*lead, -1, d)
            k = self.k_norm(k_raw, cos, sin)
            if self.v_norm is not None:
                v = self.v_norm(v)
        if rows is None:
            out = self._attend(q, k, v, kv, plan, shared, index)
        else:  # each sequence's rows write and read its own cache: the decode rows together where they can
            joint = 0 if rows.attention is None else rows.one_token
            parts = [] if not joint else [self._attend_joint(q[:joint], None if k is None else k[:joint],
                                                             None if v is None else v[:joint], kv[:joint],
                                                             rows.attention, index)]
            parts += [self._attend(q[a:b], None if k is None else k[a:b], None if v is None else v[a:b],
                                   kv[g], plan[g], None if shared is None else shared[g], index)
                      for g, (a, b) in enumerate(rows.spans()) if g >= joint]
            out = torch.cat(parts)
        return self.o_proj(out.reshape(*lead, self.num_heads * d), rows)

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv: LayerKV, plan: LayerPlan,
                shared: dict[int, StepKeys] | None, index: int) -> torch.Tensor:
        if k is None or v is None:
            assert shared is not None and self.spec.kv_source is not None
            keys = shared[self.spec.kv_source]
        else:
            keys = plan.store(kv, k, v)
            if shared is not None:
                shared[index] = keys
        return plan.attend(q, keys, self.scale)

    def _attend_joint(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv: list[LayerKV],
                      joint: JointAttention, index: int) -> torch.Tensor:
        """Decode rows q [n, heads, d] of n sequences, each writing (unless this layer shares another's K / V, whose
        caches kv then holds) and attending its own cache, one launch for all (JointAttention)."""
        plan, first, offsets = joint.sliding if kv[0].sliding else joint.full, kv[0], joint.offsets[index]
        if k is not None and v is not None:
            first.write_rows(plan.slots, k, v, offsets)
        pos = plan.positions
        assert pos is not None
        return rows_cache_attention(q, first.k, first.v, pos.query, pos.key, pos.window, self.scale, offsets,
                                    first.k_scale, first.v_scale, first.keys_from)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor, rows: StepRows | None = None) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x, rows), approximate="tanh") * self.up_proj(x, rows), rows)


class Router(nn.Module):
    """Gemma 4's expert router: weightless RMSNorm x learned scale x hidden^-0.5 -> scores -> softmax over every
    expert -> the top k, renormalised, each times its expert's learned scale."""

    def __init__(self, config: ModelConfig, moe: MoESpec) -> None:
        super().__init__()
        self.top_k, self.eps = moe.top_k, config.rms_norm_eps
        self.proj = Linear(config.hidden_size, moe.num_experts)
        self.register_buffer("scale", torch.empty(config.hidden_size))
        self.register_buffer("per_expert_scale", torch.empty(moe.num_experts))

    def forward(self, x: torch.Tensor, rows: StepRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, k] float32, experts [N, k])."""
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).type_as(x)
        h = h * self.scale * x.shape[-1] ** -0.5
        probs = torch.softmax(self.proj(h, rows).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts].float(), experts


class Experts(nn.Module):
    """The routed experts' GeGLU MLPs, stacked: gate_up [experts, 2 x width, hidden], down [experts, hidden, width].
    Each token runs only its top k."""

    def __init__(self, config: ModelConfig, moe: MoESpec) -> None:
        super().__init__()
        self.register_buffer("gate_up_proj", torch.empty(moe.num_experts, 2 * moe.intermediate_size,
                                                         config.hidden_size))
        self.register_buffer("down_proj", torch.empty(moe.num_experts, config.hidden_size, moe.intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                rows: StepRows | None = None) -> torch.Tensor:
        """x [N, hidden], weights / experts [N, k] -> the weighted sum of each token's experts [N, hidden]. rows:
        several sequences' steps: with packed experts the one-token groups' tokens take the GEMV as a decode step
        alone does, each block its own tiles by expert; else each sequence's tokens alone."""
        packed = isinstance(self.gate_up_proj, PackedWeight) and isinstance(self.down_proj, PackedWeight)
        if rows is not None:
            if not packed:  # per sequence: the loop below multiplies as many rows as chose an expert
                return torch.cat([self.forward(x[a:b], weights[a:b], experts[a:b]) for a, b in rows.spans()])
            # the decode rows' pairs in one GEMV launch; each block's alone, since a launch's tile shape goes by the
            # most rows any expert has in it
            one = rows.one_token
            parts = ([(0, one, True)] if one else []) + [(a, b, False) for a, b in rows.spans()[one:]]
            return torch.cat([self._grouped(x[a:b], weights[a:b], experts[a:b], single) for a, b, single in parts])
        grouped = self._grouped(x, weights, experts, x.shape[0] == 1) if packed else None
        if grouped is not None:
            return grouped
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():
            token, slot = torch.where(experts == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[expert])
            out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 single: bool) -> torch.Tensor | None:
        """forward through two grouped launches where the Triton kernels run (each a matmul of every token's chosen
        experts: PackedWeight.expert_linear), else None. single: each pair a GEMV row (decode steps: one token's k
        distinct experts, taken without asking the GPU how many rows each expert has; several sequences' decode rows,
        each as alone), else tiles by expert."""
        n, k = experts.shape
        chosen = experts.reshape(-1)
        token_rows = torch.arange(n, device=x.device).repeat_interleave(k)
        gate_up = self.gate_up_proj.expert_linear(x, token_rows, chosen, single)
        if gate_up is None:
            return None
        gate, up = gate_up.chunk(2, dim=-1)
        pair_rows = torch.arange(n * k, device=x.device)
        y = self.down_proj.expert_linear(F.gelu(gate, approximate="tanh") * up, pair_rows, chosen, single)
        return (y.view(n, k, -1) * weights[..., None].to(y.dtype)).sum(dim=1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec, index: int) -> None:
        super().__init__()
        eps, offset, hidden = config.rms_norm_eps, config.norm_offset, config.hidden_size
        self.index = index
        self.input_layernorm = RMSNorm(hidden, eps, offset)
        self.self_attn = Attention(config, spec)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset)
        self.mlp = MLP(hidden, config.layer_intermediate_size(index))
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset)
        self.register_buffer("layer_scalar", torch.empty(1) if config.layer_scalar else None)
        self.experts: Experts | None = None
        if config.moe is not None:  # the experts' output joins the dense MLP's, each normed on its own
            self.router = Router(config, config.moe)
            self.experts = Experts(config, config.moe)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps, offset)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps, offset)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps, offset)
        if config.per_layer_input:
            self.per_layer_input_gate = Linear(hidden, config.per_layer_input)
            self.per_layer_projection = Linear(config.per_layer_input, hidden)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps, offset)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | list[LayerKV],
        plan: LayerPlan | list[LayerPlan], shared: dict[int, StepKeys] | list[dict[int, StepKeys]] | None = None,
        per_layer: torch.Tensor | None = None, rows: StepRows | None = None,
    ) -> torch.Tensor:
        """per_layer: this layer's slice [..., T, per_layer_input] of the per-layer inputs (PLE models). rows: several
        sequences' steps (Attention.forward)."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv, plan, shared, self.index, rows)
        x = self.post_attention_layernorm(attn, residual=x)
        ffn = self.mlp(self.pre_feedforward_layernorm(x), rows)
        if self.experts is not None:
            flat = x.reshape(-1, x.shape[-1])
            weights, experts = self.router(flat, rows)
            routed = self.experts(self.pre_feedforward_layernorm_2(flat), weights, experts, rows).view_as(x)
            ffn = self.post_feedforward_layernorm_1(ffn) + self.post_feedforward_layernorm_2(routed)
        if per_layer is None:
            return self.post_feedforward_layernorm(ffn, residual=x, scale=self.layer_scalar)
        x = self.post_feedforward_layernorm(ffn, residual=x)
        gated = F.gelu(self.per_layer_input_gate(x, rows), approximate="tanh") * per_layer
        return self.post_per_layer_input_norm(self.per_layer_projection(gated, rows), residual=x,
                                              scale=self.layer_scalar)


@dataclass
class RowGroup:
    """One sequence's new tokens in a step of several (engine.runner.StepRunner.forward_groups)."""

    ids: torch.Tensor  # [T] token ids at positions cache.length..
    cache: KVCache
    logits_at: torch.Tensor | None = None  # as GemmaModel.forward's
    greedy: bool = False  # likewise

    def asked_rows(self, start: int) -> torch.Tensor:
        """The rows whose logits this group asks for, among a step's rows where its own begin at `start`."""
        at = torch.tensor([self.ids.shape[0] - 1]) if self.logits_at is None else self.logits_at
        return at.to(self.ids.device) + start


def _check_logits_at(logits_at: torch.Tensor | None, T: int) -> None:
    """Raise where `logits_at` asks for rows outside a step's T new tokens: eagerly such an index fails (or trips a
    device assert on CUDA), a graph would gather a padding row, and beside other sequences another one's row."""
    if logits_at is None or logits_at.numel() == 0:
        return
    if logits_at.dim() != 1 or logits_at.dtype.is_floating_point or bool(((logits_at < 0) | (logits_at >= T)).any()):
        raise ValueError(f"logits_at {logits_at.tolist()} asks for rows outside the step's {T} new tokens")


@dataclass(frozen=True)
class KeyPositions:
    """What the attention kernel masks by: key j is visible to query i iff 0 <= key[j] <= query[i] and
    key[j] > query[i] - window (kernels.attention)."""

    query: torch.Tensor  # [T] positions of the new tokens
    key: torch.Tensor | None  # [slots] position held by each slot (-1: empty); None: slot == position
    window: int | None  # sliding window; None for full attention


@dataclass(frozen=True)
class LayerPlan:
    """How the layers of one kind (full or sliding) write and read their cache during one forward.

    mode "kernel": write the new keys, then kernels.attention reads the cache in place, masking by `positions`.
    mode "cache": write the new keys, then SDPA over the cache's slots [:end] with `mask` (decode, verify).
    mode "prefill": SDPA over slots [:end] followed by the new keys, then write the last len(slots) new keys
    (a block longer than a ring's slack would overwrite keys its own first queries still need).
    """

    mode: Literal["kernel", "cache", "prefill"]
    slots: torch.Tensor  # cache slots of the last len(slots) new tokens
    end: int | None = None  # full layers read slots [:end] (attention stays O(context), not O(max_len)); None: all
    mask: torch.Tensor | None = None  # [T, keys] bool, True = visible; None: every key (SDPA modes)
    positions: KeyPositions | None = None  # the kernel's masking (mode "kernel" only)
    # mode "prefill": the cached slots read, in position order (a ring's are rotated), so a block of queries sees
    # one run of columns (kernels.attention's blocked path reads only those); None: all slots as stored
    order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.mode == "kernel") != (self.positions is not None):
            raise ValueError("key positions go with the 'kernel' mode, and only with it")

    def store(self, kv: LayerKV, k: torch.Tensor, v: torch.Tensor) -> StepKeys:
        """Write the new keys k / v [..., T, heads, d] into kv; returns what this step's queries attend over."""
        if self.mode == "prefill":
            cached_k, cached_v = kv.read(self.end)
            if self.order is not None:
                cached_k, cached_v = cached_k[..., self.order, :, :], cached_v[..., self.order, :, :]
            keys, values = torch.cat((cached_k, k), dim=-3), torch.cat((cached_v, v), dim=-3)
            n = self.slots.shape[0]
            kv.write(self.slots, k[..., -n:, :, :], v[..., -n:, :, :])
            return StepKeys(keys, values)
        kv.write(self.slots, k, v)
        if self.mode == "cache":
            return StepKeys(*kv.read(self.end))
        n = self.end
        return StepKeys(kv.k[:n], kv.v[:n], None if kv.k_scale is None else kv.k_scale[:n],
                        None if kv.v_scale is None else kv.v_scale[:n], kv.keys_from)

    def attend(self, q: torch.Tensor, keys: StepKeys, scale: float) -> torch.Tensor:
        """Attention of queries q [..., T, heads, d] over `keys` (what `store` returned, for this layer or for the
        layer whose K / V it shares)."""
        if self.mode == "kernel":
            assert self.positions is not None
            pos = self.positions
            return cache_attention(q, keys.k, keys.v, pos.query, pos.key, pos.window, scale, keys.k_scale,
                                   keys.v_scale, contiguous=pos.key is None and self.end is not None,
                                   keys_from=keys.keys_from)
        return grouped_attention(q, keys.k, keys.v, self.mask, scale)


@dataclass(frozen=True)
class StepKeys:
    """The keys and values one layer's queries attend over in a step: the cache's slots (mode "kernel": int8 with
    scales when quantized), or the cache read in the model's dtype and, in mode "prefill", the new keys after it."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    keys_from: KeysFromValues | None = None  # mode "kernel", a cache that keeps V alone: how K is rebuilt from it


@dataclass(frozen=True)
class StepPlan:
    """One forward's positions and cache plan, made once and shared by every layer."""

    positions: torch.Tensor  # [T] positions of the new tokens (RoPE)
    full: LayerPlan
    sliding: LayerPlan


@dataclass(frozen=True)
class JointAttention:
    """The decode rows of a step over several sequences attending in one launch a layer
    (kernels.attention.rows_cache_attention), each row over its own whole cache as its step alone attends it: the
    rows' "kernel" plans joined per layer kind (slots and query positions in row order, a ring's key positions
    [rows, slots]), and where each row's cache lies from the first row's, per layer
    ([layers, rows, OFFSETS_PER_CACHE])."""

    full: LayerPlan
    sliding: LayerPlan
    offsets: torch.Tensor

    @classmethod
    def join(cls, plans: list[StepPlan], offsets: torch.Tensor) -> JointAttention:
        def joined(kind: list[LayerPlan]) -> LayerPlan:
            positions = [p.positions for p in kind]
            assert all(p is not None for p in positions)
            keys = None if positions[0].key is None else torch.stack([p.key for p in positions])
            query = torch.cat([p.query for p in positions])
            return LayerPlan("kernel", torch.cat([p.slots for p in kind]),
                             positions=KeyPositions(query, keys, positions[0].window))

        return cls(joined([p.full for p in plans]), joined([p.sliding for p in plans]), offsets)


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        # Weights are created on the meta device and arrive with load_state_dict(assign=True).
        with torch.device("meta"):
            self.embed_tokens = nn.Module()
            self.embed_tokens.register_buffer("weight", torch.empty(config.vocab_size, config.hidden_size))
            self.layers = nn.ModuleList(DecoderLayer(config, spec, i) for i, spec in enumerate(config.layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
            self.lm_head = None if config.tie_embeddings else Linear(config.hidden_size, config.vocab_size)
            if config.per_layer_input:
                width = config.num_layers * config.per_layer_input
                self.embed_tokens_per_layer = nn.Module()
                self.embed_tokens_per_layer.register_buffer("weight", torch.empty(config.vocab_size, width))
                self.per_layer_model_projection = Linear(config.hidden_size, width)
                self.per_layer_projection_norm = RMSNorm(config.per_layer_input, config.rms_norm_eps,
                                                         config.norm_offset)
        # the layers whose K / V later layers share keep what they attended over for those, during a step
        self._shares_kv = not all(spec.kv_source is None for spec in config.layers)
        # One table per distinct RoPE; layers of a type share it.
        self._inv_freq: dict[tuple, torch.Tensor] = {}
        for spec in config.layers:
            key = _rope_key(spec)
            if key not in self._inv_freq:
                self._inv_freq[key] = torch.tensor(spec.inv_freq(), dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, max_len: int, kv_dtype: str = "model", slack: int = DEFAULT_SLACK,
                  values_only: bool = True) -> KVCache:
        """values_only: in the model's dtype, the full-attention layers of an attention_k_eq_v config keep V alone and
        rebuild K from it (engine.cache.kv_cache), as every path but the C layers reads them."""
        return KVCache(self.config, max_len, device=self.device, dtype=self.dtype, slack=slack, kv_dtype=kv_dtype,
                       keys_from=self.keys_from_values(kv_dtype) if values_only else None)

    def keys_from_values(self, kv_dtype: str = "model") -> dict[int, KeysFromValues]:
        """How each layer that may keep V alone in a cache of `kv_dtype` (kv_cache.keeps_values_only) rebuilds its
        keys: its k_norm weight and RoPE frequencies, as its forward applies them to the same projection."""
        return {i: KeysFromValues((layer.self_attn.k_norm.offset + layer.self_attn.k_norm.weight.float()).contiguous(),
                                  self._inv_freq[_rope_key(spec)])
                for i, (layer, spec) in enumerate(zip(self.layers, self.config.layers, strict=True))
                if keeps_values_only(spec, kv_dtype)}

    def forward(
        self,
        ids: torch.Tensor,
        cache: KVCache,
        logits_at: torch.Tensor | None = None,
        capture: tuple[int, ...] = (),
        greedy: bool = False,
    ) -> ForwardOutput:
        """Run T new tokens at positions cache.length.. and commit them to the cache: the eager reference every
        other path of a step (engine.runner.StepRunner's) is held to.

        logits_at: indices into the T new tokens whose logits to return (default: the last one); an empty
        tensor returns none. capture: layer indices whose outputs to return (for the DFlash drafter). greedy: return
        the argmax of each of those positions' logits (`tokens`) instead of the logits (greedy_tokens).
        """
        return run_to_end(self.forward_steps(ids, cache, logits_at, capture, greedy))

    @torch.inference_mode()
    def forward_steps(
        self,
        ids: torch.Tensor,
        cache: KVCache,
        logits_at: torch.Tensor | None = None,
        capture: tuple[int, ...] = (),
        greedy: bool = False,
    ) -> Generator[int, None, ForwardOutput]:
        """`forward`, yielding after each layer (layer_steps), so a scheduler can serve other requests inside a long
        prompt chunk without changing what the chunk computes. The cache commits the tokens after the last layer
        only: a forward dropped part-way leaves its length where it was."""
        start, end = check_step(ids, cache, logits_at)
        plan = self.plan(cache, torch.arange(start, end, device=ids.device), start, end)
        x = self.embed(ids)
        x, captured = yield from self.layer_steps(x, plan, cache.layers, capture, self.per_layer_inputs(ids, x))
        cache.length = end
        return step_output(self, x, logits_at, captured, greedy)

    def joint_offsets(self, caches: list[KVCache], eager: bool) -> torch.Tensor | None:
        """Where each cache's tensors lie from the first one's, per layer ([layers, caches, OFFSETS_PER_CACHE] on the
        device: JointAttention's), or None where their decode rows cannot attend in one launch as each attends alone:
        no Triton kernels here, a head size they do not take, another layout, or (eager steps) full layers whose
        step alone goes to flash-attn (a graphed step's never does: it attends the whole cache by position)."""
        if not triton_runs(caches[0].ring_pos):
            return None
        unquantized = caches[0].kv_dtype != "q8"
        for spec in self.config.layers:
            flash = eager and not spec.sliding and unquantized and flash_attn_takes(self.device, self.dtype,
                                                                                     spec.head_dim)
            if flash or not triton_takes(spec.head_dim):
                return None
        return caches[0].offsets_of(caches)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Scaled input embeddings of token ids [..., T] -> [..., T, hidden]."""
        return self.embed_tokens.weight[ids] * torch.tensor(self.config.embed_scale, dtype=self.dtype)

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor,
                         rows: StepRows | None = None) -> torch.Tensor | None:
        """PLE models: each layer's input [..., T, layers, per_layer_input] from token ids [..., T] and their
        embeddings x: (RMSNorm(x @ P^T / sqrt(hidden)) + table[ids] x sqrt(per_layer_input)) / sqrt(2). None
        for the others. rows: several sequences' steps (StepRows)."""
        width = self.config.per_layer_input
        if not width:
            return None
        shape = (*ids.shape, self.config.num_layers, width)
        dtype = self.dtype
        tokens = self.embed_tokens_per_layer.weight[ids].view(shape) * torch.tensor(width ** 0.5, dtype=dtype)
        context = self.per_layer_model_projection(x, rows) * torch.tensor(self.config.hidden_size ** -0.5, dtype=dtype)
        return (self.per_layer_projection_norm(context.view(shape)) + tokens) * torch.tensor(2.0 ** -0.5,
                                                                                             dtype=dtype)

    def layers_forward(
        self, x: torch.Tensor, plan: StepPlan | list[StepPlan], kv: list[LayerKV] | list[list[LayerKV]],
        capture: tuple[int, ...] = (), per_layer: torch.Tensor | None = None, rows: StepRows | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder layers over embeddings x [..., T, hidden]: what eager steps, CUDA-graph steps
        (engine.backends.cuda) and training-data generation (train.target) run. per_layer: PLE models' inputs
        (per_layer_inputs). rows: x [N, hidden] holds several sequences' steps, with a plan and a cache each
        (StepRunner.forward_groups on the Triton kernels). Returns the last layer's output and the outputs of the
        layers in `capture`."""
        return run_to_end(self.layer_steps(x, plan, kv, capture, per_layer, rows))

    def layer_steps(
        self, x: torch.Tensor, plan: StepPlan | list[StepPlan], kv: list[LayerKV] | list[list[LayerKV]],
        capture: tuple[int, ...] = (), per_layer: torch.Tensor | None = None, rows: StepRows | None = None,
    ) -> Generator[int, None, tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        """The one layer loop (layers_forward's), yielding the layers done after each but the last."""
        if (per_layer is None) != (not self.config.per_layer_input):
            raise ValueError("per-layer inputs go with a PLE model, and only with one")
        if rows is None:
            positions, plans, caches = plan.positions, [plan], [kv]
        else:
            positions, plans, caches = torch.cat([p.positions for p in plan]), plan, kv
        tables = {key: rope_tables(inv_freq, positions, self.dtype) for key, inv_freq in self._inv_freq.items()}
        shared = [{} for _ in plans] if self._shares_kv else None
        captured: dict[int, torch.Tensor] = {}
        for i, (layer, spec) in enumerate(zip(self.layers, self.config.layers, strict=True)):
            if i:
                yield i
            layer_kv = [cache[i] for cache in caches]
            layer_plan = [p.sliding if c.sliding else p.full for p, c in zip(plans, layer_kv, strict=True)]
            args = (layer_kv, layer_plan, shared) if rows is not None else (
                layer_kv[0], layer_plan[0], None if shared is None else shared[0])
            x = layer(x, *tables[_rope_key(spec)], *args, None if per_layer is None else per_layer[..., i, :], rows)
            if i in capture:
                captured[i] = x
        return x, captured

    def layer_inv_freqs(self) -> list[torch.Tensor]:
        """Each layer's RoPE inverse frequencies (layers of a type share one tensor)."""
        return [self._inv_freq[_rope_key(spec)] for spec in self.config.layers]

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM head [vocab, hidden] (the embedding when tied); the DFlash drafter reads it too."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def matmul_weights(self, experts: bool = False) -> list[torch.Tensor]:
        """The matrices steps multiply by (every Linear's and the LM head), not those only looked up (embeddings);
        experts: the MoE layers' stacks of routed experts too."""
        weights = [m.weight for m in self.modules() if isinstance(m, Linear)] + [self.output_weight]
        if experts:
            weights += [w for m in self.modules() if isinstance(m, Experts)
                        for w in (m.gate_up_proj, m.down_proj)]
        return list({id(w): w for w in weights}.values())

    def logits(self, hidden: torch.Tensor, rows: StepRows | None = None) -> torch.Tensor:
        """rows: hidden [n, hidden] holds several sequences' rows (StepRows), each computed as alone."""
        if rows is not None:
            return self.softcap(batched_linear(self.norm(hidden), self.output_weight, rows).float())
        return self.softcap(F.linear(self.norm(hidden), self.output_weight).float())

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """The final logit softcap of the configs that have one (logits as they are for the others)."""
        if self.config.final_softcap is None:
            return logits
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int]:
        """Each row's argmax of logits(hidden) [n, hidden] (greedy decoding's picks)."""
        return torch.argmax(self.logits(hidden), dim=-1).tolist()

    def plan(self, cache: KVCache, pos: torch.Tensor, start: int, end: int, c_layers: bool = False) -> StepPlan:
        """The plan of new tokens at positions pos = start..end-1; advances the rings' slot -> position map.
        c_layers: the C layers (engine.backends.cpu) would take these rows, so they attend with the "kernel" plan
        where the rings let them, as on the Triton kernels."""
        T = end - start
        window, slots = self.config.sliding_window, cache.ring_slots
        # A ring as long as the cache never wraps, so no new key can overwrite one its own queries still need.
        fits = T <= slots - window + 1 or slots == cache.max_len
        kernel = triton_runs(pos) or (fits and c_layers)
        q = None if kernel and fits else pos[:, None]
        if kernel:
            full = LayerPlan("kernel", pos, end, positions=KeyPositions(pos, None, None))
        else:
            full = LayerPlan("cache", pos, end, None if T == 1 else torch.arange(end, device=pos.device)[None, :] <= q)

        old_pos = cache.ring_pos
        written = pos[-slots:] if T > slots else pos
        ring = written % slots
        new_pos = old_pos.clone()
        new_pos[ring] = written
        if fits and kernel:
            sliding = LayerPlan("kernel", ring, positions=KeyPositions(pos, new_pos, window))
        elif fits:
            k_pos = new_pos[None, :]
            sliding = LayerPlan("cache", ring, mask=(k_pos >= 0) & (k_pos <= q) & (k_pos > q - window))
        else:
            order = torch.argsort(old_pos)
            order = order[old_pos[order] >= 0]  # the filled slots, oldest position first
            old = old_pos[order][None, :]
            old_mask = (old < start) & (old > q - window)
            k_new = pos[None, :]
            new_mask = (k_new <= q) & (k_new > q - window)
            sliding = LayerPlan("prefill", ring, mask=torch.cat((old_mask, new_mask), dim=1), order=order)
        cache.ring_pos = new_pos
        return StepPlan(pos, full, sliding)


def check_step(ids: torch.Tensor, cache: KVCache, logits_at: torch.Tensor | None) -> tuple[int, int]:
    """The [start, end) positions of a step of new tokens `ids` over `cache`; raises where they overflow the cache
    or `logits_at` asks for rows outside them."""
    start = cache.length
    end = start + ids.shape[0]
    if end > cache.max_len:
        raise ContextOverflowError(end, cache.max_len)
    _check_logits_at(logits_at, ids.shape[0])
    return start, end


class Head(Protocol):
    """What turns a step's last hidden rows into logits or picks: the model's own head, or a step runner's."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def greedy_tokens(self, hidden: torch.Tensor) -> list[int]: ...


def step_output(head: Head, x: torch.Tensor, logits_at: torch.Tensor | None, captured: dict[int, torch.Tensor],
                greedy: bool) -> ForwardOutput:
    """A step's output from its last layer's rows x [T, hidden]: through `head`, the logits (greedy: the picks) of
    the rows `logits_at` asks for (default: the last; an empty tensor: none)."""
    if logits_at is not None and logits_at.numel() == 0:
        return ForwardOutput(None, captured)
    rows = x[x.shape[0] - 1:] if logits_at is None else x[logits_at]
    if greedy:
        return ForwardOutput(None, captured, head.greedy_tokens(rows))
    return ForwardOutput(head.logits(rows), captured)


def _rope_key(spec: LayerSpec) -> tuple:
    return (spec.head_dim, spec.rope_theta, spec.rope_angles, spec.rope_factor)
