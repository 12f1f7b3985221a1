"""Prefill and decode speed of this engine against transformers on the same checkpoint and dtype, in one run."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..engine import EMBEDDED, Engine, FinalEvent, GenerateRequest, SpecConfig
from ..engine.weights import resolve_model_path

log = logging.getLogger(__name__)


@dataclass
class Speed:
    prefill_tok_s: float
    decode_tok_s: float


@dataclass
class BenchResult:
    model: str
    device: str
    dtype: str
    threads: int
    prompt_tokens: int
    decode_tokens: int
    repeats: int
    ours: Speed
    transformers: Speed

    @property
    def ratios(self) -> Speed:
        return Speed(
            self.ours.prefill_tok_s / self.transformers.prefill_tok_s,
            self.ours.decode_tok_s / self.transformers.decode_tok_s,
        )


def code_prompt(engine: Engine, n_tokens: int) -> list[int]:
    """A real Python source, cut to n_tokens: the workload the embedded model is meant for."""
    import json.decoder

    ids = engine.tokenizer.encode(inspect.getsource(json.decoder) * 4)
    return ids[:n_tokens]


def _ours(engine: Engine, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tok/s) through the engine's own request path."""

    async def once() -> FinalEvent:
        async for event in engine.generate(GenerateRequest(prompt, max_tokens=decode_tokens)):
            if isinstance(event, FinalEvent):
                return event
        raise RuntimeError("no final event")

    final = asyncio.run(once())
    return final.timings.prompt_ms / 1e3, final.timings.predicted_per_second


def _theirs(model, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tok/s) of transformers' generate: one token vs decode_tokens tokens."""
    ids = torch.tensor([prompt])

    def generate(n: int) -> float:
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, top_k=None, top_p=None)
        return time.perf_counter() - started

    with torch.no_grad():
        first = generate(1)  # prefill and the first token
        total = generate(decode_tokens)
    return first, (decode_tokens - 1) / max(total - first, 1e-9)


def run_cpu_bench(model: str = EMBEDDED, prompt_tokens: int = 256, decode_tokens: int = 64,
                  repeats: int = 3, dtype: str = "float32") -> BenchResult:
    from transformers import AutoModelForCausalLM

    # Every round prefills the same prompt: without the prefix cache, so each one is measured in full;
    # and decodes plainly, as transformers does (bench --spec measures speculation).
    engine = Engine.load(model, device="cpu", dtype=dtype, ctx_size=prompt_tokens + decode_tokens + 8,
                         prefix_cache=False, spec=SpecConfig(enabled=False))
    torch_dtype = engine.model.dtype
    path = resolve_model_path(model)
    log.info("loading the transformers reference from %s", path)
    if path.is_dir():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    else:
        reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype).eval()
    prompt = code_prompt(engine, prompt_tokens)
    ours, theirs = [], []
    for i in range(repeats + 1):  # the first round warms both up and is not counted
        log.info("round %d/%d", i, repeats)
        o, t = _ours(engine, prompt, decode_tokens), _theirs(reference, prompt, decode_tokens)
        if i:
            ours.append(o)
            theirs.append(t)
    engine.close()

    def speed(samples: list[tuple[float, float]]) -> Speed:
        return Speed(len(prompt) / statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples))

    return BenchResult(
        model=str(path.name), device="cpu", dtype=str(torch_dtype).removeprefix("torch."), threads=torch.get_num_threads(),
        prompt_tokens=len(prompt), decode_tokens=decode_tokens, repeats=repeats,
        ours=speed(ours), transformers=speed(theirs),
    )


def report(result: BenchResult, out: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result.model} on {result.device}, {result.dtype}, {result.threads} threads, "
                        f"prompt {result.prompt_tokens} tokens, decode {result.decode_tokens}")
    table.add_column("")
    for name in ("dflash-agent", "transformers", "ratio"):
        table.add_column(name, justify="right")
    ratios = result.ratios
    table.add_row("prefill tok/s", f"{result.ours.prefill_tok_s:.1f}", f"{result.transformers.prefill_tok_s:.1f}",
                  f"{ratios.prefill_tok_s:.2f}x")
    table.add_row("decode tok/s", f"{result.ours.decode_tok_s:.1f}", f"{result.transformers.decode_tok_s:.1f}",
                  f"{ratios.decode_tok_s:.2f}x")
    Console().print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(asdict(result) | {"ratios": asdict(ratios)}, indent=2))
        Console(stderr=True).print(f"wrote {out}")



