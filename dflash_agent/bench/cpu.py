"""Prefill and decode speed of this engine (packed weights, the default, and exact) against transformers and,
when a build is at hand, llama.cpp on the same checkpoint, prompt length and threads, in one run, alternating."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..engine import EMBEDDED, Engine, GenerateRequest, SpecConfig
from ..engine.load.weights import resolve_model_path
from ..engine.model.packed import prefill_dtype, release_cpu_threads
from ..errors import UserError

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
    prefill: str  # the packed engine's prompt GEMMs (EngineConfig's prefill, resolved)
    threads: int
    prompt_tokens: int
    decode_tokens: int
    repeats: int
    ours: Speed  # packed weights (the CPU default)
    exact: Speed  # dequantized float32 weights (--weights exact)
    transformers: Speed | None  # None: transformers cannot load this model (a Gemma 4 GGUF, say)
    llama_cpp: Speed | None = None  # None: no llama.cpp build was found
    llama_cpp_note: str = ""
    llama_cpp_decode_after_prompt: float | None = None  # tg at a depth of prompt_tokens, where ours decodes
    transformers_note: str = ""
    # decode tok/s while another process keeps a core busy (None: a single thread, or no llama.cpp)
    busy_decode_tok_s: float | None = None
    llama_cpp_busy_decode_tok_s: float | None = None


def _ratio(a: Speed, b: Speed) -> Speed:
    return Speed(a.prefill_tok_s / b.prefill_tok_s, a.decode_tok_s / b.decode_tok_s)


def llama_cpp_binary(directory: str | None, name: str = "llama-bench") -> Path | None:
    """llama.cpp's `name` (llama-bench, llama-server) in `directory`, else in $LLAMA_CPP_BIN, else on PATH."""
    for d in (directory, os.environ.get("LLAMA_CPP_BIN")):
        if d:
            candidate = Path(d).expanduser() / name
            if not candidate.is_file():
                raise UserError(f"no {name} in {d}")
            return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def _llama_cpp(binary: Path, gguf: Path, prompt_tokens: int, decode_tokens: int,
               threads: int) -> tuple[float, float, float | None]:
    """(prefill seconds, decode tok/s, decode tok/s after the prompt) from llama-bench on the same file and
    threads: its pp and tg from an empty context (llama-bench's figures), and tg again at the prompt's depth,
    where ours decodes (attention over the prompt costs every step); None for that where the build has no -d."""

    def bench(*args: str) -> list[dict]:
        return json.loads(subprocess.run(
            [str(binary), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *args],
            capture_output=True, text=True, timeout=600, check=True).stdout)

    rows = bench("-p", str(prompt_tokens), "-n", str(decode_tokens))
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"])
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"])
    try:
        deep = bench("-p", "0", "-n", str(decode_tokens), "-d", str(prompt_tokens))
    except subprocess.CalledProcessError:  # a build from before llama-bench's -d
        return prompt_tokens / pp, tg, None
    return prompt_tokens / pp, tg, next(r["avg_ts"] for r in deep if r["n_gen"])


def code_prompt(engine: Engine, n_tokens: int) -> list[int]:
    """A real Python source, cut to n_tokens: the workload the embedded model is meant for."""
    import json.decoder

    ids = engine.tokenizer.encode(inspect.getsource(json.decoder) * 4)
    return ids[:n_tokens]


def _ours(engine: Engine, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tok/s) through the engine's own request path."""
    final = asyncio.run(engine.complete(GenerateRequest(prompt, max_tokens=decode_tokens))).final
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
    # its OpenMP threads end, so the engine's worker holds the only ones again, as in a server (else both wait
    # asleep between regions: CpuDot.release_threads)
    release_cpu_threads(torch.device("cpu"))
    return first, (decode_tokens - 1) / max(total - first, 1e-9)


@contextlib.contextmanager
def _busy_core() -> Iterator[None]:
    """Another process spinning on a core meanwhile, as an agent's tests or build would."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # started and scheduled
        yield
    finally:
        spinner.kill()
        spinner.wait()


def _transformers_reference(path: Path, dtype: torch.dtype):
    """transformers' model of the same file, or (None, why) where it cannot load it: its GGUF loader knows fewer
    architectures than the engine (no Gemma 4), and that column is a reference, not the benchmark."""
    from transformers import AutoModelForCausalLM

    log.info("loading the transformers reference from %s", path)
    try:
        if path.is_dir():
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), ""
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval(), ""
    except Exception as exc:  # any failure of the reference's loader leaves its column out, said in the report
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("no transformers column: it cannot load %s (%s)", path.name, why)
        return None, f"no transformers column: transformers cannot load {path.name} ({why})"


def run_cpu_bench(model: str = EMBEDDED, prompt_tokens: int = 256, decode_tokens: int = 64,
                  repeats: int = 3, dtype: str = "float32", llama_cpp: str | None = None,
                  threads: int | None = None, prefill: str = "auto") -> BenchResult:
    llama_bench = llama_cpp_binary(llama_cpp)
    prompt_gemms = str(prefill_dtype(prefill)).removeprefix("torch.")
    # Every round prefills the same prompt: without the prefix cache, so each one is measured in full;
    # and decodes plainly, as transformers does (bench --spec measures speculation).
    engines = {weights: Engine.load(model, device="cpu", dtype=dtype, ctx_size=prompt_tokens + decode_tokens + 8,
                                    prefix_cache=False, spec=SpecConfig(enabled=False), weights=weights,
                                    threads=threads, progress=False, prefill=prefill)
               for weights in ("packed", "exact")}
    engine = engines["packed"]
    torch_dtype = engine.model.dtype
    path = resolve_model_path(model)
    reference, reference_note = _transformers_reference(path, torch_dtype)
    prompt = code_prompt(engine, prompt_tokens)
    threads = torch.get_num_threads()
    samples: dict[str, list] = {"packed": [], "exact": [], "transformers": [], "llama.cpp": [],
                                "llama.cpp after prompt": []}
    is_gguf = path.suffix == ".gguf"
    note = "" if llama_bench and is_gguf else (
        "llama.cpp runs GGUF files only" if llama_bench else
        "no llama.cpp build found: pass --llama-cpp DIR or set LLAMA_CPP_BIN to a directory with llama-bench")
    for i in range(repeats + 1):  # the first round warms every contender up and is not counted
        log.info("round %d/%d", i, repeats)
        round_ = {w: _ours(e, prompt, decode_tokens) for w, e in engines.items()}
        if reference is not None:
            round_["transformers"] = _theirs(reference, prompt, decode_tokens)
        if llama_bench and is_gguf:
            prompt_s, decode, after_prompt = _llama_cpp(llama_bench, path, len(prompt), decode_tokens, threads)
            round_["llama.cpp"] = (prompt_s, decode)
            if after_prompt is not None:
                round_["llama.cpp after prompt"] = (prompt_s, after_prompt)
        if i:
            for name, value in round_.items():
                samples[name].append(value)
    busy: dict[str, list[float]] = {"packed": [], "llama.cpp": []}
    if threads > 1:
        with _busy_core():
            for i in range(repeats + 1):
                log.info("round %d/%d with a core kept busy", i, repeats)
                busy_round = {"packed": _ours(engine, prompt, decode_tokens)[1]}
                if llama_bench and is_gguf:
                    busy_round["llama.cpp"] = _llama_cpp(llama_bench, path, len(prompt), decode_tokens, threads)[1]
                if i:
                    for name, value in busy_round.items():
                        busy[name].append(value)
    for e in engines.values():
        e.close()

    def speed(samples: list[tuple[float, float]]) -> Speed:
        return Speed(len(prompt) / statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples))

    return BenchResult(
        model=str(path.name), device="cpu", dtype=str(torch_dtype).removeprefix("torch."),
        prefill=prompt_gemms, threads=threads,
        prompt_tokens=len(prompt), decode_tokens=decode_tokens, repeats=repeats,
        ours=speed(samples["packed"]), exact=speed(samples["exact"]),
        transformers=speed(samples["transformers"]) if samples["transformers"] else None,
        transformers_note=reference_note,
        llama_cpp=speed(samples["llama.cpp"]) if samples["llama.cpp"] else None, llama_cpp_note=note,
        llama_cpp_decode_after_prompt=(speed(samples["llama.cpp after prompt"]).decode_tok_s
                                       if samples["llama.cpp after prompt"] else None),
        busy_decode_tok_s=statistics.median(busy["packed"]) if busy["packed"] else None,
        llama_cpp_busy_decode_tok_s=statistics.median(busy["llama.cpp"]) if busy["llama.cpp"] else None,
    )


def report(result: BenchResult, out: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result.model} on {result.device}, {result.dtype} activations ({result.prefill} prompt "
                        f"GEMMs), {result.threads} threads, "
                        f"prompt {result.prompt_tokens} tokens, decode {result.decode_tokens}, medians of "
                        f"{result.repeats}")
    contenders = {"dflash-agent (packed)": result.ours, "dflash-agent (exact)": result.exact}
    baselines = {"exact": result.exact}
    for name, speed in (("transformers", result.transformers), ("llama.cpp", result.llama_cpp)):
        if speed is not None:
            contenders[name] = baselines[name] = speed
    table.add_column("")
    for name in contenders:
        table.add_column(name, justify="right")
    for name in baselines:
        table.add_column(f"packed x {name}", justify="right")
    for field, label in (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s")):
        mine = getattr(result.ours, field)
        table.add_row(label, *(f"{getattr(s, field):.1f}" for s in contenders.values()),
                      *(f"{mine / getattr(b, field):.2f}x" for b in baselines.values()))
    console = Console()
    console.print(table)
    if result.llama_cpp_decode_after_prompt:
        after = result.llama_cpp_decode_after_prompt
        console.print(f"llama.cpp's tg is measured from an empty context; at the depth of the prompt, where ours "
                      f"decodes (tg @ d{result.prompt_tokens}), it is {after:.1f} tok/s: packed "
                      f"{result.ours.decode_tok_s / after:.2f}x")
    if result.busy_decode_tok_s:
        line = (f"with another process keeping a core busy, packed decodes at {result.busy_decode_tok_s:.1f} tok/s "
                f"({result.busy_decode_tok_s / result.ours.decode_tok_s:.0%} of its quiet speed)")
        if result.llama_cpp_busy_decode_tok_s and result.llama_cpp:
            line += (f", llama.cpp at {result.llama_cpp_busy_decode_tok_s:.1f} "
                     f"({result.llama_cpp_busy_decode_tok_s / result.llama_cpp.decode_tok_s:.0%})")
        console.print(line)
    for note in (result.transformers_note, result.llama_cpp_note):
        if note:
            console.print(f"note: {note}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        ratios = {"vs_exact": asdict(_ratio(result.ours, result.exact))}
        if result.transformers:
            ratios["vs_transformers"] = asdict(_ratio(result.ours, result.transformers))
        if result.llama_cpp:
            ratios["vs_llama_cpp"] = asdict(_ratio(result.ours, result.llama_cpp))
        if result.llama_cpp_decode_after_prompt:
            ratios["decode_vs_llama_cpp_after_prompt"] = result.ours.decode_tok_s / result.llama_cpp_decode_after_prompt
        out.write_text(json.dumps(asdict(result) | {"ratios": ratios}, indent=2))
        Console(stderr=True).print(f"wrote {out}")
