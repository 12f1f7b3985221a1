"""Speculative decoding benchmark: tok/s and acceptance with and without speculation, in one run.

Every mode runs the same greedy requests on the same loaded target, so the ratios against plain
autoregressive decoding are measured under the same machine load. Workloads an agent produces: continuing a
Python file (what a drafter is for), rewriting a function with a rename, copying a module back with one comment
added, a patch of that module, and a tool result quoted back (what prompt lookup is for: the output copies the
context). Where a llama-server build is found and the model is a GGUF, llama-server runs the same token ids with
no speculation and with its n-gram modes (`--spec-type ngram-simple`, `ngram-mod`, both), alternating with ours.
Beside them, what a verification step of 16 and 64 rows costs against a one-row decode step on the same context:
the price of drafting long blocks, which decides how far speculation can take a copy.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch

from ..engine import Engine, FinalEvent, GenerateRequest, SpecConfig
from ..engine.limits import PREFILL_CHUNK
from ..engine.load.weights import resolve_model_path
from ..engine.model.drafter import init_drafter_checkpoint, load_drafter
from ..errors import UserError
from .cpu import code_prompt, llama_cpp_binary
from .servers import running_servers

log = logging.getLogger(__name__)

DEFAULT_MODE = "hybrid"  # what `serve` runs with its bundled drafter: DFlash and prompt lookup, adaptive
# llama-server's modes, by their extra arguments: none, and its n-gram speculation (with its own defaults)
LLAMA_MODES: dict[str, list[str]] = {
    "llama": [],
    "llama ngram-simple": ["--spec-type", "ngram-simple"],
    "llama ngram-mod": ["--spec-type", "ngram-mod"],
    "llama ngram-mod+simple": ["--spec-type", "ngram-mod,ngram-simple"],
}


@dataclass
class ModeResult:
    mode: str
    workload: str
    decode_tok_s: float
    acceptance_length_mean: float
    drafted: int
    accepted: int
    by_source: dict[str, list[int]] = field(default_factory=dict)
    speedup: float = 0.0  # decode tok/s over plain decoding on the same workload ("ar", or "llama" for its modes)
    tokens: int = 0  # new tokens of the last request (drafted and accepted are its too): one that stops early is
    # not a faster one

    @property
    def tokens_per_step(self) -> float:
        """New tokens per target forward, every step counted (each commits its accepted drafts and one more)."""
        return self.tokens / (self.tokens - self.accepted) if self.tokens > self.accepted else 0.0


@dataclass
class VerifyCost:
    rows: int  # new tokens in the step, with logits for each (a block to verify)
    ms: float  # median wall time of the step
    vs_one_row: float  # ms over a one-row decode step's on the same context
    greedy_ms: float = 0.0  # the same step with only each row's pick (greedy verification: the head screened)
    greedy_vs_one_row: float = 0.0  # over a one-row greedy decode step's


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
    return {"code": code, "edit": edit, "module": module_prompt(engine, prompt_tokens),
            "patch": patch_prompt(engine, prompt_tokens), "quote": quote_prompt(engine, prompt_tokens)}


def _module_lines(engine: Engine, budget: int) -> list[str]:
    """textwrap.py's first lines, as many whole lines as fit in `budget` tokens."""
    import textwrap

    source = inspect.getsource(textwrap).splitlines()
    lines = len(source)
    while lines > 1 and len(engine.tokenizer.encode("\n".join(source[:lines]))) > budget:
        lines = lines * 3 // 4
    return source[:lines]


def module_prompt(engine: Engine, prompt_tokens: int) -> list[int]:
    """A module, then the start of the same module again with a comment added at its top: the answer copies the
    module (an agent rewriting a file with a small change). The module is cut to whole lines within the budget."""
    lines = _module_lines(engine, prompt_tokens - 40)  # 40: the lines around it
    module = "\n".join(lines)
    text = f"# textwrap.py\n{module}\n\n# textwrap.py, with a comment added at the top\n# Wrapping text.\n{lines[0]}\n"
    return engine.tokenizer.encode(text)[-prompt_tokens:]


def patch_prompt(engine: Engine, prompt_tokens: int) -> list[int]:
    """A module, then a unified diff that adds a comment at its top, started: the answer's context lines copy the
    module with a space before each (an agent writing a patch)."""
    lines = _module_lines(engine, (prompt_tokens - 60) // 2)  # the diff's own lines may tokenize longer
    header = f"--- a/textwrap.py\n+++ b/textwrap.py\n@@ -1,{len(lines)} +1,{len(lines) + 1} @@\n+# Wrapping text.\n"
    module = "\n".join(lines)
    text = f"# textwrap.py\n{module}\n\n# The patch that adds a comment at the top:\n{header} {lines[0]}\n"
    return engine.tokenizer.encode(text)[-prompt_tokens:]


def quote_prompt(engine: Engine, prompt_tokens: int) -> list[int]:
    """A tool's JSON output, then the start of the same output quoted back (an agent reporting what a tool said)."""
    import keyword

    words = keyword.kwlist + keyword.softkwlist
    records = [{"id": i, "name": word, "kind": "keyword" if keyword.iskeyword(word) else "soft keyword",
                "length": len(word), "upper": word.upper()} for i, word in enumerate(words)]
    for n in range(len(records), 0, -1):
        output = json.dumps(records[:n], indent=2)
        text = f"$ python list_keywords.py --json\n{output}\n\nThe tool printed, unchanged:\n```json\n[\n"
        ids = engine.tokenizer.encode(text)
        if len(ids) <= prompt_tokens:
            return ids
    return ids[-prompt_tokens:]


def verify_costs(engine: Engine, prompt: list[int], rows: tuple[int, ...] = (1, 16, 64),
                 repeats: int = 5) -> list[VerifyCost]:
    """Steps of `rows` new tokens with logits for every row, as verifying a drafted block takes, and with only every
    row's pick, as greedy verification takes (GemmaModel.forward's `greedy`), after `prompt`, on a cache of its own,
    timed alternately (median of `repeats`) on whatever path the engine takes for that many rows. Rolled back after
    each; the rings may then miss keys, which changes no step's cost."""
    runner = engine.runner
    cache = runner.new_cache(len(prompt) + max(rows) + 1)
    for chunk in torch.tensor(prompt, device=runner.device).split(PREFILL_CHUNK):  # as the engine prefills
        runner.forward(chunk, cache, logits_at=torch.arange(0))
    start = cache.length
    block = torch.tensor((prompt * (max(rows) // len(prompt) + 1))[:max(rows)], device=runner.device)
    times: dict[tuple[int, bool], list[float]] = {(n, greedy): [] for n in rows for greedy in (False, True)}
    for _ in range(repeats + 1):  # the first round warms up
        for n, greedy in times:
            cache.rollback(start)
            began = time.perf_counter()
            runner.forward(block[:n], cache, logits_at=torch.arange(n, device=runner.device), greedy=greedy)
            times[n, greedy].append(time.perf_counter() - began)
    median = {key: statistics.median(t[1:]) * 1e3 for key, t in times.items()}
    one = {greedy: median[min(rows), greedy] / min(rows) for greedy in (False, True)}
    return [VerifyCost(n, median[n, False], median[n, False] / one[False], median[n, True],
                       median[n, True] / one[True]) for n in rows]


# Depth rows: the drafter's bounded window they compare with its whole context (--draft-ctx): the bundled
# drafter's sliding window, so its full layer reads as far back as its sliding ones.
DEPTH_DRAFT_CTX = 2048
DEPTH_MODULES = ("argparse", "dataclasses", "inspect", "typing", "textwrap", "json.decoder")


@dataclass
class DepthCost:
    depth: int  # tokens of context before the step
    decode_ms: float  # a one-row greedy decode step (its pick, the head screened)
    verify16_ms: float  # a 16-row greedy verification step (each row's pick), as greedy speculation runs it
    verify16_vs_one_row: float


def depth_prompt(engine: Engine, depth: int) -> list[int]:
    """`depth` tokens of real Python that does not repeat (standard-library modules one after another), cut inside
    code: its continuation is more code, what a drafter is for, with no earlier copy of it for lookup."""
    import importlib

    ids: list[int] = []
    for name in DEPTH_MODULES:
        ids += engine.tokenizer.encode(inspect.getsource(importlib.import_module(name)) + "\n\n", add_bos=not ids)
        if len(ids) >= depth:
            return ids[:depth]
    raise UserError(f"the depth prompt's modules hold {len(ids)} tokens, fewer than {depth}")


def run_depth_bench(model: str, draft: str, depths: tuple[int, ...], decode_tokens: int = 64, repeats: int = 2,
                    draft_ctx: int = DEPTH_DRAFT_CTX, spec_block: int | None = None, dtype: str = "auto",
                    threads: int | None = None) -> tuple[list[ModeResult], list[DepthCost]]:
    """At each context depth: plain decoding, DFlash over the whole context and DFlash reading only the last
    `draft_ctx` tokens (--draft-ctx), tok/s and acceptance in alternating rounds (the first prefills and warms up;
    later rounds reuse the prompt from the prefix cache, so only decoding is timed); and a one-row decode step
    against a 16-row verification step there. Depths past the model's context are cut to what fits."""
    base = Engine.load(model, dtype=dtype, spec=SpecConfig(enabled=False), threads=threads)  # the model's context
    depths = tuple(sorted({min(d, base.n_ctx - decode_tokens - 32) for d in depths}))
    cfg = base.model.config
    drafter = load_drafter(draft, cfg.hidden_size, cfg.num_layers, cfg.vocab_size, base.model.device,
                           base.model.dtype)
    # a fixed block (the drafter's own unless asked): the adaptive controller may stop drafting, and acceptance is
    # what these rows compare
    spec = SpecConfig(block=spec_block or drafter.config.block_size, ngram=False)
    modes = {"ar": (None, SpecConfig(enabled=False)), "dflash": (drafter, spec),
             f"dflash draft-ctx {draft_ctx}": (drafter.with_context_window(draft_ctx), spec)}
    results: list[ModeResult] = []
    costs: list[DepthCost] = []
    for depth in depths:
        prompt = depth_prompt(base, depth)
        log.info("depth %d: %d modes, %d rounds", depth, len(modes), repeats + 1)
        rows = _workload(base, f"depth {depth}", prompt, modes, [], decode_tokens, repeats)
        ar = next(r for r in rows if r.mode == "ar")
        for r in rows:
            r.speedup = r.decode_tok_s / ar.decode_tok_s if ar.decode_tok_s else 0.0
        results += rows
        one, sixteen = verify_costs(base, prompt, rows=(1, 16), repeats=3)
        costs.append(DepthCost(depth, one.greedy_ms, sixteen.greedy_ms, sixteen.greedy_vs_one_row))
        log.info("depth %d: decode step %.1f ms, 16-row verify %.1f ms (%.2fx)", depth, one.ms, sixteen.ms,
                 sixteen.vs_one_row)
    base.close()
    return results, costs


def depth_report(results: list[ModeResult], costs: list[DepthCost], out: Path | None, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("depth", "mode", "decode tok/s", "x plain", "acceptance length", "tokens / step"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in results:
        table.add_row(r.workload.removeprefix("depth "), r.mode, f"{r.decode_tok_s:.2f}", f"{r.speedup:.2f}",
                      f"{r.acceptance_length_mean:.2f}", f"{r.tokens_per_step:.2f}")
    steps = Table(title="greedy step time against context depth")
    for column in ("depth", "decode step ms", "16-row verify ms", "x one row"):
        steps.add_column(column, justify="right")
    for c in costs:
        steps.add_row(str(c.depth), f"{c.decode_ms:.1f}", f"{c.verify16_ms:.1f}", f"{c.verify16_vs_one_row:.2f}")
    console = Console(stderr=True, width=max(100, Console(stderr=True).width))  # the modes' names
    console.print(table)
    console.print(steps)
    write_results(out, title, results, depth_costs=costs)


def write_results(out: Path | None, title: str, results: list[ModeResult], **costs: list) -> None:
    """The JSON of a spec bench: its title, the modes' results and each table of step costs by name."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"title": title, "results": [asdict(r) for r in results],
                               **{name: [asdict(c) for c in rows] for name, rows in costs.items()}}, indent=2) + "\n")
    log.warning("wrote %s", out)


def _run(engine: Engine, prompt: list[int], decode_tokens: int) -> FinalEvent:
    return asyncio.run(engine.complete(GenerateRequest(prompt, max_tokens=decode_tokens))).final


def llama_run(url: str, prompt: list[int], decode_tokens: int) -> dict:
    """llama-server's timings of one greedy completion of the token ids `prompt` (no prompt cache: each run
    prefills, as ours do)."""
    body = {"prompt": prompt, "n_predict": decode_tokens, "temperature": 0, "cache_prompt": False}
    response = httpx.post(f"{url}/completion", json=body, timeout=600)
    if response.status_code != 200:
        raise UserError(f"llama-server: HTTP {response.status_code}: {response.text[:500]}")
    return response.json()["timings"]


def llama_servers(model: str, llama_cpp: str | None, ctx: int, threads: int) -> list[tuple[str, list[str]]]:
    """The llama-server modes to run beside ours: none without a build or a GGUF."""
    binary = llama_cpp_binary(llama_cpp, "llama-server")
    path = resolve_model_path(model)
    if binary is None:
        log.warning("no llama-server found (--llama-cpp DIR or $LLAMA_CPP_BIN): no llama.cpp column")
        return []
    if path.suffix != ".gguf":
        log.warning("llama-server needs a GGUF; %s is not one: no llama.cpp column", path)
        return []
    base = [str(binary), "-m", str(path), "--port", "{port}", "-np", "1", "-c", str(ctx), "-t", str(threads),
            "-tb", str(threads), "--no-webui"]
    return [(mode, base + extra) for mode, extra in LLAMA_MODES.items()]


def run_spec_bench(
    model: str,
    draft: str | None,
    prompt_tokens: int = 384,
    decode_tokens: int = 96,
    repeats: int = 2,
    spec_block: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    llama_cpp: str | None = None,
    threads: int | None = None,
) -> tuple[list[ModeResult], list[VerifyCost]]:
    """draft: a drafter checkpoint, "random" for a randomly initialized one (until a trained drafter
    exists), or None to measure prompt lookup alone. llama_cpp: llama-server's directory (else $LLAMA_CPP_BIN,
    PATH); threads: ours and llama-server's."""
    ctx = prompt_tokens + decode_tokens + 32
    base = Engine.load(model, device=device, dtype=dtype, ctx_size=ctx, spec=SpecConfig(enabled=False),
                       threads=threads)
    threads = torch.get_num_threads()
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
        modes[DEFAULT_MODE] = (drafter, SpecConfig(block=spec_block))
    prompts = workloads(base, prompt_tokens)
    results: list[ModeResult] = []
    with ExitStack() as stack:
        llama = stack.enter_context(running_servers(llama_servers(model, llama_cpp, ctx, threads))) \
            if device in ("auto", "cpu") and base.model.device.type == "cpu" else []
        for workload, prompt in prompts.items():
            results += _workload(base, workload, prompt, modes, llama, decode_tokens, repeats)
    for r in results:
        plain = "llama" if r.mode.startswith("llama") else "ar"
        ar = next(x for x in results if x.workload == r.workload and x.mode == plain)
        r.speedup = r.decode_tok_s / ar.decode_tok_s if ar.decode_tok_s else 0.0
    costs = verify_costs(base, prompts["code"])
    for cost in costs:
        log.info("verify %d rows: %.1f ms, %.2fx a one-row step (greedy: %.1f ms, %.2fx)", cost.rows, cost.ms,
                 cost.vs_one_row, cost.greedy_ms, cost.greedy_vs_one_row)
    return results, costs


def _workload(base: Engine, workload: str, prompt: list[int], modes: dict, llama: list[tuple[str, str]],
              decode_tokens: int, repeats: int) -> list[ModeResult]:
    """Every mode on one prompt, in rounds that alternate the modes (each sees the same machine load); round 0
    warms every mode up (and trains our adaptive controllers)."""
    # our modes share the model
    engines = {mode: Engine(base.model, base.tokenizer, base.n_ctx, base.model_name, drafter=mode_drafter, spec=spec)
               for mode, (mode_drafter, spec) in modes.items()}
    ours: dict[str, list[FinalEvent]] = {mode: [] for mode in modes}
    theirs: dict[str, list[dict]] = {mode: [] for mode, _ in llama}
    try:
        for i in range(repeats + 1):
            for mode, engine in engines.items():
                final = _run(engine, prompt, decode_tokens)
                if i:
                    ours[mode].append(final)
            for mode, url in llama:
                timings = llama_run(url, prompt, decode_tokens)
                if i:
                    theirs[mode].append(timings)
    finally:
        for engine in engines.values():
            engine.close()
    results = []
    for mode, runs in ours.items():
        last = runs[-1]
        results.append(ModeResult(
            mode=mode, workload=workload,
            decode_tok_s=statistics.median(r.timings.predicted_per_second for r in runs),
            acceptance_length_mean=statistics.mean(r.spec.acceptance_length_mean for r in runs),
            drafted=last.spec.drafted, accepted=last.spec.accepted, by_source=last.spec.by_source,
            tokens=last.usage.completion_tokens))
    for mode, runs in theirs.items():
        last = runs[-1]
        results.append(ModeResult(
            mode=mode, workload=workload,
            decode_tok_s=statistics.median(t["predicted_per_second"] for t in runs), acceptance_length_mean=0.0,
            drafted=last.get("draft_n", 0), accepted=last.get("draft_n_accepted", 0), tokens=last["predicted_n"]))
    for r in results:
        log.info("%s / %s: %.2f tok/s, %.2f tokens per step, %d tokens", workload, r.mode, r.decode_tok_s,
                 r.tokens_per_step, r.tokens)
    return results


def report(results: list[ModeResult], costs: list[VerifyCost], out: Path | None, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    columns = ("workload", "mode", "decode tok/s", "x plain", "tokens / step", "drafted", "accepted", "tokens")
    for column in columns:
        table.add_column(column, justify="right" if column not in ("workload", "mode") else "left")
    for r in results:
        table.add_row(r.workload, r.mode, f"{r.decode_tok_s:.2f}", f"{r.speedup:.2f}", f"{r.tokens_per_step:.2f}",
                      str(r.drafted), str(r.accepted), str(r.tokens))
    console = Console(stderr=True, width=max(120, Console(stderr=True).width))  # the llama modes' names
    console.print(table)
    for line in versus_llama(results):
        console.print(line)
    rows = Table(title="verification step vs a one-row decode step, same context (all rows' logits; greedy: only "
                       "each row's pick)")
    for column in ("rows", "ms", "x one row", "ms per row", "greedy ms", "x one row ", "greedy ms per row"):
        rows.add_column(column, justify="right")
    for cost in costs:
        rows.add_row(str(cost.rows), f"{cost.ms:.1f}", f"{cost.vs_one_row:.2f}", f"{cost.ms / cost.rows:.2f}",
                     f"{cost.greedy_ms:.1f}", f"{cost.greedy_vs_one_row:.2f}", f"{cost.greedy_ms / cost.rows:.2f}")
    console.print(rows)
    write_results(out, title, results, verify_costs=costs)


def versus_llama(results: list[ModeResult]) -> list[str]:
    """Per workload: our default mode against llama-server's fastest n-gram mode (none without a llama column)."""
    lines = []
    for workload in dict.fromkeys(r.workload for r in results):
        rows = [r for r in results if r.workload == workload]
        ours = next((r for r in rows if r.mode == DEFAULT_MODE), None) or next((r for r in rows if r.mode == "ngram"),
                                                                              None)
        speculating = [r for r in rows if r.mode.startswith("llama ")]
        if ours is None or not speculating:
            continue
        best = max(speculating, key=lambda r: r.decode_tok_s)
        lines.append(f"{workload}: {ours.mode} {ours.decode_tok_s:.1f} tok/s = "
                     f"{ours.decode_tok_s / best.decode_tok_s:.2f}x {best.mode} ({best.decode_tok_s:.1f})")
    return lines
