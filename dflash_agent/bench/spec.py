"""Speculative decoding benchmark: tok/s and acceptance with and without speculation, in one run.

Every mode runs the same greedy requests on the same loaded target, so the ratios against plain
autoregressive decoding are measured under the same machine load. Three workloads: continuing a
Python file (what a drafter is for), rewriting a function with a rename and copying a module back with
one comment added (what prompt lookup is for: the output copies the context). Beside them, what a
verification step of 16 and 64 rows costs against a one-row decode step on the same context: the
price of drafting long blocks, which decides how far speculation can take a copy.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..engine import Engine, FinalEvent, GenerateRequest, SpecConfig
from ..engine.drafter import init_drafter_checkpoint, load_drafter
from .cpu import code_prompt

log = logging.getLogger(__name__)


@dataclass
class ModeResult:
    mode: str
    workload: str
    decode_tok_s: float
    acceptance_length_mean: float
    drafted: int
    accepted: int
    by_source: dict[str, list[int]] = field(default_factory=dict)
    speedup: float = 0.0  # decode tok/s over the "ar" mode on the same workload


@dataclass
class VerifyCost:
    rows: int  # new tokens in the step, with logits for each (a block to verify)
    ms: float  # median wall time of the step
    vs_one_row: float  # ms over a one-row decode step's on the same context


def workloads(engine: Engine, prompt_tokens: int) -> dict[str, list[int]]:
    import json.decoder
    import textwrap

    code = code_prompt(engine, prompt_tokens)
    # An edit: the file, then the instruction to repeat it with a rename. The answer copies the file.
    snippet = textwrap.dedent(inspect.getsource(json.decoder.py_scanstring))
    edit_text = (
        f"# Original:\n{snippet}\n# The same function with `chunks` renamed to `parts`; "
        f"everything else unchanged:\n{snippet.splitlines()[0]}\n"
    )
    edit = engine.tokenizer.encode(edit_text)[-prompt_tokens:]
    return {"code": code, "edit": edit, "module": module_prompt(engine, prompt_tokens)}


def module_prompt(engine: Engine, prompt_tokens: int) -> list[int]:
    """A module, then the start of the same module again with a comment added at its top: the answer copies the
    module (an agent rewriting a file with a small change). The module is cut to whole lines within the budget."""
    import textwrap

    source = inspect.getsource(textwrap).splitlines()
    tokens = engine.tokenizer.encode
    lines = len(source)
    while lines > 1 and len(tokens("\n".join(source[:lines]))) + 40 > prompt_tokens:  # 40: the lines around it
        lines = lines * 3 // 4
    module = "\n".join(source[:lines])
    text = f"# textwrap.py\n{module}\n\n# textwrap.py, with a comment added at the top\n# Wrapping text.\n{source[0]}\n"
    return tokens(text)[-prompt_tokens:]


def verify_costs(engine: Engine, prompt: list[int], rows: tuple[int, ...] = (1, 16, 64),
                 repeats: int = 5) -> list[VerifyCost]:
    """Steps of `rows` new tokens with logits for every row, as verifying a drafted block takes, after `prompt`,
    on a cache of its own, timed alternately (median of `repeats`) on whatever path the engine takes for that many
    rows. Rolled back after each; the rings may then miss keys, which changes no step's cost."""
    model = engine.model
    cache = model.new_cache(len(prompt) + max(rows) + 1)
    model(torch.tensor(prompt, device=model.device), cache, logits_at=torch.arange(0))
    start = cache.length
    block = torch.tensor((prompt * (max(rows) // len(prompt) + 1))[:max(rows)], device=model.device)
    times: dict[int, list[float]] = {n: [] for n in rows}
    for _ in range(repeats + 1):  # the first round warms up
        for n in rows:
            cache.rollback(start)
            began = time.perf_counter()
            model(block[:n], cache, logits_at=torch.arange(n, device=model.device))
            times[n].append(time.perf_counter() - began)
    median = {n: statistics.median(t[1:]) * 1e3 for n, t in times.items()}
    one = median[min(rows)] / min(rows)
    return [VerifyCost(n, median[n], median[n] / one) for n in rows]


def _run(engine: Engine, prompt: list[int], decode_tokens: int) -> FinalEvent:
    return asyncio.run(engine.complete(GenerateRequest(prompt, max_tokens=decode_tokens))).final


def run_spec_bench(
    model: str,
    draft: str | None,
    prompt_tokens: int = 384,
    decode_tokens: int = 96,
    repeats: int = 2,
    spec_block: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> tuple[list[ModeResult], list[VerifyCost]]:
    """draft: a drafter checkpoint, "random" for a randomly initialized one (until a trained drafter
    exists), or None to measure prompt lookup alone."""
    base = Engine.load(model, device=device, dtype=dtype, ctx_size=prompt_tokens + decode_tokens + 32,
                       spec=SpecConfig(enabled=False))
    drafter = None
    if draft is not None:
        cfg = base.model.config
        tmp = None
        if draft == "random":
            tmp = tempfile.TemporaryDirectory()
            mask = base.tokenizer.token_id("<mask>")
            draft = str(init_drafter_checkpoint(Path(tmp.name), cfg.hidden_size, cfg.num_layers,
                                                mask if mask is not None else 0))
        drafter = load_drafter(draft, cfg.hidden_size, cfg.num_layers, cfg.vocab_size, base.model.device,
                               base.model.dtype)
        if tmp is not None:
            tmp.cleanup()
    base.close()
    modes = {"ar": (None, SpecConfig(enabled=False)), "ngram": (None, SpecConfig(block=spec_block))}
    if drafter is not None:
        modes["dflash"] = (drafter, SpecConfig(block=spec_block, ngram=False))
        modes["hybrid"] = (drafter, SpecConfig(block=spec_block))
    prompts = workloads(base, prompt_tokens)
    results: list[ModeResult] = []
    for workload, prompt in prompts.items():
        # every mode shares the model; rounds alternate the modes, so each sees the same machine load
        engines = {mode: Engine(base.model, base.tokenizer, base.n_ctx, base.model_name, drafter=mode_drafter,
                                spec=spec) for mode, (mode_drafter, spec) in modes.items()}
        runs: dict[str, list] = {mode: [] for mode in modes}
        for i in range(repeats + 1):  # round 0 warms every mode up (and trains its adaptive controller)
            for mode, engine in engines.items():
                final = _run(engine, prompt, decode_tokens)
                if i:
                    runs[mode].append(final)
        for engine in engines.values():
            engine.close()
        for mode, mode_runs in runs.items():
            stats = mode_runs[-1].spec
            result = ModeResult(
                mode=mode, workload=workload,
                decode_tok_s=statistics.median(r.timings.predicted_per_second for r in mode_runs),
                acceptance_length_mean=statistics.mean(r.spec.acceptance_length_mean for r in mode_runs),
                drafted=stats.drafted, accepted=stats.accepted, by_source=stats.by_source,
            )
            log.info("%s / %s: %.2f tok/s, acceptance %.2f", workload, mode, result.decode_tok_s,
                     result.acceptance_length_mean)
            results.append(result)
    for r in results:
        ar = next(x for x in results if x.workload == r.workload and x.mode == "ar")
        r.speedup = r.decode_tok_s / ar.decode_tok_s if ar.decode_tok_s else 0.0
    costs = verify_costs(base, prompts["code"])
    for cost in costs:
        log.info("verify %d rows: %.1f ms, %.2fx a one-row step", cost.rows, cost.ms, cost.vs_one_row)
    return results, costs


def report(results: list[ModeResult], costs: list[VerifyCost], out: Path | None, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("workload", "mode", "decode tok/s", "x ar", "acceptance length", "drafted", "accepted"):
        table.add_column(column, justify="right" if column not in ("workload", "mode") else "left")
    for r in results:
        table.add_row(r.workload, r.mode, f"{r.decode_tok_s:.2f}", f"{r.speedup:.2f}",
                      f"{r.acceptance_length_mean:.2f}", str(r.drafted), str(r.accepted))
    console = Console(stderr=True)
    console.print(table)
    rows = Table(title="verification step vs a one-row decode step, same context (all rows' logits)")
    for column in ("rows", "ms", "x one row", "ms per row"):
        rows.add_column(column, justify="right")
    for cost in costs:
        rows.add_row(str(cost.rows), f"{cost.ms:.1f}", f"{cost.vs_one_row:.2f}", f"{cost.ms / cost.rows:.2f}")
    console.print(rows)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"title": title, "results": [asdict(r) for r in results],
                                   "verify_costs": [asdict(c) for c in costs]}, indent=2) + "\n")
        log.warning("wrote %s", out)
