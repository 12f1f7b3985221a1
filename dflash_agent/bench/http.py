"""Server overhead: streamed decode tok/s through HTTP vs the bare engine, same prompt, same run.

Both paths share one loaded engine. Each repeat runs the bare engine and then the HTTP stream
(/v1/completions, token ids, greedy, no prefix cache so both prefill the same way), and decode
speed is timed from the first token to the last on each side, the way a client feels it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from ..api.background import live_server
from ..engine import Engine, GenerateRequest, SpecConfig, TokenEvent
from .cpu import code_prompt

log = logging.getLogger(__name__)


@dataclass
class HttpBenchResult:
    model: str
    prompt_tokens: int
    decode_tokens: int
    repeats: int
    engine_tok_s: float  # median
    http_tok_s: float  # median
    loss_percent: float  # (engine - http) / engine


def decode_rate(first: float, last: float, tokens: int) -> float:
    # The first token ends the prefill; the rate counts the tokens that came after it.
    return (tokens - 1) / (last - first) if last > first else 0.0


def _engine_run(engine: Engine, prompt: list[int], decode_tokens: int) -> tuple[float, int]:
    seen = [0.0, 0.0]  # when the first and the last token arrived

    def on_token(event: TokenEvent) -> None:
        if event.ids:
            seen[1] = time.perf_counter()
            seen[0] = seen[0] or seen[1]

    request = GenerateRequest(prompt, max_tokens=decode_tokens, cache_prompt=False)
    n = asyncio.run(engine.complete(request, on_token)).final.usage.completion_tokens
    return decode_rate(seen[0], seen[1], n), n


def _http_run(url: str, prompt: list[int], decode_tokens: int) -> tuple[float, int]:
    body = {"prompt": prompt, "max_tokens": decode_tokens, "temperature": 0, "stream": True, "cache_prompt": False,
            "stream_options": {"include_usage": True}}
    first = last = 0.0
    n = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return decode_rate(first, last, n), n


def run_http_bench(model: str, prompt_tokens: int, decode_tokens: int, repeats: int,
                   dtype: str = "auto") -> HttpBenchResult:
    # Speculation off: its adaptive controller would make two runs of one prompt differ in work.
    engine = Engine.load(model, dtype=dtype, spec=SpecConfig(enabled=False))
    prompt = code_prompt(engine, prompt_tokens)
    engine_rates: list[float] = []
    http_rates: list[float] = []
    with live_server(lambda: engine) as url:
        _engine_run(engine, prompt, 8)  # warm-up
        for i in range(repeats):
            rate, n_engine = _engine_run(engine, prompt, decode_tokens)
            engine_rates.append(rate)
            rate, n_http = _http_run(url, prompt, decode_tokens)
            http_rates.append(rate)
            if n_engine != n_http:
                raise RuntimeError(f"the engine gave {n_engine} tokens but HTTP {n_http}: not the same work")
            log.info("repeat %d/%d: engine %.2f tok/s, http %.2f tok/s", i + 1, repeats, engine_rates[-1],
                        http_rates[-1])
    e, h = statistics.median(engine_rates), statistics.median(http_rates)
    return HttpBenchResult(engine.model_name, len(prompt), decode_tokens, repeats, e, h, (e - h) / e * 100)


def report(result: HttpBenchResult, out: Path) -> None:
    print(f"server overhead, {result.model}: prompt {result.prompt_tokens}, decode {result.decode_tokens}, "
          f"median of {result.repeats}")
    print(f"  bare engine  {result.engine_tok_s:8.2f} tok/s")
    print(f"  HTTP stream  {result.http_tok_s:8.2f} tok/s  ({result.http_tok_s / result.engine_tok_s:.3f}x, "
          f"{result.loss_percent:+.2f}% loss)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(asdict(result), indent=2))
    print(f"written to {out}")
