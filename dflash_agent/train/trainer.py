"""The DFlash training recipe (z-lab's paper, section 5 of reference/dflash.md) over cached data.

Frozen target: only the drafter's layers, `fc` and norms train; the block embeddings and the LM
head are the target's. Each step takes `batch` sequences; from each it samples `anchors` random
anchor positions in the target-generated part and runs every [anchor, mask x (B-1)] block in one
pass (blocks.forward_blocks). The loss is cross-entropy on block positions 1..B-1, weighted by
w_k = exp(-(k-1)/gamma), averaged over the step's weights. AdamW, linear warmup then cosine decay,
gradient clipping.

Gemma's residual stream carries a few massive channels (at layer 8 of the 270M target, 5 of 640
channels hold 98% of the energy, and any two positions have cosine ~0.96), so a randomly
initialized `fc` maps every context position to nearly the same vector. Training therefore sees
the features divided by their per-channel RMS over the data (`feature_scale`) and folds the scale
into `fc`'s columns whenever it writes the drafter: the exported network is the same function of
the raw features, trained in a better-conditioned space.

Every random choice is drawn from a generator seeded by (seed, step), so a run resumed from a
checkpoint repeats exactly the steps an uninterrupted run would have taken.

Output directory (z-lab's checkpoint format, read by `load_drafter` and by z-lab's `dflash`):
  config.json, model.safetensors    the drafter at the last checkpoint (bfloat16)
  trainer_state.pt                  float32 weights, optimizer, step, loss history (for resuming)
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ..engine.model.drafter import Drafter, init_drafter_checkpoint, load_drafter
from ..engine.model.gemma import GemmaModel, RMSNorm
from ..errors import UserError
from .blocks import block_labels, forward_blocks, sample_anchors
from .data import SequenceSet
from .evaluate import Acceptance, replay_acceptance

log = logging.getLogger(__name__)

# The paper's loss decay per block size; other sizes scale 7/16 of the block.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
STATE_FILE = "trainer_state.pt"
SCALE_SAMPLE = 64  # sequences whose features set the per-channel scale


class TrainError(UserError):
    """Settings or a checkpoint directory that training cannot use."""


@dataclass(frozen=True)
class TrainConfig:
    num_layers: int = 3
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None  # None: z-lab's spacing for num_layers
    anchors: int = 64  # per sequence (the paper: 512 per ~3k-token sequence)
    batch: int = 4  # sequences per optimizer step
    steps: int = 1000
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of steps
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # None: PAPER_GAMMA for the block size
    # "full": softmax over the whole vocabulary (the recipe). "data": over the tokens that occur in
    # the training data plus `negatives` tokens sampled uniformly from the rest, with the sampled
    # logits corrected by log(|rest| / negatives) so their exp-sum estimates the rest's share of the
    # partition function. On a CPU the 262k-row LM head is ~10x the drafter's own cost; the labels
    # always lie in the data's vocabulary, so only the normalizer is estimated.
    loss_vocab: str = "data"
    negatives: int = 4096
    seed: int = 0

    @property
    def loss_gamma(self) -> float:
        return self.gamma or PAPER_GAMMA.get(self.block_size, self.block_size * 7 / 16)

    def check(self) -> None:
        if self.loss_vocab not in ("full", "data"):
            raise TrainError(f"loss vocabulary must be 'full' or 'data', not {self.loss_vocab!r}")
        for name in ("num_layers", "anchors", "batch", "steps"):
            if getattr(self, name) < 1:
                raise TrainError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise TrainError(f"block size must be >= 2, got {self.block_size}")


@dataclass
class TargetParts:
    """What training needs of the frozen target: its embedding, LM head and a few shape facts."""

    embed: torch.Tensor  # [vocab, hidden]
    head: torch.Tensor  # [vocab, hidden]
    num_layers: int
    embed_scale: float
    final_softcap: float | None

    @classmethod
    def of(cls, model: GemmaModel) -> TargetParts:
        cfg = model.config
        return cls(model.embed_tokens.weight, model.output_weight, cfg.num_layers, cfg.embed_scale, cfg.final_softcap)

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed.shape[1]


@dataclass
class StepStats:
    step: int
    loss: float
    accuracy: float  # block position 1 (the next token), argmax over the loss vocabulary
    block_acceptance: float  # mean over blocks of 1 + the leading run of correct positions
    lr: float
    seconds: float


@dataclass
class History:
    steps: list[StepStats] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out mean acceptance length)


def new_drafter(target: TargetParts, config: TrainConfig, mask_token_id: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, initial weights) of a new drafter for this target, from the engine's random
    init in z-lab's layout, plus the Gemma conventions z-lab's reference and our engine both read
    from the config: the target's embedding scale on the block input (dflash_config
    input_embedding_scale) and its final softcap on draft logits."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        init_drafter_checkpoint(tmp, target.hidden_size, target.num_layers, mask_token_id,
                                num_layers=config.num_layers, block_size=config.block_size, seed=config.seed)
        raw = json.loads((Path(tmp) / "config.json").read_text())
        weights = load_file(str(Path(tmp) / "model.safetensors"))
    if config.target_layer_ids is not None:
        bad = [i for i in config.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise TrainError(f"target layer {bad[0]} does not exist (the target has {target.num_layers} layers)")
        raw["dflash_config"]["target_layer_ids"] = list(config.target_layer_ids)
        fc = weights["fc.weight"]
        width = len(config.target_layer_ids) * target.hidden_size
        if fc.shape[1] != width:
            generator = torch.Generator().manual_seed(config.seed)
            weights["fc.weight"] = torch.randn(fc.shape[0], width, generator=generator) * fc.float().std()
    raw["dflash_config"]["input_embedding_scale"] = target.embed_scale
    if target.final_softcap is not None:
        raw["final_logit_softcapping"] = target.final_softcap
    return raw, weights


def feature_scale(data: SequenceSet, sample: int = SCALE_SAMPLE) -> torch.Tensor:
    """[n_layers * hidden] float32: 1 / the per-channel RMS of the features of the first `sample` sequences."""
    square = count = 0
    for i in range(min(sample, len(data))):
        features = data[i].features.float()
        square = square + features.pow(2).sum(0)
        count += features.shape[0]
    return (square / count).sqrt().clamp(min=1e-6).reciprocal()


def _build_drafter(raw: dict, weights: dict[str, torch.Tensor], target: TargetParts,
                   device: torch.device) -> Drafter:
    """A trainable float32 Drafter: written and read back through the checkpoint format, so the
    network trained is exactly the one `load_drafter` builds."""
    with tempfile.TemporaryDirectory() as tmp:
        _write_checkpoint(Path(tmp), raw, weights, dtype=torch.float32)
        drafter = load_drafter(tmp, target.hidden_size, target.num_layers, target.vocab_size, device, torch.float32)
    # The engine's RMSNorm keeps its weight as a buffer (loaded, never trained); the recipe trains the norms.
    for module in drafter.modules():
        if isinstance(module, RMSNorm) and module.weight is not None:
            module.weight = nn.Parameter(module.weight.detach().clone())
    for p in drafter.parameters():
        p.requires_grad_(True)
    return drafter.train()


def _write_checkpoint(out: Path, raw: dict, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in weights.items()}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    os.replace(tmp, out / "config.json")


class LossHead:
    """The frozen target LM head, over the whole vocabulary or over a candidate set plus sampled
    negatives (see TrainConfig.loss_vocab)."""

    def __init__(self, head: torch.Tensor, candidates: torch.Tensor | None, negatives: int,
                 softcap: float | None, multiplier: float) -> None:
        self.head, self.softcap, self.multiplier = head, softcap, multiplier
        self.candidates = candidates
        self.negatives = 0
        if candidates is not None:
            vocab = head.shape[0]
            self.lookup = torch.full((vocab,), -1, dtype=torch.long, device=head.device)
            self.lookup[candidates] = torch.arange(candidates.shape[0], device=head.device)
            self.rest = (self.lookup < 0).nonzero().squeeze(1)
            self.candidate_rows = head[candidates]
            self.negatives = min(negatives, self.rest.shape[0])
            # exp(logit + log(|rest| / n)) summed over n uniform draws estimates the exp-sum over the rest.
            self.correction = math.log(self.rest.shape[0] / self.negatives) if self.negatives else 0.0

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, rows).float() * self.multiplier
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-row cross-entropy [N], per-row argmax == label [N]) for hidden [N, H]."""
        if self.candidates is None:
            logits = self._logits(hidden, self.head)
            return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1) == labels
        target = self.lookup[labels]
        if bool((target < 0).any()):
            raise TrainError("a label is outside the loss vocabulary (the data changed under a running training)")
        logits = self._logits(hidden, self.candidate_rows)
        correct = logits.detach().argmax(-1) == target
        if self.negatives:
            picks = torch.randint(self.rest.shape[0], (self.negatives,), generator=generator)
            sampled = self._logits(hidden, self.head[self.rest[picks.to(self.rest.device)]]) + self.correction
            logits = torch.cat((logits, sampled), dim=1)
        return F.cross_entropy(logits, target, reduction="none"), correct


class Trainer:
    def __init__(self, out: Path, target: TargetParts, data: SequenceSet, config: TrainConfig, mask_token_id: int,
                 data_fingerprint: dict, device: torch.device) -> None:
        config.check()
        self.out, self.target, self.config, self.device = out, target, config, device
        self.data = data
        # Sequences with at least one anchor: a generated token followed by another.
        self.usable = [i for i in range(len(data)) if len(data.tokens(i)) - data.prompt_len(i) >= 2]
        if not self.usable:
            raise TrainError("no training sequence has a continuation of 2 or more tokens")
        self.fingerprint = {**data_fingerprint, "train_sequences": len(data)}
        state_path = out / STATE_FILE
        state = torch.load(state_path, map_location="cpu", weights_only=False) if state_path.exists() else None
        if state is not None:
            self._check_resumable(state)
            self.raw = state["drafter_config"]
            weights, self.step, self.history = state["weights"], state["step"], state["history"]
            # A run saved before feature scaling trained on the raw features: a scale of ones.
            self.feature_scale = state.get("feature_scale", torch.ones(weights["fc.weight"].shape[1]))
            self.saved_step = self.step
            log.info("resuming %s at step %d of %d", out, self.step, config.steps)
        else:
            self.raw, weights = new_drafter(target, config, mask_token_id)
            self.step, self.history, self.saved_step = 0, History(), 0
            self.feature_scale = feature_scale(data)
        self.drafter = _build_drafter(self.raw, weights, target, device)
        self.feature_scale = self.feature_scale.to(device)
        cfg = self.drafter.config
        vocab = data.vocabulary().to(device) if config.loss_vocab == "data" else None
        self.head = LossHead(target.head, vocab, config.negatives, cfg.final_softcap, cfg.output_multiplier)
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        warm = max(1, round(config.warmup * config.steps))

        def schedule(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, config.steps - warm))))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        position = torch.arange(1, config.block_size, dtype=torch.float32, device=device)
        self.position_weight = torch.exp(-(position - 1) / config.loss_gamma)  # [B-1]

    def _check_resumable(self, state: dict) -> None:
        mine = {**asdict(self.config), **self.fingerprint}
        theirs = {**state["config"], **state["fingerprint"]}
        for key, value in mine.items():
            if key != "steps" and theirs.get(key) != value:
                raise TrainError(f"{self.out} holds a run with {key}={theirs.get(key)!r}, not {value!r}; "
                                 "use another --out directory to start a new run")
        if theirs["steps"] != mine["steps"]:
            # The cosine schedule spans the total steps: changing it mid-run is a different schedule.
            raise TrainError(f"{self.out} holds a run of {theirs['steps']} steps, not {mine['steps']}")

    # --- one step ---------------------------------------------------------------------------

    def _sequences(self, step: int) -> list[int]:
        """The sequences of `step`: consecutive slices of per-epoch permutations seeded by (seed, epoch)."""
        n, b = len(self.usable), self.config.batch
        picked = []
        for k in range(step * b, (step + 1) * b):
            epoch, offset = divmod(k, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.config.seed * 100_003 + epoch))
            picked.append(self.usable[int(order[offset])])
        return picked

    def train_step(self) -> StepStats:
        started = time.perf_counter()
        cfg, B = self.config, self.config.block_size
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step)
        plans = []
        for i in self._sequences(self.step):
            seq = self.data[i]
            anchors = sample_anchors(len(seq.tokens), seq.prompt_len, cfg.anchors, generator)
            labels = block_labels(seq.tokens, anchors, B).to(self.device)
            plans.append((seq, anchors.to(self.device), labels))
        total_weight = sum(float((self.position_weight * (labels >= 0)).sum()) for _, _, labels in plans)
        scale = self.drafter.config.input_embedding_scale
        mask_id = self.drafter.config.mask_token_id
        loss_sum = correct1 = rows1 = 0.0
        accept = []
        self.optimizer.zero_grad(set_to_none=True)
        for seq, anchors, labels in plans:
            ids = torch.full((anchors.shape[0], B), mask_id, device=self.device)
            ids[:, 0] = seq.tokens.to(self.device)[anchors]
            embeds = self.target.embed[ids.reshape(-1)] * scale
            features = seq.features.to(self.device).float() * self.feature_scale
            with _autocast(self.device):
                hidden = forward_blocks(self.drafter, features, embeds, anchors).view(anchors.shape[0], B, -1)
                valid = labels >= 0
                ce, correct = self.head(hidden[:, 1:][valid], labels[valid], generator)
            weights = self.position_weight.expand_as(labels)[valid]
            loss = (ce * weights).sum() / total_weight
            loss.backward()
            loss_sum += float(loss.detach())
            hits = torch.zeros_like(labels, dtype=torch.bool)
            hits[valid] = correct
            correct1 += float(hits[:, 0].sum())
            rows1 += float(valid[:, 0].sum())
            accept.append(1 + hits.long().cumprod(1).sum(1).float())
        nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        stats = StepStats(self.step, loss_sum, correct1 / max(rows1, 1.0), float(torch.cat(accept).mean()), lr,
                          time.perf_counter() - started)
        self.history.steps.append(stats)
        return stats

    # --- checkpoints and evaluation ---------------------------------------------------------

    def weights(self) -> dict[str, torch.Tensor]:
        """The drafter's weights as it runs on raw target features (feature_scale folded into fc)."""
        weights = self._trained_weights()
        weights["fc.weight"] = weights["fc.weight"] * self.feature_scale[None, :]
        return weights

    def _trained_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}

    def save(self) -> None:
        """The drafter in z-lab's format (bfloat16), and everything a resumed run needs."""
        self.out.mkdir(parents=True, exist_ok=True)
        weights = self.weights()
        _write_checkpoint(self.out, self.raw, weights, dtype=torch.bfloat16)
        state = {
            "step": self.step,
            "config": asdict(self.config),
            "fingerprint": self.fingerprint,
            "drafter_config": self.raw,
            "weights": {k: v.cpu() for k, v in self._trained_weights().items()},
            "feature_scale": self.feature_scale.cpu(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "history": self.history,
        }
        tmp = self.out / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.out / STATE_FILE)
        self.saved_step = self.step

    def evaluate(self, data: SequenceSet, limit: int | None = None) -> Acceptance:
        """Held-out mean acceptance length of the drafter as saved (bfloat16 weights, reloaded)."""
        with tempfile.TemporaryDirectory() as tmp:
            _write_checkpoint(Path(tmp), self.raw, self.weights(), dtype=torch.bfloat16)
            drafter = load_drafter(tmp, self.target.hidden_size, self.target.num_layers, self.target.vocab_size,
                                   self.device, self.target.embed.dtype)
        result = replay_acceptance(drafter, self.target.embed, self.target.head, data, limit)
        self.history.evals.append((self.step, result.mean_length))
        return result

    def run(self, until: int | None = None, time_limit: float | None = None, save_every: int = 50,
            on_step: Callable[[StepStats], None] | None = None, on_save: Callable[[], None] | None = None) -> None:
        """Train to `until` (default: config.steps), saving every `save_every` steps and at the end;
        stops early, after saving, once `time_limit` seconds have passed."""
        stop = min(until or self.config.steps, self.config.steps)
        started = time.monotonic()
        while self.step < stop:
            stats = self.train_step()
            if on_step is not None:
                on_step(stats)
            out_of_time = time_limit is not None and time.monotonic() - started > time_limit
            if self.step % save_every == 0 or self.step == stop or out_of_time:
                self.save()
                if on_save is not None:
                    on_save()
            if out_of_time:
                log.warning("time limit reached at step %d of %d; run again to continue", self.step, self.config.steps)
                return


def _autocast(device: torch.device):
    """bfloat16 matmuls on CUDA (float32 master weights); plain float32 on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
