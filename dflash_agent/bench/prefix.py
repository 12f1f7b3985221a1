"""Prefix-cache benchmark: time to first token of an agent session's turns with and without KV reuse.

The session is shaped like a coding agent's: turn 1 is a system prompt, tool schemas, project notes and a
task (half the target length, as agents carry a large fixed prefix); every later turn appends the model's
tool call and the tool's result (real files, grep hits and listings from the installed Python standard
library), so the last prompt reaches the target length. Each turn's prompt is rendered by the model's chat
template, and both engines serve it on the same loaded weights, one after the other, so the two times
are measured under the same machine load. Their greedy outputs are compared as a check.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import statistics
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..chat.chat_format import ChatFormat
from ..chat.types import Conversation, Message, TextPart, Tool, ToolCall
from ..engine import Engine, FinalEvent, GenerateRequest, SpecConfig, TokenEvent, Tokenizer
from ..engine.cache.prefix_cache import PrefixCacheConfig
from ..errors import UserError

log = logging.getLogger(__name__)

DECODE_TOKENS = 8  # per turn: enough to see the first token; the session appends its own tool call
BASE_SHARE = 0.5  # of the target length, in turn 1

SYSTEM = """You are a coding agent working in the user's repository. You read code before changing it, \
make the smallest change that solves the task, and run the tests after every edit. Use the tools to \
inspect files, search the code, run commands and edit files; never guess at a file's contents. When a \
command fails, read its output and fix the cause rather than retrying blindly. Keep answers short: say \
what you changed and why. Do not add dependencies. Follow the project's style: type hints, small \
functions, docstrings on public functions, comments that explain why rather than what."""

TOOLS = [
    Tool("read_file", "Read a text file, optionally a range of lines.", {
        "type": "object",
        "properties": {"path": {"type": "string", "description": "Path relative to the repository root."},
                       "offset": {"type": "integer", "description": "First line (1-based)."},
                       "limit": {"type": "integer", "description": "Number of lines."}},
        "required": ["path"]}),
    Tool("grep", "Search file contents with a regular expression.", {
        "type": "object",
        "properties": {"pattern": {"type": "string"}, "path": {"type": "string"},
                       "glob": {"type": "string", "description": "Only files matching this glob."}},
        "required": ["pattern"]}),
    Tool("glob", "List files matching a glob pattern.", {
        "type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}),
    Tool("bash", "Run a shell command in the repository and return its output.", {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "integer", "description": "Seconds."}},
        "required": ["command"]}),
    Tool("edit_file", "Replace an exact string in a file.", {
        "type": "object",
        "properties": {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"},
                       "replace_all": {"type": "boolean"}},
        "required": ["path", "old", "new"]}),
    Tool("write_file", "Create or overwrite a file.", {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}),
]

TASK = ("json.loads is slow on large documents with many escaped strings. Find where strings are scanned, "
        "explain the cost, and propose a faster approach.")


@dataclass
class Turn:
    turn: int
    prompt_tokens: int
    ttft_ms_reuse: float
    ttft_ms_plain: float
    cache_n: int  # prompt tokens served from the cache (reuse engine)
    prompt_n: int  # prompt tokens prefilled (reuse engine)
    same_output: bool  # greedy outputs of both engines agree
    ratio: float = 0.0  # plain TTFT over reuse TTFT


@dataclass
class PrefixBenchResult:
    model: str
    turns: list[Turn]
    n_ctx: int
    decode_tokens: int
    later_turns_ttft_ratio_geomean: float = 0.0  # turns 2..N
    later_turns_ttft_ratio_total: float = 0.0  # summed plain TTFT over summed reuse TTFT, turns 2..N
    cached_share_all: float = 0.0  # cached prompt tokens over all prompt tokens, every turn
    cached_share_later: float = 0.0  # the same over turns 2..N
    cached_over_previous_prompt: float = 0.0  # turns 2..N, over the previous turn's prompt length (~ the most possible)
    cache_stats: dict = field(default_factory=dict)


def _stdlib(*parts: str) -> Path:
    return Path(sysconfig.get_paths()["stdlib"], *parts)


def _cut(tokenizer: Tokenizer, text: str, tokens: int, at_least: bool = False) -> str:
    """The longest run of whole lines of `text` within about `tokens` tokens (`at_least`: the shortest
    run of about `tokens` or more)."""
    kept, used = [], 0
    for line in text.splitlines(keepends=True):
        if used >= tokens or (not at_least and used + len(tokenizer.encode(line, add_bos=False)) > tokens):
            break
        used += len(tokenizer.encode(line, add_bos=False))
        kept.append(line)
    return "".join(kept)


def _grep(pattern: str, folder: Path) -> str:
    regex = re.compile(pattern)
    hits = []
    for path in sorted(folder.rglob("*.py")):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if regex.search(line):
                hits.append(f"{path.relative_to(folder.parent)}:{number}:{line.strip()}")
    return "\n".join(hits)


def _listing(folder: Path) -> str:
    return "\n".join(f"{p.stat().st_size:>8}  {p.relative_to(folder.parent)}" for p in sorted(folder.rglob("*.py")))


def _tool_turns() -> list[tuple[str, dict, str]]:
    """(tool, arguments, full result) of a plausible investigation, from real standard-library files."""
    json_dir = _stdlib("json")

    def read(*parts: str) -> str:
        return _stdlib(*parts).read_text(errors="replace")

    return [
        ("glob", {"pattern": "json/**/*.py"}, _listing(json_dir)),
        ("read_file", {"path": "json/decoder.py"}, read("json", "decoder.py")),
        ("grep", {"pattern": "scanstring|c_scanstring", "path": "json"}, _grep(r"scanstring", json_dir)),
        ("read_file", {"path": "json/scanner.py"}, read("json", "scanner.py")),
        ("grep", {"pattern": "def ", "path": "json"}, _grep(r"^\s*def ", json_dir)),
        ("read_file", {"path": "json/encoder.py"}, read("json", "encoder.py")),
        ("bash", {"command": "python -m json.tool --help"}, read("json", "tool.py")),
        ("read_file", {"path": "json/__init__.py"}, read("json", "__init__.py")),
        ("read_file", {"path": "re/_parser.py", "limit": 400}, read("re", "_parser.py")),
        ("read_file", {"path": "textwrap.py"}, read("textwrap.py")),
        ("read_file", {"path": "shlex.py"}, read("shlex.py")),
    ]


def build_session(chat: ChatFormat, turns: int, target_tokens: int) -> list[list[int]]:
    """The prompt ids of every turn; each one extends the previous turn's prompt."""
    tokenizer = chat.tokenizer
    tools = _tool_turns()
    if turns - 1 > len(tools):
        raise UserError(f"the session has at most {len(tools) + 1} turns")

    def render(messages: list[Message]) -> list[int]:
        return chat.prepare(Conversation(messages, TOOLS)).prompt_ids

    head = [Message("system", [TextPart(SYSTEM)])]
    fixed = len(render(head + [Message("user", [TextPart(TASK)])]))
    notes = _cut(tokenizer, _stdlib("json", "__init__.py").read_text() + _stdlib("textwrap.py").read_text(),
                 max(0, int(target_tokens * BASE_SHARE) - fixed))
    messages = head + [Message("user", [TextPart(f"Project notes:\n{notes}\n\nTask: {TASK}")])]
    prompts = [render(messages)]
    for turn in range(1, turns):
        # Each tool result takes an equal share of what is left to reach the target.
        share = (target_tokens - len(prompts[-1])) // (turns - turn)
        name, arguments, result = tools[turn - 1]
        call = ToolCall(f"call_{turn}", name, arguments)
        with_call = messages + [Message("assistant", tool_calls=[call])]
        overhead = len(render(with_call + [Message("tool", [TextPart("")], tool_call_id=call.id, name=name)]))
        # The last result reaches the target, so the session grows to at least `target_tokens`.
        content = _cut(tokenizer, result, max(16, share - (overhead - len(prompts[-1]))), at_least=turn == turns - 1)
        messages = with_call + [Message("tool", [TextPart(content)], tool_call_id=call.id, name=name)]
        prompts.append(render(messages))
    return prompts


def _first_token(engine: Engine, prompt: list[int]) -> tuple[float, list[int], FinalEvent]:
    """(ms to the first generated token, the output ids, the final event)."""
    first: list[float] = []

    def on_token(event: TokenEvent) -> None:
        if not first and event.ids:
            first.append(time.perf_counter())

    started = time.perf_counter()
    result = asyncio.run(engine.complete(GenerateRequest(prompt, max_tokens=DECODE_TOKENS), on_token))
    end = first[0] if first else time.perf_counter()
    return (end - started) * 1e3, result.ids, result.final


def run_prefix_bench(
    model: str, turns: int = 10, target_tokens: int = 8192, ctx_size: int | None = None, dtype: str = "float32",
    device: str = "auto",
) -> PrefixBenchResult:
    if ctx_size is not None and ctx_size <= target_tokens:
        raise UserError(f"--ctx-size {ctx_size} cannot hold a session growing to {target_tokens} tokens")
    base = Engine.load(model, device=device, dtype=dtype, ctx_size=16, prefix_cache=False,
                       spec=SpecConfig(enabled=False))  # only its model and tokenizer are used
    base.close()
    prompts = build_session(ChatFormat.for_engine(base), turns, target_tokens)
    needed = len(prompts[-1]) + DECODE_TOKENS + 1
    n_ctx = ctx_size or needed
    if n_ctx < needed:
        raise UserError(f"the session needs a context of {needed} tokens; --ctx-size is {n_ctx}")
    if n_ctx > base.model.config.max_position_embeddings:
        raise UserError(f"the session needs {n_ctx} tokens but {model} holds "
                        f"{base.model.config.max_position_embeddings}")
    log.info("session of %d turns, %d to %d prompt tokens, context %d", turns, len(prompts[0]), len(prompts[-1]),
             n_ctx)
    reuse = Engine(base.model, base.tokenizer, n_ctx, base.model_name, prefix_cache=PrefixCacheConfig())
    plain = Engine(base.model, base.tokenizer, n_ctx, base.model_name, prefix_cache=None)
    results: list[Turn] = []
    try:
        for number, prompt in enumerate(prompts, 1):
            ms_reuse, ids_reuse, final = _first_token(reuse, prompt)
            ms_plain, ids_plain, _ = _first_token(plain, prompt)
            turn = Turn(number, len(prompt), ms_reuse, ms_plain, final.timings.cache_n, final.timings.prompt_n,
                        ids_reuse == ids_plain, ms_plain / ms_reuse if ms_reuse else 0.0)
            results.append(turn)
            log.info("turn %d/%d: %d prompt tokens (%d cached): TTFT %.0f ms with reuse, %.0f ms without (%.1fx)",
                     number, len(prompts), turn.prompt_tokens, turn.cache_n, ms_reuse, ms_plain, turn.ratio)
        stats = asdict(reuse.prefix_stats) if reuse.prefix_stats is not None else {}
    finally:
        reuse.close()
        plain.close()
    later = results[1:]
    cacheable = sum(min(t.prompt_tokens, results[i].prompt_tokens) for i, t in enumerate(later))
    return PrefixBenchResult(
        model=base.model_name, turns=results, n_ctx=n_ctx, decode_tokens=DECODE_TOKENS,
        later_turns_ttft_ratio_geomean=statistics.geometric_mean([t.ratio for t in later]) if later else 0.0,
        later_turns_ttft_ratio_total=(sum(t.ttft_ms_plain for t in later) / sum(t.ttft_ms_reuse for t in later)
                                      if later else 0.0),
        cached_share_all=sum(t.cache_n for t in results) / sum(t.prompt_tokens for t in results),
        cached_share_later=(sum(t.cache_n for t in later) / sum(t.prompt_tokens for t in later)) if later else 0.0,
        cached_over_previous_prompt=sum(t.cache_n for t in later) / cacheable if cacheable else 0.0,
        cache_stats=stats,
    )


def report(result: PrefixBenchResult, out: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"prefix cache, {result.model}: time to first token per agent turn")
    for column in ("turn", "prompt tokens", "cached", "prefilled", "TTFT reuse ms", "TTFT plain ms", "x", "same"):
        table.add_column(column, justify="right")
    for t in result.turns:
        table.add_row(str(t.turn), str(t.prompt_tokens), str(t.cache_n), str(t.prompt_n), f"{t.ttft_ms_reuse:.0f}",
                      f"{t.ttft_ms_plain:.0f}", f"{t.ratio:.1f}", "yes" if t.same_output else "NO")
    console = Console(stderr=True)
    console.print(table)
    console.print(
        f"turns 2..{len(result.turns)}: TTFT {result.later_turns_ttft_ratio_geomean:.1f}x lower (geometric mean), "
        f"{result.later_turns_ttft_ratio_total:.1f}x in total; prompt tokens from the cache: "
        f"{result.cached_share_all:.1%} of all, {result.cached_share_later:.1%} of turns 2.., "
        f"{result.cached_over_previous_prompt:.1%} of the previous turns' prompts"
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(asdict(result), indent=2) + "\n")
        log.warning("wrote %s", out)
