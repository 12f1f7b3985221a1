"""The step runner: one target step of one or several sequences, on the path that runs it.

A step is the new tokens of one sequence (a prompt chunk, a decode row, a verification block) or of several at
once (the server's slots, `forward_groups`). It runs on one of:
- a CUDA graph (engine.backends.cuda): one sequence's block of up to a bucket's rows, or several sequences' blocks;
- the C layers (engine.backends.cpu): up to MAX_ROWS rows of one or several sequences over float32 caches;
- the Triton kernels, eagerly: several sequences' rows in one forward, each row computed as its step alone;
- the eager PyTorch layers (GemmaModel): everything else, and the reference the others are tested against.

`StepRunner` owns those backends (built by `StepRunner.build`, or handed in) and makes the choice in one place,
as nano-vllm's model runner does; the model knows only the math.
"""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.nn.functional as F

from ..kernels.dispatch import SPLIT_ROWS, VERIFY_ROWS, triton_runs
from .backends.cpu import CpuDecodeLayers
from .backends.cuda import TargetStepGraphs, cuda_step_graphs
from .cache.kv_cache import KVCache, LayerKV
from .limits import DEFAULT_SLACK, LOOKUP_SLACK, MAX_ROWS
from .model.gemma import (
    ForwardOutput,
    GemmaModel,
    JointAttention,
    RowGroup,
    StepRows,
    check_step,
    run_to_end,
    step_output,
)


class StepRunner:
    """Runs the target's steps (see the module doc). `cpu`: the C layers of a model repacked for them; `graphs`:
    the CUDA graphs of its decode / verify steps."""

    def __init__(self, model: GemmaModel, cpu: CpuDecodeLayers | None = None,
                 graphs: TargetStepGraphs | None = None) -> None:
        self.model, self.cpu, self.graphs = model, cpu, graphs

    @classmethod
    def build(cls, model: GemmaModel, slots: int = 1) -> StepRunner:
        """The runner with every backend this model qualifies for: the C layers where its weights were repacked for
        them (engine.load.weights, repack_cpu), CUDA graphs for `slots` sequences at once on CUDA."""
        return cls(model, CpuDecodeLayers.build(model), cuda_step_graphs(model, slots))

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_cache(self, max_len: int, kv_dtype: str = "model") -> KVCache:
        # the C layers verify prompt lookup's long drafts, so their rings keep room to roll such a block back
        slack = LOOKUP_SLACK if self.cpu is not None else DEFAULT_SLACK
        # the C layers read keys as stored: where they run, the layers that could keep V alone keep K too
        return self.model.new_cache(max_len, kv_dtype, slack, values_only=self.cpu is None)

    def forward(self, ids: torch.Tensor, cache: KVCache, logits_at: torch.Tensor | None = None,
                capture: tuple[int, ...] = (), greedy: bool = False) -> ForwardOutput:
        """GemmaModel.forward, on this runner's path for it."""
        return run_to_end(self.forward_steps(ids, cache, logits_at, capture, greedy))

    @torch.inference_mode()
    def forward_steps(self, ids: torch.Tensor, cache: KVCache, logits_at: torch.Tensor | None = None,
                      capture: tuple[int, ...] = (), greedy: bool = False) -> Generator[int, None, ForwardOutput]:
        """GemmaModel.forward_steps of one sequence: its CUDA graph where one takes the block; else the C layers
        (all the layers in one call, yielding nothing) where they take its rows with the "kernel" plan; else the
        eager layers, one at a time."""
        start, end = check_step(ids, cache, logits_at)
        if self.graphs is not None:
            out = self.graphs.replay(ids, cache, logits_at, capture)
            if out is not None:
                if greedy and out.logits is not None:
                    return ForwardOutput(None, out.captured, torch.argmax(out.logits, dim=-1).tolist())
                return out
        on_c = self._c_takes(end - start, cache.layers)
        plan = self.model.plan(cache, torch.arange(start, end, device=ids.device), start, end, c_layers=on_c)
        x = self.embed(ids)
        per_layer = self.model.per_layer_inputs(ids, x)
        if on_c and plan.full.mode == "kernel" == plan.sliding.mode:
            x, captured = self.cpu.forward(x, plan, cache.layers, capture, per_layer)
        else:
            x, captured = yield from self.model.layer_steps(x, plan, cache.layers, capture, per_layer)
        cache.length = end
        return step_output(self, x, logits_at, captured, greedy)

    @torch.inference_mode()
    def forward_groups(self, groups: list[RowGroup], capture: tuple[int, ...] = ()) -> list[ForwardOutput]:
        """`forward` of several sequences' new tokens (the slots of concurrent requests: decode rows, verification
        blocks) in one step, each output what `forward` of its group alone gives (every row is computed as alone:
        engine.backends.cpu; kernels.triton.quant_matmul). The path: on the Triton kernels, the groups' CUDA graph or
        one eager forward over all their rows (`batches`); where the C layers take every group, one call of them that
        reads each weight once for all rows; else one `forward` per group."""
        for group in groups:
            check_step(group.ids, group.cache, group.logits_at)
        if len(groups) > 1 and self.batches(groups):
            graphed = None if self.graphs is None else self.graphs.replay_groups(groups, capture)
            return self._triton_groups(groups, capture) if graphed is None else graphed
        if len(groups) > 1 and all(self._c_kernel_plan(g.ids.shape[0], g.cache) for g in groups):
            return self._c_groups(groups, capture)
        return [self.forward(g.ids, g.cache, g.logits_at, capture, g.greedy) for g in groups]

    def batches(self, groups: list[RowGroup]) -> bool:
        """Whether forward_groups runs these groups in one forward on the Triton kernels: there, for blocks of up to a
        verification tile's VERIFY_ROWS (the packed matrices batch them: batched_linear)."""
        return triton_runs(groups[0].ids) and all(0 < g.ids.shape[0] <= VERIFY_ROWS for g in groups)

    def step_rows(self, cache: KVCache) -> int:
        """The most new tokens one forward over `cache` computes as decode rows, each as a one-token step computes
        it, so a verified block of that many gives what decoding it token by token gives: a block must fit in the
        rings' slack; the C layers take up to MAX_ROWS; the Triton and eager paths keep to SPLIT_ROWS."""
        fits = cache.slack + 1 if cache.ring_slots < cache.max_len else cache.max_len
        return min(MAX_ROWS if self.decodes_on_c(cache) else SPLIT_ROWS, fits)

    def decodes_on_c(self, cache: KVCache) -> bool:
        """Whether a decode row over `cache` runs the C layers."""
        return self._c_takes(1, cache.layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """GemmaModel.embed, the rows read by id in C where the embedding is repacked for it."""
        x = None if self.cpu is None else self.cpu.embed(ids)
        return self.model.embed(ids) if x is None else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """GemmaModel.logits of rows hidden [n, hidden], the final norm and LM head in one C call where they take
        them."""
        logits = None if self.cpu is None else self.cpu.logits(hidden)
        return self.model.logits(hidden) if logits is None else self.model.softcap(logits)

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int]:
        """Each row's argmax of logits(hidden) [n, hidden] (greedy decoding's picks). The C head screens a block of
        rows (CpuDecodeLayers.greedy: the same picks, bit for bit, without every logit); a softcap's tanh can tie
        logits it would tell apart, so a softcapped head is computed whole."""
        if hidden.shape[0] > MAX_ROWS:  # C's LM head takes MAX_ROWS rows a call; each row alone: no change
            return [t for chunk in hidden.split(MAX_ROWS) for t in self.greedy_tokens(chunk)]
        picks = None
        if self.cpu is not None and self.config.final_softcap is None:
            picks = self.cpu.greedy(hidden)
        if picks is None:
            return self._picks(self.logits(hidden))
        return [self.argmax(self.logits(hidden[i:i + 1])[0]) if pick is None else pick
                for i, pick in enumerate(picks)]

    def draft_picks(self, hidden: torch.Tensor) -> list[int] | None:
        """A drafter's greedy drafts from its normed rows [n, hidden] through the target's LM head, where the C head
        screens them (None: take the drafter's logits): the argmax of hidden @ head^T up to near-ties, which a draft
        may lose (verification decides), and which a positive output multiplier or a softcap does not move."""
        picks = None if self.cpu is None else self.cpu.greedy(hidden, normed=True)
        if picks is None:
            return None
        return [self.argmax(F.linear(hidden[i:i + 1], self.model.output_weight)[0]) if pick is None else pick
                for i, pick in enumerate(picks)]

    def argmax(self, logits: torch.Tensor) -> int:
        """The index of the largest of logits [V] (greedy decoding's pick), through the C kernels on the CPU."""
        if self.cpu is not None and logits.device.type == "cpu":
            return self.cpu.lib.argmax(logits)
        return int(torch.argmax(logits))

    def _picks(self, logits: torch.Tensor) -> list[int]:
        """Each row's argmax of logits [n, V]."""
        if logits.device.type != "cpu":  # one argmax, one synchronization for the block
            return torch.argmax(logits, dim=-1).tolist()
        return [self.argmax(row) for row in logits]

    def _c_takes(self, rows: int, kv: list[LayerKV]) -> bool:
        """Whether `rows` new tokens of one sequence over caches `kv` may run the C layers."""
        return self.cpu is not None and self.cpu.takes(rows, kv)

    def _c_kernel_plan(self, T: int, cache: KVCache) -> bool:
        """Whether T new tokens over `cache` take the C layers with the "kernel" plan for both kinds of layer."""
        fits = T <= cache.ring_slots - self.config.sliding_window + 1 or cache.ring_slots == cache.max_len
        return T > 0 and fits and self._c_takes(T, cache.layers)

    def _c_groups(self, groups: list[RowGroup], capture: tuple[int, ...]) -> list[ForwardOutput]:
        """forward_groups on the C layers: one call over every group's rows, each attending its own cache; then the
        greedy groups' rows in one pass over the head, the others' logits in another (each row alone: the split
        changes nothing), C's LM head taking MAX_ROWS rows a call."""
        plans = []
        for group in groups:
            start = group.cache.length
            end = start + group.ids.shape[0]
            plans.append(self.model.plan(group.cache, torch.arange(start, end), start, end, c_layers=True))
            group.cache.length = end
        ids = torch.cat([g.ids for g in groups])
        x = self.embed(ids)
        x, captured = self.cpu.forward_groups(
            x, [(p, g.cache.layers) for p, g in zip(plans, groups)], capture, self.model.per_layer_inputs(ids, x))
        wanted, offset = [], 0
        for group in groups:
            wanted.append(group.asked_rows(offset))
            offset += group.ids.shape[0]
        picked = [at for at, g in zip(wanted, groups) if g.greedy]
        scored = [at for at, g in zip(wanted, groups) if not g.greedy]
        tokens = self.greedy_tokens(x[torch.cat(picked)]) if picked and torch.cat(picked).numel() else []
        rows = torch.cat(scored) if scored else torch.zeros(0, dtype=torch.int64)
        logits = torch.cat([self.logits(x[chunk]) for chunk in rows.split(MAX_ROWS)]) if rows.numel() else None
        outputs, offset, used_tokens, used_logits = [], 0, 0, 0
        for group, at in zip(groups, wanted, strict=True):
            T, n = group.ids.shape[0], at.numel()
            views = {i: h[offset:offset + T] for i, h in captured.items()}
            if group.greedy:
                outputs.append(ForwardOutput(None, views, tokens[used_tokens:used_tokens + n]))
                used_tokens += n
            else:
                outputs.append(ForwardOutput(None if n == 0 else logits[used_logits:used_logits + n], views))
                used_logits += n
            offset += T
        return outputs

    def _triton_groups(self, groups: list[RowGroup], capture: tuple[int, ...]) -> list[ForwardOutput]:
        """forward_groups on the Triton kernels, eagerly: one forward over every group's rows, the one-token groups'
        first (StepRows), each group writing and attending its own cache; then one pass over the LM head."""
        model = self.model
        order = sorted(range(len(groups)), key=lambda i: groups[i].ids.shape[0] > 1)
        ordered = [groups[i] for i in order]
        rows = StepRows(tuple(g.ids.shape[0] for g in ordered))
        plans = []
        for group in ordered:
            start = group.cache.length
            end = start + group.ids.shape[0]
            plans.append(model.plan(group.cache, torch.arange(start, end, device=group.ids.device), start, end))
        joint = rows.one_token
        offsets = model.joint_offsets([g.cache for g in ordered[:joint]], eager=True) if joint > 1 else None
        if offsets is not None:
            rows = StepRows(rows.sizes, JointAttention.join(plans[:joint], offsets))
        ids = torch.cat([g.ids for g in ordered])
        x = model.embed(ids)
        x, captured = model.layers_forward(x, plans, [g.cache.layers for g in ordered], capture,
                                           model.per_layer_inputs(ids, x, rows), rows)
        spans = rows.spans()
        for group, (a, b) in zip(ordered, spans, strict=True):
            group.cache.length += b - a
        # the head's rows likewise: the groups that want one row first
        wanted = [g.asked_rows(a) for g, (a, _) in zip(ordered, spans, strict=True)]
        head = sorted((i for i, at in enumerate(wanted) if at.numel()), key=lambda i: wanted[i].numel() > 1)
        logits = {}
        if head:
            head_rows = StepRows(tuple(wanted[i].numel() for i in head))
            out = model.logits(x[torch.cat([wanted[i] for i in head])], head_rows)
            logits = {i: out[a:b] for i, (a, b) in zip(head, head_rows.spans(), strict=True)}
        outputs: list[ForwardOutput | None] = [None] * len(groups)
        for i, (group, (a, b)) in enumerate(zip(ordered, spans, strict=True)):
            views = {layer: h[a:b] for layer, h in captured.items()}
            scores = logits.get(i)
            if scores is None or not group.greedy:  # no rows asked for: neither logits nor picks, as forward
                outputs[order[i]] = ForwardOutput(scores, views)
            else:
                outputs[order[i]] = ForwardOutput(None, views, self._picks(scores))
        return outputs
