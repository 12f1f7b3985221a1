"""CUDA graphs for the steps that run once per block: the target's decode / verify forward and the drafter's draft.

A 31B target step launches about a thousand kernels (60 layers of matmuls, norms, RoPE and attention);
replaying them as one graph takes the CPU's launch overhead out of decoding. Graphs need fixed shapes and
no host synchronisation, so a captured step runs the same layers (GemmaModel.layers_forward) with a
different plan:
- positions live in a device buffer, and blocks are padded up to a bucket size (1, 2, 4, 8, 16 tokens);
- full-attention layers attend their whole preallocated cache: the attention kernel skips slots past the
  last query by position (kernels.attention), and the rings' slot -> position map is updated on the device.
Padding tokens sit at positions just past the block, so their keys land where rejected drafts' would: in
slots masked by position and overwritten later; buckets stop at the rings' slack + 1 so the window stays.

Several requests' decode rows in one step (the server's slots: GemmaModel.forward_groups) replay a graph of their
own, one per combination of slot caches (so at most 2^slots - 1, and in practice the few the scheduler forms), each
row's plan made on the device as above and the rows' attention one launch a layer (model.JointAttention: the caches'
offsets, KVCache.offsets_of, are found once per combination, as the graph is).

CUDA only: `enable_cuda_graphs` is a no-op elsewhere. Nothing here has run on a GPU in this repository
(no GPU in CI); the interpreter tests cover the kernels and the position-masked attention it relies on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .drafter import Drafter, DrafterCache, DraftLayerPlan
from .kv_cache import KVCache
from .model import ForwardOutput, GemmaModel, JointAttention, KeyPositions, LayerPlan, RowGroup, StepPlan, StepRows

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16)


def enable_cuda_graphs(model: GemmaModel) -> None:
    """Route the model's decode / verify forwards (blocks of up to 16 tokens) through captured graphs."""
    if model.device.type == "cuda" and model.config.dense:  # the captured step runs the dense layers only
        model.step_graphs = TargetStepGraphs(model)


def _capture(step, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run `step` once eagerly on a side stream (compiles the Triton kernels, sets up cuBLAS), then capture it;
    returns the graph and the output tensors every replay writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = step()
    return graph, outputs


@dataclass
class _TargetGraph:
    cache: KVCache  # the one it replays over (the graph keeps it, so no other cache can take its id)
    ids: torch.Tensor  # [bucket] token ids, padded with 0
    pos: torch.Tensor  # [bucket] positions
    ring: torch.Tensor  # the rings' slot -> position map, copied in and out around a replay
    rows: torch.Tensor  # [bucket] indices of the tokens whose logits are wanted
    graph: torch.cuda.CUDAGraph | None = None  # with the outputs each replay overwrites:
    logits: torch.Tensor | None = None
    captured: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _GroupsGraph:
    caches: list[KVCache]  # one decode row each, in the step's order
    ids: torch.Tensor  # [rows]
    pos: torch.Tensor  # [rows] each row's position
    rings: list[torch.Tensor]  # each cache's slot -> position map, copied in and out around a replay
    offsets: torch.Tensor | None  # where each cache lies (GemmaModel.joint_offsets): one attention launch a layer
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [rows, vocab]
    captured: dict[int, torch.Tensor] = field(default_factory=dict)


class TargetStepGraphs:
    """One graph per (cache, bucket, captured layers), captured on first use (a slot's cache is kept for the engine's
    life); and one per (combination of caches, captured layers) for several requests' decode rows."""

    def __init__(self, model: GemmaModel) -> None:
        self.model = model
        self.graphs: dict[tuple[int, int, tuple[int, ...]], _TargetGraph] = {}
        self.group_graphs: dict[tuple[tuple[int, ...], tuple[int, ...]], _GroupsGraph] = {}
        # one memory pool for every bucket's intermediates (they never run at the same time)
        self.pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None
        self.offsets = torch.arange(BUCKETS[-1], device=model.device)

    @torch.inference_mode()
    def replay(self, ids: torch.Tensor, cache: KVCache, logits_at: torch.Tensor | None,
               capture: tuple[int, ...]) -> ForwardOutput | None:
        """The forward of `ids` at cache.length through a graph, or None where no graph applies."""
        T = ids.shape[0]
        bucket = next((b for b in BUCKETS if b >= T), None)
        n_rows = 1 if logits_at is None else logits_at.numel()
        if (bucket is None or bucket > cache.slack + 1 or cache.length + bucket > cache.max_len
                or n_rows == 0 or n_rows > bucket):
            return None
        key = (id(cache), bucket, tuple(capture))
        g = self.graphs.get(key)
        if g is None:
            device = self.model.device
            g = _TargetGraph(cache, torch.zeros(bucket, dtype=torch.long, device=device),
                             torch.zeros(bucket, dtype=torch.long, device=device),
                             cache.ring_pos.clone(), torch.zeros(bucket, dtype=torch.long, device=device))
        g.ids.zero_()
        g.ids[:T].copy_(ids)
        torch.add(self.offsets[:bucket], cache.length, out=g.pos)
        g.ring.copy_(cache.ring_pos)
        if logits_at is None:
            g.rows.fill_(T - 1)
        else:
            g.rows.zero_()
            g.rows[:n_rows].copy_(logits_at)
        if g.graph is None:
            log.info("capturing a CUDA graph of the target step for %d tokens", bucket)
            g.graph, (g.logits, g.captured) = _capture(lambda: self._step(g, capture), self.pool)
            self.graphs[key] = g
        g.graph.replay()
        cache.ring_pos.copy_(g.ring)
        cache.length += T
        return ForwardOutput(g.logits[:n_rows].clone(), {i: h[:T].clone() for i, h in g.captured.items()})

    @torch.inference_mode()
    def replay_groups(self, groups: list[RowGroup], capture: tuple[int, ...]) -> list[ForwardOutput] | None:
        """GemmaModel.forward_groups of several requests' decode rows (one token each, its logits: logits_at None or
        its one row, as the scheduler asks) through a graph, or None where none applies (blocks, no logits asked, a
        full cache)."""
        if len(groups) < 2 or any(g.ids.shape[0] != 1 or (g.logits_at is not None and g.logits_at.numel() != 1)
                                  or g.cache.length >= g.cache.max_len for g in groups):
            return None
        key = (tuple(id(g.cache) for g in groups), tuple(capture))
        g = self.group_graphs.get(key)
        if g is None:  # the graph keeps its caches, so no other cache can take one's id while it is stored
            rows = torch.zeros(len(groups), dtype=torch.long, device=self.model.device)
            caches = [group.cache for group in groups]
            g = _GroupsGraph(caches, rows, rows.clone(), [cache.ring_pos.clone() for cache in caches],
                             self.model.joint_offsets(caches, eager=False))
        torch.cat([group.ids for group in groups], out=g.ids)
        g.pos.copy_(torch.tensor([group.cache.length for group in groups]), non_blocking=True)
        for ring, group in zip(g.rings, groups, strict=True):
            ring.copy_(group.cache.ring_pos)
        if g.graph is None:
            log.info("capturing a CUDA graph of %d requests' decode rows", len(groups))
            g.graph, (g.logits, g.captured) = _capture(lambda: self._groups_step(g, capture), self.pool)
            self.group_graphs[key] = g
        g.graph.replay()
        assert g.logits is not None
        picks = torch.argmax(g.logits, dim=-1).tolist() if any(group.greedy for group in groups) else None
        outputs = []
        for i, (ring, group) in enumerate(zip(g.rings, groups, strict=True)):
            group.cache.ring_pos.copy_(ring)
            group.cache.length += 1
            views = {layer: h[i:i + 1].clone() for layer, h in g.captured.items()}
            if group.greedy:
                outputs.append(ForwardOutput(None, views, picks[i:i + 1]))
            else:
                outputs.append(ForwardOutput(g.logits[i:i + 1].clone(), views))
        return outputs

    def _groups_step(self, g: _GroupsGraph, capture: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        # GemmaModel._kernel_groups with each row's plan made on the device, as _step makes one
        model = self.model
        plans = [self._device_plan(g.pos[i:i + 1], cache, ring) for i, (cache, ring) in
                 enumerate(zip(g.caches, g.rings, strict=True))]
        rows = StepRows((1,) * len(g.caches), None if g.offsets is None else JointAttention.join(plans, g.offsets))
        x, captured = model.layers_forward(model.embed(g.ids), plans, [c.layers for c in g.caches], capture, rows=rows)
        return model.logits(x, rows), captured

    def _step(self, g: _TargetGraph, capture: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        # GemmaModel.forward with the plan made on the device (see the module doc)
        model = self.model
        plan = self._device_plan(g.pos, g.cache, g.ring)
        x, captured = model.layers_forward(model.embed(g.ids), plan, g.cache.layers, capture)
        return model.logits(x[g.rows]), captured

    def _device_plan(self, pos: torch.Tensor, cache: KVCache, ring: torch.Tensor) -> StepPlan:
        """The plan of new tokens at positions `pos` (a device buffer) over `cache`, made on the device: full layers
        attend the whole cache masked by position, and `ring` (a copy of the rings' slot -> position map) takes the
        new positions."""
        ring_slots = pos % cache.ring_slots
        ring.index_copy_(0, ring_slots, pos)
        window = self.model.config.sliding_window
        return StepPlan(pos, full=LayerPlan("kernel", pos, positions=KeyPositions(pos, None, None)),
                        sliding=LayerPlan("kernel", ring_slots, positions=KeyPositions(pos, ring, window)))


class DraftStepGraph:
    """The drafter's greedy draft of a `block`-token block (drafter.draft, its LM head and argmax) as one graph.

    The block's keys are written into the drafter cache just past its context (slots the next
    append_context overwrites) so attention reads one preallocated buffer per layer; bidirectional layers
    mask by the block's last position instead of each query's.
    """

    def __init__(self, drafter: Drafter, head_weight: torch.Tensor, cache: DrafterCache, block: int) -> None:
        config = drafter.config
        if any(not causal and window is not None for causal, window in zip(config.causal, config.window)):
            raise ValueError("a graph cannot draft with bidirectional sliding-window layers")
        self.drafter, self.head_weight, self.cache, self.block = drafter, head_weight, cache, block
        device = drafter.device
        self.embeds = torch.zeros(block, config.hidden_size, dtype=drafter.dtype, device=device)
        self.pos = torch.zeros(block, dtype=torch.long, device=device)
        self.offsets = torch.arange(block, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens: torch.Tensor | None = None

    @torch.inference_mode()
    def draft(self, block_embeds: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens [block - 1] for a block at positions cache.length.. (the cache is not advanced)."""
        if block_embeds.shape[0] != self.block or self.cache.length + self.block > self.cache.max_len:
            raise ValueError(f"this graph drafts blocks of {self.block} tokens within the cache")
        self.embeds.copy_(block_embeds)
        torch.add(self.offsets, self.cache.length, out=self.pos)
        if self.graph is None:
            pool = torch.cuda.graph_pool_handle() if self.embeds.is_cuda else None
            self.graph, self.tokens = _capture(self._step, pool)
        self.graph.replay()
        assert self.tokens is not None
        return self.tokens.clone()

    def _step(self) -> torch.Tensor:
        drafter, cache, config = self.drafter, self.cache, self.drafter.config
        last = self.pos[-1:].expand(self.block)
        plans = [DraftLayerPlan("cache", cache.k[i], cache.v[i], slots=self.pos, window=config.window[i],
                                query_positions=self.pos if config.causal[i] else last)
                 for i in range(config.num_layers)]
        hidden = drafter.layers_forward(self.embeds, drafter.rope(self.pos), plans)
        return drafter.logits(hidden[1:], self.head_weight).argmax(-1)
