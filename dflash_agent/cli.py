"""The `dflash-agent` command."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

import click

from .engine import GenerateRequest, SamplingParams, StopCriteria, TokenEvent
from .options import FiniteRange, close_engine, kv_cache_option, load_engine, model_options, user_errors


class LazyGroup(click.Group):
    """Commands that live in other layers are imported when run, so `generate` never loads a web server and
    `run --server` never loads torch; `--help` lists them from the one-line help kept here (each would import
    torch, a web server or the MCP SDK), which tests/test_cli_help.py holds to each command's own."""

    lazy = {
        "serve": ("dflash_agent.serve:serve",
                  "OpenAI- and Anthropic-compatible HTTP server (/v1/chat/completions, /v1/messages, ...), and MCP "
                  "(streamable HTTP) at /mcp."),
        "run": ("dflash_agent.agent.commands:run",
                "Run the coding agent on TASK in a repository: the model reads, edits and runs commands through "
                "sandboxed tools until it answers without a tool call or a limit runs out."),
        "chat": ("dflash_agent.agent.commands:chat",
                 "An interactive session with the coding agent: each message is a task, run with the same tools in "
                 "one growing conversation (so the model's prefix cache carries over)."),
        "mcp": ("dflash_agent.mcp.commands:mcp",
                "MCP server over stdio (what editors spawn): run_task (the coding agent, with a progress "
                "notification per step, cancellable), complete and chat (the local model), a status resource, and "
                "with --expose-tools the workspace tools. stdout carries the protocol; logs go to stderr."),
        "train-drafter": ("dflash_agent.train.commands:train_drafter",
                          "Train a DFlash drafter for a target (the DFlash recipe, on the target's own "
                          "continuations)."),
        "bench": ("dflash_agent.bench.commands:bench",
                  "Speed benchmarks, each measured against its baseline in the same run."),
        "connect": ("dflash_agent.connect:connect",
                    "Print (or --write) CLIENT's configuration for a running server, with the server's context and "
                    "output cap."),
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy and name not in self.commands:
            module, attr = self.lazy[name][0].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click.Group's listing, with the one-line help of a command not imported yet taken from `lazy`."""
        commands = [(name, self.commands.get(name)) for name in self.list_commands(ctx)]
        commands = [(name, command) for name, command in commands if command is None or not command.hidden]
        if not commands:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in commands)
        # a command not imported yet is listed as a bare command with its help, which click shortens alike
        rows = [(name, (command or click.Command(name, help=self.lazy[name][1])).get_short_help_str(limit))
                for name, command in commands]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup)
@click.version_option(package_name="dflash-agent")
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
@click.option("--temperature", type=FiniteRange(min=0), default=None,
              help="0 is greedy [default: the model's (--sampling-defaults), else 0].")
@click.option("--top-p", type=FiniteRange(0, 1, min_open=True), default=None,
              help="[default: the model's, else 1]")
@click.option("--top-k", type=click.IntRange(min=0), default=None, help="0 disables [default: the model's, else 0].")
@click.option("--min-p", type=FiniteRange(0, 1), default=None, help="[default: the model's, else 0]")
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@kv_cache_option
@user_errors
def generate(prompt, model, device, dtype, ctx_size, draft, draft_quant, draft_ctx, spec_block, no_spec, weights,
             prefill, threads, sampling_defaults, max_tokens, temperature, top_p, top_k, min_p, seed, stop, as_json,
             kv_cache):
    """Raw completion of PROMPT (no chat template), streamed to stdout."""
    started = time.perf_counter()
    engine = load_engine(model, device, dtype, ctx_size, draft, draft_quant, spec_block, no_spec, weights, threads,
                         progress=not as_json, kv_dtype=kv_cache, sampling_defaults=sampling_defaults, prefill=prefill,
                         draft_ctx=draft_ctx)
    load_ms = (time.perf_counter() - started) * 1e3
    request = GenerateRequest(
        prompt_ids=engine.tokenizer.encode(prompt, add_bos=True),
        # What an option leaves unset: the model's default, else greedy.
        sampling=engine.sampling_defaults.resolve(SamplingParams(), temperature, top_k, top_p, min_p, seed),
        stop=StopCriteria(strings=tuple(stop)),
        max_tokens=max_tokens,
    )
    try:
        result = asyncio.run(engine.complete(request, on_token=None if as_json else _write))
    finally:
        close_engine(engine)
    final = result.final
    if as_json:
        stats = {
            "model": engine.model_name,
            "device": str(engine.model.device),
            "dtype": str(engine.model.dtype).removeprefix("torch."),
            "n_ctx": engine.n_ctx,
            "load_ms": round(load_ms, 1),
            "draft_model": engine.drafter is not None,
            "sampling": asdict(request.sampling),
            "acceptance_length_mean": round(final.spec.acceptance_length_mean, 3),
            "spec_steps": final.spec.steps,
            "spec_by_source": {k: dict(zip(("steps", "drafted", "accepted"), v))
                               for k, v in final.spec.by_source.items()},
        }
        click.echo(json.dumps({
            "text": result.text,
            "token_ids": result.ids,
            "finish_reason": final.finish_reason,
            "timings": asdict(final.timings),
            "stats": stats,
        }, ensure_ascii=False))
    else:
        click.echo()


def _write(event: TokenEvent) -> None:
    sys.stdout.write(event.text_delta)
    sys.stdout.flush()


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
