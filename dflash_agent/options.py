"""Options and error handling shared by the commands that load a model (generate, serve, run, chat, mcp, ...).

Every command module imports these from here; nothing but `__main__` imports `cli`."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import traceback
from functools import wraps
from importlib.metadata import PackageNotFoundError, metadata
from typing import TYPE_CHECKING

import click

from .engine.types import PREFILL, SAMPLING_DEFAULTS, WEIGHTS
from .errors import UserError

if TYPE_CHECKING:
    from .engine import Engine

# Errors a user can cause and fix (every engine, chat, tools and training error is a UserError; a missing or
# unreadable file an OSError); anything else is a bug and keeps its traceback.
log = logging.getLogger(__name__)

USER_ERRORS = (UserError, OSError)
INTERRUPTED = 128 + signal.SIGINT  # the exit code of a command Ctrl-C ended, as shells report it


class FiniteRange(click.FloatRange):
    """click's FloatRange without nan and inf: nan passes its bounds (it compares false with both), inf a
    bound on one side only."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def model_options(f):
    """Options shared by every command that loads a model."""
    f = click.option("--model", "-m", default="embedded", show_default=True,
                     help="'embedded', a .gguf file, a Hugging Face model directory, or a hub id.")(f)
    f = click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)(f)
    f = click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
                     show_default=True, help="auto: float32 on CPU, bfloat16 on CUDA.")(f)
    f = click.option("--ctx-size", type=click.IntRange(min=16), default=None,
                     help="Context length in tokens (default: the model's own where memory holds it, else the "
                          "largest that fits).")(f)
    f = click.option("--draft", default=None,
                     help="Drafter for speculative decoding: a z-lab DFlash checkpoint directory or hub id, or a "
                          "Gemma 4 assistant (MTP) checkpoint.")(f)
    f = click.option("--draft-quant", type=click.Choice(["q8", "q4"]), default=None,
                     help="Quantize the drafter's weights at load (saves memory beside a large target).")(f)
    f = click.option("--draft-ctx", type=click.IntRange(min=16), default=None, metavar="N",
                     help="The DFlash drafter reads at most the last N tokens of the context (its cache stops growing "
                          "with it: long sessions on a small card) [default: the whole context].")(f)
    f = click.option("--spec-block", type=click.IntRange(2, 17), default=None,
                     help="Fixed speculative block size (anchor + drafts), e.g. for benchmarks; default adaptive.")(f)
    f = click.option("--no-spec", is_flag=True, help="Plain autoregressive decoding: no drafter, no prompt lookup.")(f)
    f = click.option("--weights", type=click.Choice(WEIGHTS), default="auto", show_default=True,
                     help="GGUF weights: auto (packed: Triton kernels on CUDA, C kernels built with the system's cc "
                          "on the CPU, else exact), packed (torch's int4/int8 kernels on a CPU without a compiler) or "
                          "exact (dequantized at load: bit-exact with gguf-py).")(f)
    f = click.option("--prefill", type=click.Choice(PREFILL), default="auto", show_default=True,
                     help="Prompt GEMMs on the CPU C kernels' path: float32 (exact on the dequantized weights), "
                          "int8 (activations quantized per block of 32 against the weights' own integers, each row's "
                          "largest channels in float32: about 2x float32's GEMMs with AVX-512 VNNI) or bfloat16 "
                          "(2-3x faster where the CPU has AVX512_BF16 or AMX); `bench --fidelity` reports their top-1 "
                          "agreement with exact; auto: bfloat16 where the CPU multiplies it natively and it measures "
                          "faster than float32 at load (1.2x; 2x where int8 runs), else int8 where the VNNI kernels "
                          "run, else float32.")(f)
    f = click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="CPU threads [default: the physical cores].")(f)
    f = click.option("--sampling-defaults", type=click.Choice(SAMPLING_DEFAULTS), default="model", show_default=True,
                     help="What a request leaves unset (temperature, top-k, top-p, min-p) takes: model = the "
                          "checkpoint's recommendation (generation_config.json, GGUF general.sampling.*) where it "
                          "has one; none = the interface's own (temperature 1 over HTTP, greedy in the CLI).")(f)
    return f


kv_cache_option = click.option(
    "--kv-cache", type=click.Choice(["auto", "model", "q8"]), default="auto", show_default=True,
    help="KV cache storage: model (the model's dtype), q8 (8-bit, about half the memory: longer contexts) or auto "
         "(on a GPU the model's where the context fits, else q8 where that holds more; on the CPU the model's).")


def sandbox_options(f):
    """How the tools' processes are confined (tools/sandbox.py); the commands with workspace tools take these."""
    f = click.option("--sandbox-network/--no-sandbox-network", default=True, show_default=True,
                     help="Whether sandboxed bash commands may use the network (pip install, git fetch).")(f)
    f = click.option("--sandbox", type=click.Choice(["auto", "bwrap", "off"]), default="auto", show_default=True,
                     help="Run the tools' commands (bash, grep's helper) under bubblewrap: in their own PID namespace "
                          "(the server's processes and keys out of sight, nothing a command starts outlives it), the "
                          "filesystem read-only but the workspace and a private /tmp. auto: bwrap where it can start, "
                          "else one warning and no sandbox; bwrap: refuse to run commands without it; off: none.")(f)
    return f


def server_api_key() -> str | None:
    """The key `--server URL` sends a running server: DFLASH_AGENT_API_KEY, else OPENAI_API_KEY."""
    return os.environ.get("DFLASH_AGENT_API_KEY") or os.environ.get("OPENAI_API_KEY")


def check_spec_options(no_spec: bool, draft: str | None, spec_block: int | None, draft_ctx: int | None = None) -> None:
    """Also called before the load by the commands that load in the background (`serve`, `mcp`), so the mistake
    is told at once."""
    if no_spec and (draft or spec_block or draft_ctx):
        raise click.UsageError("--no-spec cannot be combined with --draft, --draft-ctx or --spec-block")


def load_engine(model, device, dtype, ctx_size, draft, draft_quant, spec_block, no_spec, weights="auto",
                threads=None, progress=True, **engine_options) -> Engine:
    """The engine a command's model options describe; `engine_options` are EngineConfig's other fields, as they
    are. The config is checked (OptionError) before torch loads."""
    check_spec_options(no_spec, draft, spec_block, engine_options.get("draft_ctx"))
    from .engine import EMBEDDED, EngineConfig, SpecConfig

    spec = SpecConfig(enabled=not no_spec, block=spec_block)
    config = EngineConfig(model=model, draft=draft, device=device, dtype=dtype, ctx_size=ctx_size, progress=progress,
                          spec=spec, draft_quant=draft_quant, weights=weights, threads=threads, **engine_options)
    if progress:  # at once: torch's import alone takes seconds, and a big file's load minutes
        what = f"{'the embedded model' if model == EMBEDDED else model}{f' with the drafter {draft}' if draft else ''}"
        log.info("loading %s", what)  # a server's log
        if not log.isEnabledFor(logging.INFO) and sys.stderr.isatty():  # a terminal, beside the load's progress bar
            click.echo(f"loading {what}...", err=True)
    from .engine import Engine  # here, not at the top: a remote-only command never loads torch

    return Engine.from_config(config)


def close_engine(engine: Engine) -> None:
    """Stop `engine`'s worker before the command ends (Engine.close: a process that ends under a running step
    aborts). After Ctrl-C the step in flight (a prompt chunk: seconds on a slow CPU) is waited for, and the user
    told so; Ctrl-C again (or SIGTERM, SIGHUP) ends the process at once."""
    try:
        if engine.close(timeout=1.0):
            return
        with contextlib.suppress(OSError):  # a terminal that hung up
            click.echo("waiting for the model to finish its current step (Ctrl-C again quits at once)", err=True)
        engine.close()
    except (KeyboardInterrupt, SystemExit) as stop:
        code = stop.code if isinstance(stop, SystemExit) and isinstance(stop.code, int) else INTERRUPTED
        with contextlib.suppress(OSError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)  # not through the interpreter's exit: that finalizes torch under the step


def user_errors(f):
    """A command's failures, told apart: a user's mistake is one line on stderr (its traceback only with
    --verbose), a bug its traceback and a line asking to report it; both exit 1. Ctrl-C outside what a command
    handles itself (loading a model) exits 130."""

    @wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except (click.exceptions.ClickException, click.exceptions.Abort, click.exceptions.Exit):
            raise  # click's own: usage errors and exits it prints itself
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(INTERRUPTED)
        except Exception as exc:
            report_error(exc)
            sys.exit(1)

    wrapper.reports_errors = True  # tests/test_cli_errors.py checks every command has it
    return wrapper


def report_error(exc: BaseException) -> None:
    """Print `exc` on stderr as the user should see it (see `user_errors`)."""
    if isinstance(exc, click.ClickException):  # raised off click's own path (a background load)
        click.echo(f"error: {exc.format_message()}", err=True)
        return
    if isinstance(exc, USER_ERRORS) and not logging.getLogger().isEnabledFor(logging.DEBUG):
        click.echo(f"error: {exc}", err=True)
        return
    traceback.print_exception(exc)
    if not isinstance(exc, USER_ERRORS):
        click.echo(f"error: this is a bug in dflash-agent, not something you did; please report it {_report_to()} "
                   "with the traceback above and the command you ran.", err=True)


def _report_to() -> str:
    """Where bugs go: the project's URL from its metadata (pyproject's [project.urls]) where it has one."""
    try:
        urls = metadata("dflash-agent").get_all("Project-URL") or []
    except PackageNotFoundError:
        urls = []
    found = dict(url.split(", ", 1) for url in urls if ", " in url)
    url = next((found[k] for k in ("Issues", "Bug Tracker", "Homepage", "Repository", "Source") if k in found),
               next(iter(found.values()), None))
    return f"at {url}" if url else "to the dflash-agent maintainers"
