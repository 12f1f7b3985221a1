"""`bench --startup`: a model's start as a user meets it, ours (`dflash-agent serve`) against llama-server on the same
GGUF, the two alternated: seconds from the process's start to /health 200 and to the first streamed token of a short
prompt, the server's peak RSS (VmHWM), and prefill and decode tok/s of a 256-token code prompt from each server's own
timings. The first round starts after the page cache is dropped (where this process may: root), so it reads the file
from disk; the later rounds find it cached, as a second start does.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from ..api.background import free_port
from ..errors import UserError
from .servers import READY_S, stop_process, wait_until_ready

log = logging.getLogger(__name__)

SHORT_PROMPT = "def add(a, b):"


@dataclass
class Start:
    ready_s: float  # process start -> /health 200
    first_token_s: float  # process start -> first streamed token of SHORT_PROMPT
    peak_rss_bytes: int  # the server's VmHWM after the requests
    prefill_tok_s: float
    decode_tok_s: float


@dataclass
class StartupResult:
    model: str
    file_bytes: int
    threads: int
    ctx_size: int
    first: dict[str, Start]  # the page cache dropped before (or not: page_cache_dropped)
    second: dict[str, Start]  # medians of the later rounds, the file cached
    page_cache_dropped: bool


def code_prompt_text() -> str:
    import json.decoder

    return inspect.getsource(json.decoder)[:1200]  # about 256 tokens of Python


def drop_page_cache() -> bool:
    """Drop the clean page cache (root only), so the next start reads the model from disk."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def measure_start(name: str, command: list[str], port: int, decode_tokens: int) -> Start:
    """Start `command` (serving on `port`), time it to ready and to a first token, then read its speeds and its
    peak RSS, and stop it."""
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(name, proc, url, poll_s=0.05)
        ready = time.monotonic() - started
        body = {"prompt": SHORT_PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
        first = None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=READY_S) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and first is None:
                    if json.loads(line[6:]).get("choices", [{}])[0].get("text"):
                        first = time.monotonic() - started
        body = {"prompt": code_prompt_text(), "max_tokens": decode_tokens, "temperature": 0}
        timings = httpx.post(f"{url}/v1/completions", json=body, timeout=READY_S).json()["timings"]
        return Start(ready, first if first is not None else float("nan"), _peak_rss(proc.pid),
                     timings["prompt_per_second"], timings["predicted_per_second"])
    finally:
        stop_process(proc, grace_s=60)


def run_startup_bench(model: str, llama_server: Path | None, rounds: int = 3, threads: int = 2,
                      ctx_size: int = 4096, decode_tokens: int = 32) -> StartupResult:
    path = Path(model)
    if path.suffix != ".gguf" or not path.is_file():
        raise UserError(f"bench --startup needs a .gguf file, got {model}")

    def commands(port: int) -> dict[str, list[str]]:
        out = {"ours": [sys.executable, "-m", "dflash_agent", "serve", "--model", str(path), "--port", str(port),
                        "--ctx-size", str(ctx_size), "--threads", str(threads), "--parallel", "1", "--no-spec"]}
        if llama_server is not None:
            out["llama.cpp"] = [str(llama_server), "-m", str(path), "--port", str(port), "-c", str(ctx_size), "-t",
                                str(threads), "-np", "1", "--no-webui"]
        return out

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per /health poll otherwise
    dropped = False
    runs: dict[str, list[Start]] = {}
    for i in range(rounds + 1):  # round 0: from disk
        for name in commands(0):
            if i == 0:
                dropped = drop_page_cache()
            port = free_port()
            log.info("round %d/%d: %s", i, rounds, name)
            runs.setdefault(name, []).append(measure_start(name, commands(port)[name], port, decode_tokens))

    def median(starts: list[Start]) -> Start:
        return Start(*(statistics.median(getattr(s, name) for s in starts) for name in Start.__dataclass_fields__))

    return StartupResult(path.name, path.stat().st_size, threads, ctx_size,
                         {name: starts[0] for name, starts in runs.items()},
                         {name: median(starts[1:]) for name, starts in runs.items()}, dropped)


def report(result: StartupResult, out: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    cache = "page cache dropped" if result.page_cache_dropped else "page cache NOT dropped"
    table = Table(title=f"{result.model} ({result.file_bytes / 2**30:.2f} GiB), {result.threads} threads, context "
                        f"{result.ctx_size}: first start ({cache}) and the median of the later ones")
    for column in ("server", "start", "ready s", "first token s", "peak RSS GiB", "prefill tok/s", "decode tok/s"):
        table.add_column(column)
    for label, starts in (("first", result.first), ("second", result.second)):
        for name, s in starts.items():
            table.add_row(name, label, f"{s.ready_s:.1f}", f"{s.first_token_s:.1f}",
                          f"{s.peak_rss_bytes / 2**30:.2f}", f"{s.prefill_tok_s:.1f}", f"{s.decode_tok_s:.2f}")
    Console().print(table)
    if out is not None:
        out.write_text(json.dumps(asdict(result), indent=2))
