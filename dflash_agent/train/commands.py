"""`dflash-agent train-drafter`: generate (or reuse) the target's continuations of corpus prompts,
then train a DFlash drafter on them and write it in z-lab's checkpoint format."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import click
import torch

from ..engine import Engine, SpecConfig
from ..engine.formats.drafter_config import build_target_layer_ids
from ..options import FiniteRange, user_errors
from .data import DataDir, DataSpec, checkpoint_bytes, corpus_files, default_corpus, prepare
from .target import BatchGenerator
from .trainer import TargetParts, TrainConfig, Trainer, TrainError

log = logging.getLogger(__name__)


@click.command()
@click.option("--target", "-t", "target_spec", required=True,
              help="The frozen target: 'embedded', a .gguf file, a Hugging Face model directory or hub id.")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Where the drafter (config.json + model.safetensors) and its resumable state go.")
@click.option("--data", "data_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Cache of the target's continuations and features [default: OUT/data].")
@click.option("--corpus", multiple=True, help="A file or directory to cut prompts from (repeatable) "
              "[default: this Python's standard library].")
@click.option("--corpus-glob", default="*.py", show_default=True, help="Which files under a corpus directory.")
@click.option("--sequences", type=click.IntRange(min=1), default=512, show_default=True,
              help="Training sequences (prompt + continuation).")
@click.option("--eval-sequences", type=click.IntRange(min=0), default=16, show_default=True,
              help="Held-out sequences (from corpus files never used for training) to measure acceptance on.")
@click.option("--prompt-tokens", type=click.IntRange(min=4), default=256, show_default=True)
@click.option("--continuation-tokens", type=click.IntRange(min=2), default=256, show_default=True,
              help="Greedy tokens the target generates after each prompt (fewer if it stops).")
@click.option("--gen-batch", type=click.IntRange(min=1), default=32, show_default=True,
              help="Prompts the target continues at once.")
@click.option("--layers", type=click.IntRange(1, 64), default=3, show_default=True, help="Drafter layers.")
@click.option("--block-size", type=click.IntRange(2, 64), default=16, show_default=True)
@click.option("--target-layers", default=None,
              help="Comma-separated target layers whose outputs the drafter reads [default: z-lab's spacing].")
@click.option("--mask-token-id", type=click.IntRange(min=0), default=None,
              help="[default: the tokenizer's <mask> token]")
@click.option("--anchors", type=click.IntRange(min=1), default=64, show_default=True,
              help="Random anchor blocks per sequence per step.")
@click.option("--batch", type=click.IntRange(min=1), default=4, show_default=True, help="Sequences per step.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Optimizer steps [default: --epochs].")
@click.option("--epochs", type=FiniteRange(min=0, min_open=True), default=6.0, show_default=True)
@click.option("--lr", type=FiniteRange(min=0, min_open=True), default=6e-4, show_default=True)
@click.option("--warmup", type=FiniteRange(0, 1), default=0.04, show_default=True,
              help="Fraction of the steps spent warming the learning rate up.")
@click.option("--gamma", type=FiniteRange(min=0, min_open=True), default=None,
              help="Loss decay over block positions [default: 7 for block 16, 5 for 10, 4 for 8].")
@click.option("--loss-vocab", type=click.Choice(["data", "full"]), default=None,
              help="Softmax over the whole vocabulary, or over the data's tokens plus sampled negatives "
                   "[default: full on CUDA, data on a CPU].")
@click.option("--negatives", type=click.IntRange(min=0), default=4096, show_default=True,
              help="With --loss-vocab data: sampled out-of-data tokens per step.")
@click.option("--save-every", type=click.IntRange(min=1), default=50, show_default=True,
              help="Checkpoint every N steps.")
@click.option("--eval-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Measure held-out acceptance every N steps (0: only at the end).")
@click.option("--time-limit", type=FiniteRange(min=0, min_open=True), default=None,
              help="Minutes to train before saving and stopping; the same command continues the run.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads [default: torch's].")
@user_errors
def train_drafter(target_spec, out, data_dir, corpus, corpus_glob, sequences, eval_sequences, prompt_tokens,
                  continuation_tokens, gen_batch, layers, block_size, target_layers, mask_token_id, anchors, batch,
                  steps, epochs, lr, warmup, gamma, loss_vocab, negatives, save_every, eval_every, time_limit, seed,
                  device, threads):
    """Train a DFlash drafter for a target (the DFlash recipe, on the target's own continuations)."""
    if threads is not None:
        torch.set_num_threads(threads)
    # Everything a user can get wrong is checked before the target loads and the logs start.
    layer_ids = _parse_layers(target_layers)
    out = _writable(out)
    data_dir = _writable(data_dir or out / "data")
    corpus = tuple(str(Path(c).expanduser().resolve()) for c in corpus) or (str(default_corpus()),)
    corpus_files(corpus, corpus_glob)

    engine = Engine.load(target_spec, device=device, ctx_size=16, progress=True, spec=SpecConfig(enabled=False),
                         weights="exact")  # the trainer backpropagates through the LM head
    engine.close()  # only its model and tokenizer are used
    model, tokenizer = engine.model, engine.tokenizer
    target = TargetParts.of(model)
    mask_id = mask_token_id if mask_token_id is not None else tokenizer.token_id("<mask>")
    if mask_id is None:
        raise TrainError("the target's tokenizer has no <mask> token; pass --mask-token-id")
    if mask_id >= target.vocab_size:
        raise TrainError(f"mask token id {mask_id} is outside the target vocabulary ({target.vocab_size})")
    layer_ids = layer_ids or tuple(build_target_layer_ids(target.num_layers, layers))
    bad = [i for i in layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise TrainError(f"target layer {bad[0]} does not exist (the target has {target.num_layers} layers)")
    logging.getLogger("dflash_agent").setLevel(min(logging.getLogger().level, logging.INFO))
    spec = DataSpec(
        target=str(engine.model_path), target_bytes=checkpoint_bytes(Path(engine.model_path)), layer_ids=layer_ids,
        prompt_tokens=prompt_tokens, continuation_tokens=continuation_tokens, corpus=corpus, glob=corpus_glob,
        seed=seed,
    )
    data = DataDir(data_dir, spec)
    with _Bar("generating data") as bar:
        prepare(data, {"train": sequences, "eval": eval_sequences}, tokenizer,
                lambda: BatchGenerator(model, layer_ids, tokenizer.stop_ids), gen_batch,
                progress=lambda split, done, total: bar.update(f"{split} sequences", done, total))
    train_set, eval_set = data.open("train", limit=sequences), data.open("eval", limit=eval_sequences)
    if steps is None:
        steps = max(1, math.ceil(epochs * len(train_set) / batch))
    config = TrainConfig(
        num_layers=layers, block_size=block_size, target_layer_ids=layer_ids, anchors=anchors, batch=batch,
        steps=steps, lr=lr, warmup=warmup, gamma=gamma, seed=seed, negatives=negatives,
        loss_vocab=loss_vocab or ("full" if model.device.type == "cuda" else "data"),
    )
    trainer = Trainer(out, target, train_set, config, mask_id, spec.to_json(), model.device)

    def evaluate() -> None:
        if len(eval_set):
            log.info("step %d: measuring held-out acceptance on %d sequences", trainer.step, len(eval_set))
            result = trainer.evaluate(eval_set)
            log.info("step %d: held-out mean acceptance length %.3f (%d sequences, %d steps, block %d)",
                     trainer.step, result.mean_length, result.sequences, result.steps, block_size)

    last_log = [time.monotonic()]
    with _Bar("training") as bar:
        def on_step(stats) -> None:
            bar.update(f"step loss {stats.loss:.3f} acc {stats.accuracy:.2f} blk {stats.block_acceptance:.2f}",
                       stats.step, steps)
            if time.monotonic() - last_log[0] > 30 or stats.step == steps:
                last_log[0] = time.monotonic()
                log.info("step %d/%d: loss %.4f, next-token accuracy %.3f, block acceptance %.3f, lr %.2e, %.2f s/step",
                         stats.step, steps, stats.loss, stats.accuracy, stats.block_acceptance, stats.lr, stats.seconds)
            if eval_every and stats.step % eval_every == 0 and stats.step < steps:
                evaluate()

        try:
            trainer.run(time_limit=time_limit * 60 if time_limit else None, save_every=save_every, on_step=on_step)
        except KeyboardInterrupt:
            # Not saved here: the interrupt may have landed inside an optimizer update.
            click.echo(f"interrupted; the checkpoint of step {trainer.saved_step} is kept; "
                       "the same command continues from it", err=True)
            sys.exit(130)
    if trainer.step == steps and not (trainer.history.evals and trainer.history.evals[-1][0] == steps):
        evaluate()
        trainer.save()
    last = trainer.history.steps[-1] if trainer.history.steps else None
    click.echo(json.dumps({
        "out": str(out),
        "step": trainer.step,
        "steps": steps,
        "loss": round(last.loss, 4) if last else None,
        "held_out_acceptance_length": round(trainer.history.evals[-1][1], 3) if trainer.history.evals else None,
        "evals": [[s, round(a, 3)] for s, a in trainer.history.evals],
    }))


def _parse_layers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated layer numbers, got {text!r}", param_hint="--target-layers")
    if not ids:
        raise click.BadParameter("no layers given", param_hint="--target-layers")
    return ids


def _writable(path: Path) -> Path:
    """The directory, created; a one-line error now rather than after an hour of training."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise TrainError(f"cannot write to {path}: {exc.strerror or exc}") from None
    return path.resolve()


class _Bar:
    """A rich progress bar on a terminal; nothing otherwise (the log carries the progress there)."""

    def __init__(self, title: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        console = Console(stderr=True)
        self._progress = Progress(
            TextColumn(title + " {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), console=console, transient=True, disable=not console.is_terminal,
        )
        self._task = None

    def __enter__(self) -> _Bar:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def update(self, description: str, done: int, total: int) -> None:
        if self._task is None:
            self._task = self._progress.add_task(description, total=total)
        self._progress.update(self._task, description=description, completed=done, total=total)
