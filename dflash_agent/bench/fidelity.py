"""How far the packed CPU path (engine.model.packed's int4 / int8 kernels) is from the exact one.

Both models read the same texts teacher-forced (each position sees the true prefix, not its own output), and
we compare their next-token distributions at every position: top-1 agreement and the mean KL(exact || packed).
Code and prose are measured apart, since they stress different parts of the vocabulary; and the packed model's
two paths apart: decode rows (its integer kernels, as decode and verification steps run them) and prompt rows
(prefill blocks: GEMMs in the `prefill` dtype on the weights dequantized exactly).
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..engine.load.tokenizer import Tokenizer
from ..engine.load.weights import EMBEDDED, build_model, open_checkpoint, resolve_model_path
from ..engine.model.packed import prefill_dtype
from ..engine.runner import StepRunner
from ..errors import UserError

log = logging.getLogger(__name__)

CHUNK = 512  # teacher-forced window: the prefill chunk the engine itself uses
DECODE_STEP = 16  # packed-model tokens per forward: a verification block, under packed_linear.GEMM_ROWS


@dataclass
class Fidelity:
    text: str
    rows: str  # "decode" (DECODE_STEP rows per forward) or "prompt <dtype>" (CHUNK rows: the prefill GEMMs)
    tokens: int
    top1_agreement: float
    mean_kl: float  # nats, KL(exact || packed)
    max_kl: float


def texts(tokenizer: Tokenizer, tokens: int) -> dict[str, list[int]]:
    """`tokens` tokens each of Python code (stdlib sources) and English prose (the stdlib's documentation topics)."""
    import email.message
    import json.decoder
    import textwrap
    from pydoc_data.topics import topics

    code = "\n".join(inspect.getsource(m) for m in (json.decoder, textwrap, email.message))
    prose = "\n\n".join(topics[k] for k in ("assignment", "bltin-code-objects", "class", "exceptions", "for",
                                             "import", "lambda", "naming", "numbers", "with"))
    out = {}
    for name, text in (("code", code), ("prose", prose)):
        ids = tokenizer.encode(text, add_bos=True)
        if len(ids) < tokens:
            raise UserError(f"the {name} text has {len(ids)} tokens, fewer than {tokens}")
        out[name] = ids[:tokens]
    return out


@torch.inference_mode()
def log_probs(model: StepRunner, ids: list[int], step: int = CHUNK) -> torch.Tensor:
    """[len(ids), vocab] float32 next-token log-probabilities, teacher-forced in windows of CHUNK tokens
    (each window starts a fresh cache, so no window outgrows the sliding layers' ring), fed `step` tokens per
    forward."""
    out = []
    for start in range(0, len(ids), CHUNK):
        window = torch.tensor(ids[start:start + CHUNK])
        cache = model.new_cache(CHUNK)
        for at in range(0, len(window), step):
            part = window[at:at + step]
            logits = model.forward(part, cache, logits_at=torch.arange(len(part))).logits
            out.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(out)


def compare(exact: StepRunner, packed: StepRunner, ids: list[int], name: str, prefill: str) -> list[Fidelity]:
    """The packed model reads in steps of DECODE_STEP tokens, the rows a decode or verification step gives its
    kernels, then in whole windows, the rows of a prefill block (its GEMMs in `prefill`, the dtype they run in)."""
    steps = {"decode": DECODE_STEP, f"prompt {prefill}": CHUNK}
    agree, kls = dict.fromkeys(steps, 0), {rows: [] for rows in steps}
    for start in range(0, len(ids), CHUNK):  # one window at a time: [CHUNK, 262144] float32 is 512 MiB
        window = ids[start:start + CHUNK]
        p = log_probs(exact, window)
        for rows, step in steps.items():
            q = log_probs(packed, window, step=step)
            agree[rows] += int((p.argmax(-1) == q.argmax(-1)).sum())
            kls[rows].append((p.exp() * (p - q)).sum(-1))
    out = []
    for rows in steps:
        kl = torch.cat(kls[rows])
        out.append(Fidelity(name, rows, len(ids), agree[rows] / len(ids), float(kl.mean()), float(kl.max())))
    return out


def run_fidelity(model: str = EMBEDDED, tokens: int = 1024, prefill: str = "auto") -> list[Fidelity]:
    """Exact (float32, dequantized at load) against packed (repacked for the CPU kernels, its prompt GEMMs in
    `prefill`: engine.types.PREFILL), same checkpoint."""
    path = resolve_model_path(model)
    ckpt = open_checkpoint(path)
    if ckpt.format != "gguf":
        raise UserError(f"{path} is not a GGUF file: only GGUF weights have a packed CPU path")
    tokenizer = Tokenizer.from_gguf(path, gguf=ckpt.gguf)
    exact = StepRunner(build_model(ckpt, "cpu", torch.float32, progress=False))
    gemm = prefill_dtype(prefill)
    packed = StepRunner.build(build_model(ckpt, "cpu", torch.float32, progress=False, repack_cpu=True, prefill=gemm))
    results = []
    for name, ids in texts(tokenizer, tokens).items():
        results += compare(exact, packed, ids, name, str(gemm).removeprefix("torch."))
        log.info("%s", results[-2:])
    return results


def report(results: list[Fidelity], out: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="packed CPU weights vs exact float32, teacher-forced")
    for column in ("text", "rows", "tokens", "top-1 agreement", "mean KL (nats)", "max KL"):
        table.add_column(column, justify="left" if column in ("text", "rows") else "right")
    for r in results:
        table.add_row(r.text, r.rows, str(r.tokens), f"{r.top1_agreement:.2%}", f"{r.mean_kl:.2e}",
                      f"{r.max_kl:.2e}")
    for rows in dict.fromkeys(r.rows for r in results):
        of = [r for r in results if r.rows == rows]
        total = sum(r.tokens for r in of)
        table.add_row("all", rows, str(total), f"{sum(r.top1_agreement * r.tokens for r in of) / total:.2%}",
                      f"{sum(r.mean_kl * r.tokens for r in of) / total:.2e}", f"{max(r.max_kl for r in of):.2e}")
    Console().print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
