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

Several requests' rows in one step (the server's slots: engine.runner.StepRunner.forward_groups) replay a graph of
their own, one per combination of slot caches, each taking part with a decode row or a verification block padded
to its bucket as above. A block padded to 16 instead would make fewer combinations, but the attention kernel sizes
its row tile by the step's rows, so its rows would no longer come out as the block's step alone gives them. Each
group's plan is made on the device as above, and the decode rows attend in one launch a layer
(model.JointAttention: the caches' offsets, KVCache.offsets_of, are found once per combination, as the graph is).

CUDA only: `cuda_step_graphs` gives None elsewhere. Nothing here has run on a GPU in this repository
(no GPU in CI); the interpreter tests cover the kernels and the position-masked attention it relies on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ...kernels.capture import capture_graph
from ..cache.drafter_cache import DrafterCache
from ..cache.kv_cache import KVCache
from ..limits import BUCKETS
from ..model.drafter import Drafter, DraftLayerPlan
from ..model.gemma import (
    ForwardOutput,
    GemmaModel,
    JointAttention,
    KeyPositions,
    LayerPlan,
    RowGroup,
    StepPlan,
    StepRows,
)
from ..model.packed import PackedWeight

log = logging.getLogger(__name__)

# several requests' graphs kept at once, the least recently used dropped first: a combination of slots and their
# blocks' buckets is captured when the scheduler first forms it, and most steps form one of a few (a slot's DFlash
# blocks all take one bucket, its plain steps another)
MAX_GROUP_GRAPHS = 32


def cuda_step_graphs(model: GemmaModel, slots: int = 1) -> TargetStepGraphs | None:
    """The graphs of the model's decode / verify forwards (blocks of up to 16 tokens; of up to `slots` requests at
    once), where its steps can be captured: on CUDA, every layout's, but a MoE's experts only packed (the others
    choose their rows on the host). None elsewhere."""
    experts = [layer.experts for layer in model.layers if layer.experts is not None]
    if model.device.type == "cuda" and all(isinstance(e.gate_up_proj, PackedWeight) and
                                           isinstance(e.down_proj, PackedWeight) for e in experts):
        return TargetStepGraphs(model, slots)
    return None


@dataclass
class _TargetGraph:
    cache: KVCache  # the one it replays over (the graph keeps it, so no other cache can take its id)
    ids: torch.Tensor  # [bucket] token ids, padded with 0
    pos: torch.Tensor  # [bucket] positions
    ring: torch.Tensor  # the rings' slot -> position map, copied in and out around a replay
    rows: torch.Tensor  # [bucket] indices of the tokens whose logits are wanted
    logits: torch.Tensor  # [bucket, vocab]: rows of the graphs' one logits buffer (TargetStepGraphs.logits_rows)
    graph: torch.cuda.CUDAGraph | None = None  # with the captured layers' outputs each replay overwrites
    captured: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _GroupsGraph:
    caches: list[KVCache]  # one group each, in the step's order: the decode rows', then the blocks'
    sizes: tuple[int, ...]  # each group's rows: 1 for a decode row, a bucket for a block (padded)
    ids: torch.Tensor  # [rows] token ids, each block padded with 0
    pos: torch.Tensor  # [rows] each row's position
    rings: list[torch.Tensor]  # each cache's slot -> position map, copied in and out around a replay
    offsets: torch.Tensor | None  # where the decode rows' caches lie (GemmaModel.joint_offsets): one attention launch
    logits: torch.Tensor  # [rows, vocab], as _TargetGraph's
    graph: torch.cuda.CUDAGraph | None = None
    captured: dict[int, torch.Tensor] = field(default_factory=dict)


class TargetStepGraphs:
    """One graph per (cache, bucket, captured layers), captured on first use (a slot's cache is kept for the engine's
    life); and one per (combination of caches with each one's rows, captured layers) for several requests' rows, the
    MAX_GROUP_GRAPHS used last.

    No two graphs run at once, and a replay's logits are read (copied, or their argmax taken) before the next, so
    every graph writes them into one buffer (`logits_rows`): a graph keeps only its captured layers' outputs, and the
    rest of its memory is the one pool's, which holds one step's intermediates."""

    def __init__(self, model: GemmaModel, slots: int = 1) -> None:
        self.model, self.slots = model, slots
        # a MoE's decode rows take their experts as GEMV rows, but a block's tiles by expert are sized on the host
        self.blocks = model.config.moe is None
        # a packed head multiplies every step of up to 16 rows in one 16-row tile, so a block's one asked row comes
        # out of its padded rows as it does alone; a dense head's GEMM may choose its kernel by the rows
        self.one_row_heads = isinstance(model.output_weight, PackedWeight)
        self.graphs: dict[tuple[int, int, tuple[int, ...]], _TargetGraph] = {}
        self.group_graphs: dict[tuple[tuple[tuple[int, int], ...], tuple[int, ...]], _GroupsGraph] = {}
        # one memory pool for every graph's intermediates (they never run at the same time)
        self.pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None
        self.logits: torch.Tensor | None = None
        self.offsets = torch.arange(BUCKETS[-1], device=model.device)
        self.padding = torch.zeros(BUCKETS[-1], dtype=torch.long, device=model.device)

    @torch.inference_mode()
    def replay(self, ids: torch.Tensor, cache: KVCache, logits_at: torch.Tensor | None,
               capture: tuple[int, ...]) -> ForwardOutput | None:
        """The forward of `ids` at cache.length through a graph, or None where no graph applies (`_bucket`)."""
        T = ids.shape[0]
        n_rows = 1 if logits_at is None else logits_at.numel()
        bucket = self._bucket(T, cache, n_rows)
        if bucket is None:
            return None
        key = (id(cache), bucket, tuple(capture))
        g = self.graphs.get(key)
        if g is None:
            device = self.model.device
            g = _TargetGraph(cache, torch.zeros(bucket, dtype=torch.long, device=device),
                             torch.zeros(bucket, dtype=torch.long, device=device),
                             cache.ring_pos.clone(), torch.zeros(bucket, dtype=torch.long, device=device),
                             self.logits_rows(bucket))
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
            g.graph, g.captured = capture_graph(lambda: self._step(g, capture), self.pool)
            self.graphs[key] = g
        g.graph.replay()
        cache.ring_pos.copy_(g.ring)
        cache.length += T
        return ForwardOutput(g.logits[:n_rows].clone(), {i: h[:T].clone() for i, h in g.captured.items()})

    @torch.inference_mode()
    def replay_groups(self, groups: list[RowGroup], capture: tuple[int, ...]) -> list[ForwardOutput] | None:
        """StepRunner.forward_groups of several requests' decode rows and verification blocks (each padded to a bucket,
        as `replay` pads one) through a graph, or None where none applies (one group, or a group `_bucket` declines)."""
        if len(groups) < 2:
            return None
        # as StepRunner._triton_groups orders them
        order = sorted(range(len(groups)), key=lambda i: groups[i].ids.shape[0] > 1)
        ordered = [groups[i] for i in order]
        buckets = [self._bucket(g.ids.shape[0], g.cache, 1 if g.logits_at is None else g.logits_at.numel())
                   for g in ordered]
        if None in buckets:
            return None
        sizes = tuple(buckets)
        key = (tuple((id(group.cache), size) for group, size in zip(ordered, sizes, strict=True)), tuple(capture))
        g = self.group_graphs.pop(key, None)  # and back in last: the least recently used go first
        if g is None:  # the graph keeps its caches, so no other cache can take one's id while it is stored
            if len(self.group_graphs) >= MAX_GROUP_GRAPHS:
                del self.group_graphs[next(iter(self.group_graphs))]
            caches = [group.cache for group in ordered]
            rows = torch.zeros(sum(sizes), dtype=torch.long, device=self.model.device)
            joint = sizes.count(1)
            offsets = self.model.joint_offsets(caches[:joint], eager=False) if joint > 1 else None
            g = _GroupsGraph(caches, sizes, rows, rows.clone(), [cache.ring_pos.clone() for cache in caches], offsets,
                             self.logits_rows(sum(sizes)))
        spans = StepRows(sizes).spans()
        padded = []
        for group, (a, b) in zip(ordered, spans, strict=True):
            padded.append(group.ids)
            if b - a > group.ids.shape[0]:
                padded.append(self.padding[:b - a - group.ids.shape[0]])
        torch.cat(padded, out=g.ids)
        g.pos.copy_(torch.tensor([group.cache.length + i for group, (a, b) in zip(ordered, spans, strict=True)
                                  for i in range(b - a)]), non_blocking=True)
        for ring, group in zip(g.rings, ordered, strict=True):
            ring.copy_(group.cache.ring_pos)
        if g.graph is None:
            log.info("capturing a CUDA graph of %d requests' rows (%s)", len(groups), "+".join(map(str, sizes)))
            g.graph, g.captured = capture_graph(lambda: self._groups_step(g, capture), self.pool)
        self.group_graphs[key] = g
        g.graph.replay()
        asked = [group.asked_rows(a) for group, (a, _) in zip(ordered, spans, strict=True)]
        greedy = [i for i, group in enumerate(ordered) if group.greedy]
        picks: list[list[int]] = [[] for _ in ordered]
        if greedy:  # every greedy group's picks in one transfer
            flat = torch.argmax(g.logits[torch.cat([asked[i] for i in greedy])], dim=-1).tolist()
            for i in greedy:
                picks[i], flat = flat[:asked[i].numel()], flat[asked[i].numel():]
        outputs: list[ForwardOutput | None] = [None] * len(groups)
        for i, (ring, group, (a, _)) in enumerate(zip(g.rings, ordered, spans, strict=True)):
            T = group.ids.shape[0]
            group.cache.ring_pos.copy_(ring)
            group.cache.length += T
            views = {layer: h[a:a + T].clone() for layer, h in g.captured.items()}
            if group.greedy:
                outputs[order[i]] = ForwardOutput(None, views, picks[i])
            else:
                outputs[order[i]] = ForwardOutput(g.logits[asked[i]], views)
        return outputs

    def _bucket(self, T: int, cache: KVCache, asked: int) -> int | None:
        """The rows a graphed step of T new tokens over `cache`, asking `asked` rows' logits, pads to, or None where
        no graph takes it: past the largest bucket, the rings' slack or the cache's end; no logits asked; a block
        asking one row's where the head is dense (one_row_heads); a MoE's block."""
        bucket = next((b for b in BUCKETS if b >= T), None)
        if (bucket is None or asked == 0 or asked > bucket or cache.length + bucket > cache.max_len
                or (bucket > 1 and ((asked == 1 and not self.one_row_heads) or bucket > cache.slack + 1
                                    or not self.blocks))):
            return None
        return bucket

    def logits_rows(self, n: int) -> torch.Tensor:
        """The first n rows of the graphs' logits buffer: a block of every slot's (the memory plan's), made when a
        graph first needs it and grown only for more rows than that (a graph keeps the buffer it writes)."""
        if self.logits is None or self.logits.shape[0] < n:
            vocab = self.model.output_weight.shape[0]
            rows = max(n, self.slots * BUCKETS[-1])
            self.logits = torch.empty(rows, vocab, dtype=torch.float32, device=self.model.device)
        return self.logits[:n]

    def _groups_step(self, g: _GroupsGraph, capture: tuple[int, ...]) -> dict[int, torch.Tensor]:
        # StepRunner._triton_groups with each group's plan made on the device, as _step makes one, and every row's
        # logits (a block's padded rows ride in the head's tile with its asked ones)
        model = self.model
        rows = StepRows(g.sizes)
        plans = [self._device_plan(g.pos[a:b], cache, ring) for (a, b), cache, ring in
                 zip(rows.spans(), g.caches, g.rings, strict=True)]
        if g.offsets is not None:
            rows = StepRows(g.sizes, JointAttention.join(plans[:rows.one_token], g.offsets))
        x = model.embed(g.ids)
        x, captured = model.layers_forward(x, plans, [c.layers for c in g.caches], capture,
                                           model.per_layer_inputs(g.ids, x, rows), rows)
        g.logits.copy_(model.logits(x, rows))
        return captured

    def _step(self, g: _TargetGraph, capture: tuple[int, ...]) -> dict[int, torch.Tensor]:
        # GemmaModel.forward with the plan made on the device (see the module doc)
        model = self.model
        plan = self._device_plan(g.pos, g.cache, g.ring)
        x = model.embed(g.ids)
        x, captured = model.layers_forward(x, plan, g.cache.layers, capture, model.per_layer_inputs(g.ids, x))
        g.logits.copy_(model.logits(x[g.rows]))
        return captured

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
    append_context overwrites; a ring's map says their positions until then) so attention reads one preallocated
    buffer per layer; bidirectional layers mask by the block's last position instead of each query's.
    """

    def __init__(self, drafter: Drafter, head_weight: torch.Tensor, cache: DrafterCache, block: int) -> None:
        config = drafter.config
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
            self.graph, self.tokens = capture_graph(self._step, pool)
        self.graph.replay()
        assert self.tokens is not None
        return self.tokens.clone()

    def _step(self) -> torch.Tensor:
        drafter, cache, config = self.drafter, self.cache, self.drafter.config
        last = self.pos[-1:].expand(self.block)
        if any(cache.sliding):  # the block's positions in the rings' map, as the next append_context leaves them
            cache.ring_pos.index_copy_(0, self.pos % cache.ring_slots, self.pos)
        plans = [DraftLayerPlan("cache", cache.k[i], cache.v[i], slots=cache.slots(self.pos, i),
                                window=config.window[i], query_positions=self.pos if config.causal[i] else last,
                                key_positions=cache.key_positions(i))
                 for i in range(config.num_layers)]
        hidden = drafter.layers_forward(self.embeds, drafter.rope(self.pos), plans)
        return drafter.logits(hidden[1:], self.head_weight).argmax(-1)
