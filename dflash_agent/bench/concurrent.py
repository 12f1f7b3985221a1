"""Several streams at once: aggregate and per-stream tok/s at 1, 2, 4, 8 concurrent requests, the time to first
token of a short request that arrives while a long prompt prefills and three streams decode (with the longest those
three go without a token meanwhile), the rate one decoding stream keeps while an 8K-token prompt prefills beside it,
and two requests sent together with one long system prompt (two sub-agents), answered with and without the prompt
cache, for `dflash-agent serve --parallel N` and, where a build is found,
`llama-server -np N` on the same GGUF.

Both servers run as processes of their own, side by side, and are driven alike through their OpenAI-compatible
/v1/completions (streamed, greedy, no prompt cache, the same text prompts); each repeat runs ours then theirs, so
a noisy machine hits both. Each server runs with its defaults otherwise (ours: speculation as the adaptive
controller decides; llama-server: none), and ours once more with `--no-spec` on the stream counts. Every batch
counts from numbers no batch before it used, so no server answers a repeat from what it remembers of the last.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from ..engine.load.weights import resolve_model_path
from ..errors import UserError
from ..options import server_api_key
from .cpu import llama_cpp_binary
from .http import decode_rate
from .servers import running_servers

log = logging.getLogger(__name__)

SHORT_NEW = 16  # the short request of the arrival test
# ours without speculation, on the stream counts only (the arrival and shared-start tests measure the scheduler, which
# the default server already shows)
PLAIN = "ours --no-spec"
LONG_PROMPT = 4096  # the prompt that prefills while it arrives
BESIDE_PROMPT = 8192  # the prompt that prefills beside one decoding stream: a coding agent's first prompt
ALONE_S = 2.0  # how long that stream decodes alone before the prompt is sent
SOLO_WINDOW_S = 1.5  # the last part of that, its solo rate (the first tokens come with its own prefill)
SHARED_PROMPT = 2048  # the system prompt two requests sent together share


@dataclass
class ConcurrencyRow:
    server: str
    streams: int
    aggregate_tok_s: float  # all streams' tokens over the wall time of the batch (median over repeats)
    per_stream_tok_s: float  # median over streams and repeats, first token to last
    ttft_p50_s: float


@dataclass
class ArrivalResult:
    server: str
    idle_ttft_s: float  # median
    busy_ttft_p50_s: float
    busy_ttft_p95_s: float
    stall_p50_s: float = 0.0  # the longest the decoding streams went without a token while the long prompt prefilled

    @property
    def ratio(self) -> float:
        return self.busy_ttft_p50_s / self.idle_ttft_s if self.idle_ttft_s else 0.0


@dataclass
class BesideResult:
    """One stream decoding when a BESIDE_PROMPT-token prompt arrives: its rate of text pieces (a token each without
    speculation) alone and while that prompt prefilled, medians over the repeats."""

    server: str
    alone_tok_s: float
    beside_tok_s: float
    prefill_s: float  # the long prompt's time to its first token

    @property
    def kept(self) -> float:
        return self.beside_tok_s / self.alone_tok_s if self.alone_tok_s else 0.0


@dataclass
class SharedStartResult:
    """Two requests sent together whose prompts share a SHARED_PROMPT-token start, SHORT_NEW tokens each: medians."""

    server: str
    wall_s: float  # both answered, with the prompt cache
    later_ttft_s: float  # the later of their first tokens
    wall_uncached_s: float  # the same with cache_prompt false (each prefills all of its prompt)
    later_ttft_uncached_s: float

    @property
    def speedup(self) -> float:
        return self.wall_uncached_s / self.wall_s if self.wall_s else 0.0


@dataclass(frozen=True)
class Target:
    """A server the bench drives: its name in the report, its root URL, the model id to ask for (None: any), its
    context length where it says."""

    name: str
    url: str
    model: str | None = None
    context: int | None = None
    api_key: str | None = None


@dataclass
class ConcurrentBenchResult:
    model: str
    threads: int
    decode_tokens: int
    repeats: int
    rows: list[ConcurrencyRow] = field(default_factory=list)
    arrivals: list[ArrivalResult] = field(default_factory=list)
    shared: list[SharedStartResult] = field(default_factory=list)
    beside: list[BesideResult] = field(default_factory=list)


async def _stream(client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int,
                  stamps: list[float] | None = None, cache: bool = False) -> tuple[float, float, int]:
    """(seconds to the first token, decode tok/s after it, completion tokens) of one streamed completion; stamps:
    where to note when each piece of text arrived; cache: whether the server may reuse a prompt's KV (llama.cpp's
    and our field; other servers ignore it)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "cache_prompt": cache,
            "stream_options": {"include_usage": True}, **({"model": target.model} if target.model else {})}
    url = target.url
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    started = time.perf_counter()
    first = last = 0.0
    pieces = n = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise UserError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
                pieces += 1
                if stamps is not None:
                    stamps.append(last)
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    n = n or pieces
    return first - started, decode_rate(first, last, n), n


def _prompts(n: int, first: int = 0) -> list[str]:
    """Counting from a different number each: a base model continues such a list for as long as it is let. `first`
    numbers the first of them, so that each batch counts from numbers no earlier batch has: a server that drafts from
    the answers it remembers (ours) would otherwise copy a repeat's answer from the one before."""
    return [", ".join(str(k) for k in range(100 * i + 1, 100 * i + 13)) + "," for i in range(first, first + n)]


async def _batch(target: Target, streams: int, decode_tokens: int,
                 first: int = 0) -> tuple[float, list[float], list[float]]:
    """(aggregate tok/s, per-stream decode tok/s, TTFTs) of `streams` requests sent at once, their prompts
    `_prompts(streams, first)`."""
    async with httpx.AsyncClient(timeout=None) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(_stream(client, target, p, decode_tokens)
                                         for p in _prompts(streams, first)))
        wall = time.perf_counter() - started
    return sum(n for _, _, n in results) / wall, [r for _, r, _ in results], [t for t, _, _ in results]


async def _alone(target: Target, prompt: str) -> float:
    """TTFT of the arrival test's short request on an idle server."""
    async with httpx.AsyncClient(timeout=None) as client:
        return (await _stream(client, target, prompt, SHORT_NEW))[0]


async def _arrival(target: Target, long_prompt: str, short_prompt: str, decode_tokens: int,
                   first: int = 0) -> tuple[float, float]:
    """(TTFT of a short request sent while one long prompt prefills and three streams decode, the longest the three
    went without a token while the long prompt prefilled)."""
    stamps: list[list[float]] = [[], [], []]
    async with httpx.AsyncClient(timeout=None) as client:
        running = [asyncio.create_task(_stream(client, target, p, decode_tokens * 4, s))
                   for p, s in zip(_prompts(3, first), stamps, strict=True)]
        await asyncio.sleep(1.0)  # the three are decoding
        long_sent = time.perf_counter()
        long = asyncio.create_task(_stream(client, target, long_prompt, 8))
        await asyncio.sleep(0.5)  # the long prompt is prefilling
        ttft, _, _ = await _stream(client, target, short_prompt, SHORT_NEW)
        long_ttft, _, _ = await long
        still = [not task.done() for task in running]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    return ttft, longest_pause(stamps, still, long_sent, long_sent + long_ttft)


async def _shared_start(target: Target, system: str, cache: bool) -> tuple[float, float]:
    """(seconds until both answered, the later first token) of two requests sent together after one system prompt."""
    async with httpx.AsyncClient(timeout=None) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(_stream(client, target, f"{system}\nTask {k}: list the files to read first.",
                                                 SHORT_NEW, cache=cache) for k in (1, 2)))
        return time.perf_counter() - started, max(ttft for ttft, _, _ in results)


def rate_within(stamps: list[float], start: float, end: float) -> float:
    """Pieces of text a second that arrived from start to end."""
    return sum(start < t <= end for t in stamps) / (end - start) if end > start else 0.0


async def _beside_prefill(target: Target, long_prompt: str, decode_prompt: str) -> tuple[float, float, float]:
    """(the decoding stream's rate alone, its rate while the long prompt prefilled, that prompt's time to its first
    token) of one stream decoding when a long prompt arrives."""
    stamps: list[float] = []
    async with httpx.AsyncClient(timeout=None) as client:
        running = asyncio.create_task(_stream(client, target, decode_prompt, 100_000, stamps))
        await asyncio.sleep(ALONE_S)
        long_sent = time.perf_counter()
        long_ttft, _, _ = await _stream(client, target, long_prompt, 1)
        ended = running.done()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    if ended:
        log.warning("%s: the decoding stream ended before the long prompt's first token", target.name)
    alone = rate_within(stamps, long_sent - SOLO_WINDOW_S, long_sent)
    return alone, rate_within(stamps, long_sent, long_sent + long_ttft), long_ttft


def longest_pause(stamps: list[list[float]], still: list[bool], start: float, end: float) -> float:
    """The longest any stream went without a token from start to end (a stream that ended before `end`, as `still`
    says, up to its last token)."""
    longest = 0.0
    for times, running in zip(stamps, still, strict=True):
        points = [start, *(t for t in times if start < t < end), *([end] if running else [])]
        longest = max([longest, *(b - a for a, b in itertools.pairwise(points))])
    return longest


def _long_prompt(tokens: int) -> str:
    import inspect
    import json.decoder

    words = (inspect.getsource(json.decoder) * 8).split(" ")
    return " ".join(words[: int(tokens * 0.55)])  # about a token and a half per space-separated word of code


def run_concurrent_bench(model: str, streams: tuple[int, ...], decode_tokens: int, repeats: int,
                         llama_cpp: str | None, threads: int | None,
                         server: str | None = None) -> ConcurrentBenchResult:
    """Ours and llama-server (where found) started here; `server`, a running one, measured beside them on the same
    prompts. The arrival and shared-start tests need room for a LONG_PROMPT-token prompt: a server whose context
    is shorter is measured on the stream counts only."""
    from ..engine.engine import physical_cores

    threads = threads or physical_cores()
    path = resolve_model_path(model)
    # the arrival test keeps four slots busy (three decoding, one prefilling): a fifth takes the short request
    slots = max(*streams, 5)
    ctx = BESIDE_PROMPT + 1024  # per slot: the longest test prompt and room to decode
    ours = [sys.executable, "-m", "dflash_agent", "serve", "--model", model, "--port", "{port}", "--parallel",
            str(slots), "--ctx-size", str(ctx), "--threads", str(threads), "--no-access-log", "--max-queue", "64"]
    # without speculation too: the multiplier batching gives on its own, beside what it gives with drafting on
    servers: list[tuple[str, list[str]]] = [("dflash-agent", ours), (PLAIN, [*ours, "--no-spec"])]
    binary = llama_cpp_binary(llama_cpp, "llama-server")
    if binary is None:
        log.warning("no llama-server found (--llama-cpp DIR or $LLAMA_CPP_BIN): only dflash-agent is measured")
    elif path.suffix != ".gguf":
        log.warning("llama-server needs a GGUF; %s is not one: only dflash-agent is measured", path)
    else:
        servers.append(("llama-server", [str(binary), "-m", str(path), "--port", "{port}", "-np", str(slots),
                                         "-c", str(ctx * slots), "-t", str(threads), "-tb", str(threads),
                                         "--no-webui"]))
    result = ConcurrentBenchResult(model, threads, decode_tokens, repeats)
    long_prompt, short_prompt = _long_prompt(LONG_PROMPT), "Write the numbers from one to ten: 1, 2,"
    beside_prompt = _long_prompt(BESIDE_PROMPT)
    external = [remote_target(server)] if server is not None else []
    with running_servers(servers) as urls:
        urls = [*(Target(name, url) for name, url in urls), *external]
        for target in urls:  # warm-up: first requests pay for lazy setup
            asyncio.run(_batch(target, 1, 8))
        stride = max(*streams, 3)
        fresh = (stride * block for block in itertools.count(1))  # each batch's prompts new to every server
        rates: dict[tuple[str, int], list[tuple[float, list[float], list[float]]]] = {}
        idle: dict[str, list[float]] = {}
        busy: dict[str, list[float]] = {}
        stalls: dict[str, list[float]] = {}
        shared: dict[tuple[str, bool], list[tuple[float, float]]] = {}
        beside: dict[str, list[tuple[float, float, float]]] = {}
        for repeat in range(repeats):
            for n in streams:
                first = next(fresh)
                for target in urls:
                    name = target.name
                    rates.setdefault((name, n), []).append(asyncio.run(_batch(target, n, decode_tokens, first)))
                    log.info("repeat %d/%d, %d streams, %s: %.1f tok/s aggregate", repeat + 1, repeats, n, name,
                             rates[(name, n)][-1][0])
            first = next(fresh)
            for target in urls:
                name = target.name
                if name == PLAIN or target in external and not _fits(target, LONG_PROMPT + 64):
                    continue
                idle.setdefault(name, []).append(asyncio.run(_alone(target, short_prompt)))
                ttft, stall = asyncio.run(_arrival(target, long_prompt, short_prompt, decode_tokens, first))
                busy.setdefault(name, []).append(ttft)
                stalls.setdefault(name, []).append(stall)
                log.info("repeat %d/%d, arrival, %s: TTFT %.2f s idle, %.2f s busy; the streams' longest pause "
                         "%.2f s", repeat + 1, repeats, name, idle[name][-1], ttft, stall)
            first = next(fresh)
            for target in urls:
                name = target.name
                if name == PLAIN or target in external and not _fits(target, BESIDE_PROMPT + 64):
                    continue
                # a prompt of its own each repeat (nothing cached from before), the stream's numbers new too
                prompt = f"Session {repeat}.\n{beside_prompt}"
                beside.setdefault(name, []).append(asyncio.run(_beside_prefill(target, prompt, _prompts(1, first)[0])))
                alone, during, prefill = beside[name][-1]
                log.info("repeat %d/%d, beside a %d-token prefill, %s: %.1f tok/s alone, %.1f meanwhile (%.2f s)",
                         repeat + 1, repeats, BESIDE_PROMPT, name, alone, during, prefill)
            for target in urls:
                name = target.name
                if name == PLAIN or target in external and not _fits(target, SHARED_PROMPT + 64):
                    continue
                for cache in (False, True):  # a system prompt of its own each time: nothing cached from before
                    system = f"Session {repeat}, {'cached' if cache else 'uncached'}.\n{_long_prompt(SHARED_PROMPT)}"
                    shared.setdefault((name, cache), []).append(asyncio.run(_shared_start(target, system, cache)))
                log.info("repeat %d/%d, shared start, %s: both answered in %.2f s cached, %.2f s uncached",
                         repeat + 1, repeats, name, shared[(name, True)][-1][0], shared[(name, False)][-1][0])
    for (name, n), runs in rates.items():
        result.rows.append(ConcurrencyRow(name, n, statistics.median(r[0] for r in runs),
                                          statistics.median(x for r in runs for x in r[1]),
                                          statistics.median(x for r in runs for x in r[2])))
    for name in idle:
        ordered = sorted(busy[name])
        result.arrivals.append(ArrivalResult(name, statistics.median(idle[name]), statistics.median(ordered),
                                             ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))],
                                             statistics.median(stalls[name])))
        on, off = shared[(name, True)], shared[(name, False)]
        result.shared.append(SharedStartResult(name, statistics.median(r[0] for r in on),
                                               statistics.median(r[1] for r in on),
                                               statistics.median(r[0] for r in off),
                                               statistics.median(r[1] for r in off)))
    for name, runs in beside.items():
        result.beside.append(BesideResult(name, *(statistics.median(r[i] for r in runs) for i in range(3))))
    return result


def remote_target(server: str) -> Target:
    """A running server given as its root or API URL (http://host:8000 or .../v1), with the model it serves first
    and its context length where /v1/models says (vLLM's max_model_len, ours and llama.cpp's meta n_ctx), sent the
    key `--server` sends everywhere (DFLASH_AGENT_API_KEY, else OPENAI_API_KEY)."""
    root = server.rstrip("/").removesuffix("/v1")
    key = server_api_key()
    try:
        listed = httpx.get(f"{root}/v1/models", timeout=30, headers={"Authorization": f"Bearer {key}"} if key else {})
        listed.raise_for_status()
        card = listed.json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise UserError(f"--server {server}: cannot read its /v1/models ({exc})") from None
    meta = card.get("meta") if isinstance(card.get("meta"), dict) else {}
    context = card.get("max_model_len") or meta.get("n_ctx")
    url = httpx.URL(root)
    return Target(f"{url.host}:{url.port}" if url.port else url.host, root, card.get("id"),
                  int(context) if isinstance(context, (int, float)) else None, key)


def _fits(target: Target, tokens: int) -> bool:
    if target.context is not None and target.context < tokens:
        log.warning("%s: its context (%d tokens) cannot take the %d-token prompt of a test: measured on the stream "
                    "counts only", target.name, target.context, tokens)
        return False
    return True


def report(result: ConcurrentBenchResult, out: Path) -> None:
    print(f"concurrent streams, {result.model}: {result.threads} threads, {result.decode_tokens} new tokens each, "
          f"greedy, median of {result.repeats}")
    single = {r.server: r.aggregate_tok_s for r in result.rows if r.streams == 1}
    by_key = {(r.server, r.streams): r for r in result.rows}
    print(f"  {'server':<14}{'streams':>8}{'aggregate':>12}{'x one':>8}{'per stream':>12}{'TTFT p50':>10}"
          f"{'vs llama':>10}")
    for r in result.rows:
        theirs = by_key.get(("llama-server", r.streams))
        versus = f"{r.aggregate_tok_s / theirs.aggregate_tok_s:9.2f}x" if theirs and r.server != "llama-server" \
            else ""
        one = f"{r.aggregate_tok_s / single[r.server]:>7.2f}x" if r.server in single else f"{'':>8}"
        print(f"  {r.server:<14}{r.streams:>8}{r.aggregate_tok_s:>12.1f}{one}{r.per_stream_tok_s:>12.1f}"
              f"{r.ttft_p50_s:>9.2f}s{versus}")
    for a in result.arrivals:
        print(f"  {a.server}: a {SHORT_NEW}-token request arriving during a {LONG_PROMPT}-token prefill and 3 "
              f"streams: TTFT p50 {a.busy_ttft_p50_s:.2f} s, p95 {a.busy_ttft_p95_s:.2f} s; idle {a.idle_ttft_s:.2f} s "
              f"({a.ratio:.1f}x); the 3 streams' longest pause while it prefilled: {a.stall_p50_s:.2f} s (p50)")
    for r in result.beside:
        print(f"  {r.server}: one stream decoding while a {BESIDE_PROMPT}-token prompt prefills ({r.prefill_s:.1f} s): "
              f"{r.beside_tok_s:.1f} tok/s against {r.alone_tok_s:.1f} alone ({r.kept:.0%} kept)")
    for r in result.shared:
        print(f"  {r.server}: two requests sent together with one {SHARED_PROMPT}-token system prompt: both "
              f"answered in {r.wall_s:.2f} s with the prompt cache, {r.wall_uncached_s:.2f} s without "
              f"({r.speedup:.2f}x); the later first token {r.later_ttft_s:.2f} s, {r.later_ttft_uncached_s:.2f} s")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(asdict(result), indent=2))
    print(f"written to {out}")
