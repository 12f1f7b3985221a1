"""The `dflash-agent` command."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import sys
import time
from dataclasses import asdict
from functools import wraps
from pathlib import Path

import click

from .bench.synthetic import MODELS as SYNTHETIC_MODELS
from .bench.synthetic import QUANTS as SYNTHETIC_QUANTS
from .engine.config import ConfigError
from .engine.drafter import DrafterError
from .engine.engine import Engine, FinalEvent, GenerateRequest
from .engine.model import ContextOverflowError
from .engine.quant import UnsupportedTensorType
from .engine.sampling import SamplingParams, StopCriteria
from .engine.speculative import SpecConfig
from .engine.tokenizer import TokenizerError
from .engine.weights import WEIGHTS, ModelLoadError, default_drafter

log = logging.getLogger("dflash_agent")

# Errors a user can cause and fix; anything else is a bug and keeps its traceback.
USER_ERRORS = (ModelLoadError, ConfigError, DrafterError, ContextOverflowError, UnsupportedTensorType, TokenizerError, ValueError,
               OSError)


def model_options(f):
    """Options shared by every command that loads a model."""
    f = click.option("--model", "-m", default="embedded", show_default=True,
                     help="'embedded', a .gguf file, a Hugging Face model directory, or a hub id.")(f)
    f = click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)(f)
    f = click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
                     show_default=True, help="auto: float32 on CPU, bfloat16 on CUDA.")(f)
    f = click.option("--ctx-size", type=click.IntRange(min=16), default=None,
                     help="Context length in tokens (default: 8192, capped by the model).")(f)
    f = click.option("--draft", default=None,
                     help="DFlash drafter: a z-lab checkpoint directory or hub id (speculative decoding).")(f)
    f = click.option("--draft-quant", type=click.Choice(["q8", "q4"]), default=None,
                     help="Quantize the drafter's weights at load (saves memory beside a large target).")(f)
    f = click.option("--spec-block", type=click.IntRange(2, 17), default=None,
                     help="Fixed speculative block size (anchor + drafts), e.g. for benchmarks; default adaptive.")(f)
    f = click.option("--no-spec", is_flag=True, help="Plain autoregressive decoding: no drafter, no prompt lookup.")(f)
    f = click.option("--weights", type=click.Choice(WEIGHTS), default="packed", show_default=True,
                     help="GGUF weights: packed (Triton kernels on CUDA, int4/int8 kernels on the CPU: fast) or "
                          "exact (dequantized at load: bit-exact with gguf-py, slower).")(f)
    f = click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="CPU threads [default: the physical cores].")(f)
    return f


kv_cache_option = click.option(
    "--kv-cache", type=click.Choice(["auto", "q8"]), default="auto", show_default=True,
    help="KV cache storage: auto (the model's dtype) or q8 (8-bit, about half the memory: longer contexts).")


def load_engine(model, device, dtype, ctx_size, draft, draft_quant, spec_block, no_spec, weights="packed",
                threads=None, progress=True, **engine_options) -> Engine:
    """The engine a command's model options describe; `engine_options` go to `Engine.load` as they are."""
    if no_spec and (draft or spec_block):
        raise click.UsageError("--no-spec cannot be combined with --draft or --spec-block")
    spec = SpecConfig(enabled=not no_spec, block=spec_block)
    return Engine.load(model=model, draft=draft, device=device, dtype=dtype, ctx_size=ctx_size, progress=progress,
                       spec=spec, draft_quant=draft_quant, weights=weights, threads=threads, **engine_options)


def user_errors(f):
    """One line on stderr and exit 1 for a user's mistake; the traceback only with --verbose."""

    @wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except USER_ERRORS as exc:
            if logging.getLogger().isEnabledFor(logging.DEBUG):
                raise
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)

    return wrapper


class LazyGroup(click.Group):
    """Commands that live in other layers are imported when run, so `generate` never loads a web server."""

    lazy = {
        "serve": "dflash_agent.api.serve:serve",
        "run": "dflash_agent.agent.commands:run",
        "chat": "dflash_agent.agent.commands:chat",
        "mcp": "dflash_agent.mcp.commands:mcp",
        "train-drafter": "dflash_agent.train.commands:train_drafter",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy and name not in self.commands:
            module, attr = self.lazy[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup)
@click.option("--verbose", "-v", is_flag=True, help="Debug logs and full tracebacks.")
def main(verbose: bool) -> None:
    """dflash-agent: a local Gemma backend for coding agents."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@main.command()
@click.argument("prompt")
@model_options
@click.option("--max-tokens", "-n", type=click.IntRange(min=0), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 disables.")
@click.option("--min-p", type=click.FloatRange(0, 1), default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@kv_cache_option
@user_errors
def generate(prompt, model, device, dtype, ctx_size, draft, draft_quant, spec_block, no_spec, weights, threads,
             max_tokens, temperature, top_p, top_k, min_p, seed, stop, as_json, kv_cache):
    """Raw completion of PROMPT (no chat template), streamed to stdout."""
    started = time.perf_counter()
    engine = load_engine(model, device, dtype, ctx_size, draft, draft_quant, spec_block, no_spec, weights, threads,
                         progress=not as_json, kv_dtype=kv_cache)
    load_ms = (time.perf_counter() - started) * 1e3
    request = GenerateRequest(
        prompt_ids=engine.tokenizer.encode(prompt, add_bos=True),
        sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed),
        stop=StopCriteria(strings=tuple(stop)),
        max_tokens=max_tokens,
    )
    text, ids, final = asyncio.run(_collect(engine, request, stream=not as_json))
    engine.close()
    if as_json:
        stats = {
            "model": engine.model_name,
            "device": str(engine.model.device),
            "dtype": str(engine.model.dtype).removeprefix("torch."),
            "n_ctx": engine.n_ctx,
            "load_ms": round(load_ms, 1),
            "draft_model": engine.drafter is not None,
            "acceptance_length_mean": round(final.spec.acceptance_length_mean, 3),
            "spec_steps": final.spec.steps,
            "spec_by_source": {k: dict(zip(("steps", "drafted", "accepted"), v))
                               for k, v in final.spec.by_source.items()},
        }
        click.echo(json.dumps({
            "text": text,
            "token_ids": ids,
            "finish_reason": final.finish_reason,
            "timings": asdict(final.timings),
            "stats": stats,
        }, ensure_ascii=False))
    else:
        click.echo()


async def _collect(engine: Engine, request: GenerateRequest, stream: bool) -> tuple[str, list[int], FinalEvent]:
    parts: list[str] = []
    ids: list[int] = []
    async for event in engine.generate(request):
        if isinstance(event, FinalEvent):
            return "".join(parts), ids, event
        parts.append(event.text_delta)
        ids.extend(event.ids)
        if stream:
            sys.stdout.write(event.text_delta)
            sys.stdout.flush()
    raise RuntimeError("the engine ended a stream without a final event")


@main.command()
@click.option("--model", "-m", default="embedded", show_default=True, help="The model every engine runs.")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--decode-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Weights and activations of both engines.")
@click.option("--spec", is_flag=True,
              help="Speculative decoding instead: plain vs prompt lookup vs DFlash vs hybrid, tok/s and acceptance.")
@click.option("--draft", default=None, help="With --spec: a drafter checkpoint, or 'random' for an untrained one "
              "[default: the model's bundled drafter].")
@click.option("--spec-block", type=click.IntRange(2, 17), default=None, help="With --spec: a fixed block size.")
@click.option("--llama-cpp", "llama_cpp", default=None, metavar="DIR",
              help="The CPU bench's llama.cpp column: a directory with llama-bench [default: $LLAMA_CPP_BIN, PATH].")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads [default: the physical cores].")
@click.option("--fidelity", is_flag=True,
              help="Packed CPU weights against exact ones instead: teacher-forced top-1 agreement and KL.")
@click.option("--http", is_flag=True, help="Server overhead instead: streamed tok/s through HTTP vs the bare engine.")
@click.option("--synthetic", type=click.Choice(SYNTHETIC_MODELS), default=None,
              help="The GPU path at these real shapes with random weights: decode vs roofline, verify, drafter.")
@click.option("--quant", type=click.Choice(SYNTHETIC_QUANTS), default=None, help="With --synthetic [Q4_0].")
@click.option("--prefix", is_flag=True,
              help="Prefix cache instead: time to first token per turn of an agent session, with and without reuse.")
@click.option("--turns", type=click.IntRange(2, 12), default=None, help="With --prefix: session turns [10].")
@click.option("--target-tokens", type=click.IntRange(min=256), default=None,
              help="With --prefix: the last turn's prompt length [8192].")
@click.option("--ctx-size", type=click.IntRange(min=16), default=None,
              help="With --synthetic: the cache [32768]; with --prefix: the engines' context [what the session needs].")
@click.option("--plan-only", is_flag=True, help="With --synthetic: print the memory plan; no GPU needed.")
@click.option("--gpu-memory", default=None, help="With --plan-only: the memory to plan for, e.g. 24GiB.")
@click.option("--json", "as_json", is_flag=True, help="With --synthetic: print JSON.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the JSON result [default: bench-results/cpu.json, spec.json, http.json, "
                   "prefix.json].")
@user_errors
def bench(model, prompt_tokens, decode_tokens, repeats, dtype, spec, draft, spec_block, llama_cpp, threads, fidelity,
          http, synthetic, quant, prefix, turns, target_tokens, ctx_size, plan_only, gpu_memory, as_json, out):
    """Speed benchmarks, each measured against its baseline in the same run.

    By default: prefill and decode tok/s of this engine and of transformers on the CPU."""
    logging.getLogger("dflash_agent").setLevel(min(logging.getLogger().level, logging.INFO))
    if fidelity:
        from .bench.fidelity import report as fidelity_report
        from .bench.fidelity import run_fidelity

        fidelity_report(run_fidelity(model, 1024), out or Path("bench-results/fidelity.json"))
        return
    if prefix:
        if spec or draft or spec_block or http or synthetic or quant or plan_only or gpu_memory or as_json:
            raise click.UsageError("--prefix takes only --model, --dtype, --turns, --target-tokens, --ctx-size, --out")
        from .bench.prefix import report as prefix_report
        from .bench.prefix import run_prefix_bench

        prefix_report(run_prefix_bench(model, turns or 10, target_tokens or 8192, ctx_size, dtype),
                      out or Path("bench-results/prefix.json"))
        return
    if turns or target_tokens:
        raise click.UsageError("--turns and --target-tokens need --prefix")
    if synthetic or quant or ctx_size or plan_only or gpu_memory or as_json:
        from .bench.synthetic import command as synthetic_command

        click.echo(synthetic_command(synthetic, quant, ctx_size, plan_only, gpu_memory, as_json, out))
        return
    if http:
        from .bench.http import report as http_report
        from .bench.http import run_http_bench

        http_report(run_http_bench(model, prompt_tokens, decode_tokens, repeats, dtype),
                    out or Path("bench-results/http.json"))
        return
    if spec:
        from .bench.spec import report as spec_report
        from .bench.spec import run_spec_bench

        if draft is None and (bundled := default_drafter(model)) is not None:
            draft = str(bundled)
        results = run_spec_bench(model, draft, prompt_tokens, decode_tokens, repeats, spec_block, dtype=dtype)
        title = f"speculative decoding, {model}, draft={draft or 'none'}, block={spec_block or 'adaptive'}"
        spec_report(results, out or Path("bench-results/spec.json"), title)
        return
    if draft or spec_block:
        raise click.UsageError("--draft and --spec-block need --spec")
    from .bench.cpu import report, run_cpu_bench

    report(run_cpu_bench(model, prompt_tokens, decode_tokens, repeats, dtype, llama_cpp, threads),
           out or Path("bench-results/cpu.json"))


@main.command()
@click.option("--messages", "messages_file", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="OpenAI-style messages: a JSON list, or an object with 'messages' (and 'tools').")
@click.option("--tools", "tools_file", type=click.Path(dir_okay=False, path_type=Path),
              help="OpenAI-style tools: a JSON list, or an object with 'tools'.")
@click.option("--template", default=None, help="gemma4, gemma3 or a .jinja file (default: the model's own).")
@click.option("--model", "-m", default="embedded", show_default=True,
              help="Whose tokenizer and template to use; its weights are not loaded.")
@click.option("--enable-thinking", is_flag=True, help="Render with thinking on (Gemma 4).")
@click.option("--no-generation-prompt", is_flag=True, help="Do not open the model's turn at the end.")
@click.option("--json", "as_json", is_flag=True, help='Print {"prompt": ..., "token_ids": [...]}.')
@user_errors
def prompt(messages_file, tools_file, template, model, enable_thinking, no_generation_prompt, as_json):
    """Print the prompt a chat request renders to, exactly as the model would read it."""
    from .chat.prompt import prompt_command

    out = prompt_command(messages_file, tools_file, template, model, enable_thinking, not no_generation_prompt,
                         as_json)
    # The prompt is printed byte for byte; only the JSON form gets a newline.
    click.echo(out, nl=as_json)
