"""`dflash-agent bench`: each benchmark measured against its baseline in the same run."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from ..engine import default_drafter
from ..engine.types import PREFILL
from ..options import user_errors
from .synthetic import MODELS as SYNTHETIC_MODELS
from .synthetic import QUANTS as SYNTHETIC_QUANTS


def counts(text: str, option: str, what: str) -> tuple[int, ...]:
    """A comma-separated list of whole numbers, sorted without repeats (a usage error names `what` it should be)."""
    try:
        return tuple(sorted({int(n) for n in text.split(",")}))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of {what}", param_hint=option) from None


@click.command()
@click.option("--model", "-m", default="embedded", show_default=True, help="The model every engine runs.")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--decode-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Weights and activations of both engines.")
@click.option("--spec", is_flag=True,
              help="Speculative decoding instead: plain vs prompt lookup vs DFlash vs hybrid, and llama-server's "
                   "n-gram modes (--llama-cpp DIR): tok/s and acceptance.")
@click.option("--draft", default=None, help="With --spec: a drafter checkpoint, or 'random' for an untrained one "
              "[default: the model's bundled drafter].")
@click.option("--spec-block", type=click.IntRange(2, 17), default=None, help="With --spec: a fixed block size.")
@click.option("--depth", default=None, metavar="N,N,...",
              help="With --spec: depth rows instead of the workloads (e.g. 1024,8192,32768): at each context length "
                   "tok/s and acceptance, the drafter over the whole context against --draft-ctx, and the step times.")
@click.option("--draft-ctx", type=click.IntRange(min=16), default=None,
              help="With --spec --depth: the drafter's bounded window [2048].")
@click.option("--llama-cpp", "llama_cpp", default=None, metavar="DIR",
              help="The llama.cpp column: a directory with llama-bench (CPU bench) or llama-server (--concurrent, "
                   "--spec) [default: $LLAMA_CPP_BIN, PATH].")
@click.option("--server", default=None, metavar="URL",
              help="With --concurrent: also measure this running OpenAI-compatible server (vLLM, SGLang, a cluster) "
                   "on the same prompts, beside ours, sending it DFLASH_AGENT_API_KEY (else OPENAI_API_KEY) as its "
                   "key.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads [default: the physical cores].")
@click.option("--prefill", type=click.Choice(PREFILL), default="auto", show_default=True,
              help="The packed engine's prompt GEMMs on the CPU (as the model commands' --prefill), for the default "
                   "bench and --fidelity.")
@click.option("--fidelity", is_flag=True,
              help="Packed CPU weights against exact ones instead: teacher-forced top-1 agreement and KL.")
@click.option("--http", is_flag=True, help="Server overhead instead: streamed tok/s through HTTP vs the bare engine.")
@click.option("--synthetic", type=click.Choice(SYNTHETIC_MODELS), default=None,
              help="The GPU path at these real shapes with random weights: decode vs roofline, verify, drafter.")
@click.option("--quant", type=click.Choice(SYNTHETIC_QUANTS), default=None, help="With --synthetic [Q4_0].")
@click.option("--gpu-check", is_flag=True,
              help="On a machine with a GPU: the CUDA tests compiled for it and the synthetic gemma4-31b benchmark, "
                   "one table (bench-results/gpu-check.json); exit 1 if a step fails.")
@click.option("--kernels", is_flag=True,
              help="Compile report instead (no GPU needed): registers, spills and shared memory of every Triton "
                   "launch for gemma4-31b on sm_86/89/90/120, against the budgets; exit 1 if one is broken.")
@click.option("--concurrent", default=None, metavar="N,N,...",
              help="Concurrent streams instead (e.g. 1,2,4,8): aggregate and per-stream tok/s, and the first-token "
                   "time of a short request arriving during a long prefill, for serve --parallel and llama-server -np "
                   "(--llama-cpp DIR).")
@click.option("--prefix", is_flag=True,
              help="Prefix cache instead: time to first token per turn of an agent session, with and without reuse.")
@click.option("--turns", type=click.IntRange(2, 12), default=None, help="With --prefix: session turns [10].")
@click.option("--target-tokens", type=click.IntRange(min=256), default=None,
              help="With --prefix: the last turn's prompt length [8192].")
@click.option("--ctx-size", type=click.IntRange(min=16), default=None,
              help="With --synthetic: the cache [32768]; with --prefix: the engines' context [what the session needs]; "
                   "with --startup: the servers' [4096].")
@click.option("--plan-only", is_flag=True, help="With --synthetic: print the memory plan; no GPU needed.")
@click.option("--gpu-memory", default=None, help="With --plan-only: the memory to plan for, e.g. 24GiB.")
@click.option("--json", "as_json", is_flag=True, help="With --synthetic or --kernels: print JSON.")
@click.option("--startup", is_flag=True,
              help="A GGUF's start as a user meets it, against llama-server on the same file, alternating: seconds to "
                   "ready and to a first token, peak RSS, prefill and decode tok/s, first start (page cache dropped) "
                   "and later ones.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the JSON result [default: bench-results/cpu.json, spec.json, http.json, "
                   "prefix.json, kernels.json, startup.json].")
@user_errors
def bench(model, prompt_tokens, decode_tokens, repeats, dtype, spec, draft, spec_block, depth, draft_ctx, llama_cpp,
          server, threads,
          prefill, fidelity, http, synthetic, quant, gpu_check, kernels, concurrent, prefix, turns, target_tokens,
          ctx_size, plan_only, gpu_memory, as_json, startup, out):
    """Speed benchmarks, each measured against its baseline in the same run.

    By default: prefill and decode tok/s of this engine and of transformers on the CPU."""
    logging.getLogger("dflash_agent").setLevel(min(logging.getLogger().level, logging.INFO))
    if (depth or draft_ctx) and not spec:
        raise click.UsageError("--depth and --draft-ctx go with --spec")
    if draft_ctx and not depth:
        raise click.UsageError("--draft-ctx goes with --spec --depth (the bounded window its rows compare)")
    if gpu_check:
        if spec or draft or spec_block or http or synthetic or quant or kernels or prefix or fidelity or ctx_size \
                or plan_only or gpu_memory or as_json:
            raise click.UsageError("--gpu-check takes only --out")
        from .gpu_check import run_gpu_check

        text, passed = run_gpu_check(out or Path("bench-results/gpu-check.json"))
        click.echo(text)
        if not passed:
            sys.exit(1)
        return
    if fidelity:
        from .fidelity import report as fidelity_report
        from .fidelity import run_fidelity

        fidelity_report(run_fidelity(model, 1024, prefill), out or Path("bench-results/fidelity.json"))
        return
    if kernels:
        if spec or draft or spec_block or http or synthetic or quant or prefix or turns or target_tokens or ctx_size \
                or plan_only or gpu_memory:
            raise click.UsageError("--kernels takes only --json and --out")
        from .kernels import command as kernels_command

        text, within_budgets = kernels_command(out, as_json)
        click.echo(text)
        if not within_budgets:
            sys.exit(1)
        return
    if startup:
        if spec or draft or spec_block or http or synthetic or quant or kernels or prefix or fidelity or plan_only \
                or gpu_memory or as_json or concurrent is not None:
            raise click.UsageError("--startup takes only --model, --repeats, --decode-tokens, --ctx-size, --threads, "
                                   "--llama-cpp and --out")
        from ..engine.load.weights import resolve_model_path
        from .cpu import llama_cpp_binary
        from .startup import report as startup_report
        from .startup import run_startup_bench

        startup_report(run_startup_bench(str(resolve_model_path(model)), llama_cpp_binary(llama_cpp, "llama-server"),
                                         repeats, threads or 2, ctx_size or 4096, decode_tokens),
                       out or Path("bench-results/startup.json"))
        return
    if concurrent is not None:
        if spec or draft or spec_block or http or synthetic or quant or kernels or prefix or fidelity or plan_only \
                or gpu_memory or as_json:
            raise click.UsageError("--concurrent takes only --model, --decode-tokens, --repeats, --llama-cpp, "
                                   "--server, --threads and --out")
        streams = counts(concurrent, "--concurrent", "stream counts like 1,2,4,8")
        if not streams or streams[0] < 1 or streams[-1] > 64:
            raise click.BadParameter("stream counts go from 1 to 64", param_hint="--concurrent")
        from .concurrent import report as concurrent_report
        from .concurrent import run_concurrent_bench

        concurrent_report(run_concurrent_bench(model, streams, decode_tokens, repeats, llama_cpp, threads, server),
                          out or Path("bench-results/concurrent.json"))
        return
    if server is not None:
        raise click.UsageError("--server needs --concurrent")
    if prefix:
        if spec or draft or spec_block or http or synthetic or quant or plan_only or gpu_memory or as_json:
            raise click.UsageError("--prefix takes only --model, --dtype, --turns, --target-tokens, --ctx-size, --out")
        from .prefix import report as prefix_report
        from .prefix import run_prefix_bench

        prefix_report(run_prefix_bench(model, turns or 10, target_tokens or 8192, ctx_size, dtype),
                      out or Path("bench-results/prefix.json"))
        return
    if turns or target_tokens:
        raise click.UsageError("--turns and --target-tokens need --prefix")
    if synthetic or quant or ctx_size or plan_only or gpu_memory or as_json:
        from .synthetic import command as synthetic_command

        click.echo(synthetic_command(synthetic, quant, ctx_size, plan_only, gpu_memory, as_json, out))
        return
    if http:
        from .http import report as http_report
        from .http import run_http_bench

        http_report(run_http_bench(model, prompt_tokens, decode_tokens, repeats, dtype),
                    out or Path("bench-results/http.json"))
        return
    if spec:
        from .spec import report as spec_report
        from .spec import run_spec_bench

        if draft is None and (bundled := default_drafter(model)) is not None:
            draft = str(bundled)
        if depth:
            from .spec import DEPTH_DRAFT_CTX, depth_report, run_depth_bench

            if draft is None or draft == "random":
                raise click.UsageError("--depth measures a drafter: --draft names a trained one (this model has no "
                                       "bundled one)")
            depths = counts(depth, "--depth", "context lengths like 1024,8192,32768")
            if not depths or depths[0] < 16:
                raise click.BadParameter("depths are context lengths of at least 16 tokens", param_hint="--depth")
            window = draft_ctx or DEPTH_DRAFT_CTX
            results, depth_costs = run_depth_bench(model, draft, depths, decode_tokens, repeats, window, spec_block,
                                                   dtype=dtype, threads=threads)
            depth_report(results, depth_costs, out or Path("bench-results/spec-depth.json"),
                         f"speculation at depth, {model}, draft={draft}, draft-ctx {window}")
            return
        results, costs = run_spec_bench(model, draft, prompt_tokens, decode_tokens, repeats, spec_block, dtype=dtype,
                                        llama_cpp=llama_cpp, threads=threads)
        title = f"speculative decoding, {model}, draft={draft or 'none'}, block={spec_block or 'adaptive'}"
        spec_report(results, costs, out or Path("bench-results/spec.json"), title)
        return
    if draft or spec_block:
        raise click.UsageError("--draft and --spec-block need --spec")
    from .cpu import report, run_cpu_bench

    report(run_cpu_bench(model, prompt_tokens, decode_tokens, repeats, dtype, llama_cpp, threads, prefill),
           out or Path("bench-results/cpu.json"))
