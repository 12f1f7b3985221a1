"""bench --spec's pieces that are not timings alone: the copy workloads, the verification cost table, the llama.cpp
column."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dflash_agent.bench.spec import (
    DEFAULT_MODE,
    LLAMA_MODES,
    ModeResult,
    depth_prompt,
    llama_run,
    llama_servers,
    module_prompt,
    patch_prompt,
    quote_prompt,
    verify_costs,
    versus_llama,
)
from dflash_agent.cli import main
from dflash_agent.engine import Engine, SpecConfig
from dflash_agent.errors import UserError


@pytest.fixture(scope="module")
def engine():
    loaded = Engine.load("embedded", ctx_size=1024, spec=SpecConfig(enabled=False), progress=False)
    yield loaded
    loaded.close()


def test_the_depth_prompt_is_code_that_does_not_repeat(engine):
    prompt = depth_prompt(engine, 30000)  # past argparse, the first module
    assert len(prompt) == 30000 and prompt[:1000] == depth_prompt(engine, 1000)
    text = engine.tokenizer.decode(prompt)
    assert text.count("<bos>") == 1 and text.count("class ArgumentParser(") == 1
    assert "def dataclass(" in text or "class FrozenInstanceError" in text  # the next module follows
    with pytest.raises(UserError, match="fewer than"):
        depth_prompt(engine, 10**7)


@pytest.mark.parametrize(("args", "message"), [
    (["--depth", "1024"], "--depth and --draft-ctx go with --spec"),
    (["--spec", "--draft-ctx", "512"], "--draft-ctx goes with --spec --depth"),
    (["--spec", "--depth", "1k,8k"], "is not a list of context lengths"),
    (["--spec", "--depth", "8"], "at least 16 tokens"),
    (["--spec", "--depth", "1024", "--draft", "random"], "--depth measures a drafter"),
])
def test_depth_options_are_checked_before_anything_loads(args, message):
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_the_module_workload_asks_for_a_copy_of_the_module(engine):
    prompt = module_prompt(engine, 300)
    assert 100 < len(prompt) <= 300
    text = engine.tokenizer.decode(prompt).removeprefix("<bos>")
    original, _, copy = text.partition("# textwrap.py, with a comment added at the top\n")
    assert copy == '# Wrapping text.\n"""Text wrapping and filling.\n'  # the module's first line, to go on from
    assert original.startswith("# textwrap.py\n") and '"""Text wrapping and filling.' in original


def test_verification_costs_are_measured_against_a_one_row_step(engine):
    prompt = engine.tokenizer.encode("def f(x):\n    return x + 1\n" * 8)
    costs = verify_costs(engine, prompt, rows=(1, 4, 20), repeats=2)
    assert [c.rows for c in costs] == [1, 4, 20]
    assert costs[0].vs_one_row == pytest.approx(1.0) and all(c.ms > 0 for c in costs)
    assert costs[0].greedy_vs_one_row == pytest.approx(1.0) and all(c.greedy_ms > 0 for c in costs)
    assert costs[2].ms > costs[0].ms  # twenty rows of logits cost more than one


def test_the_patch_and_quote_workloads_end_where_the_copy_begins(engine):
    patch = engine.tokenizer.decode(patch_prompt(engine, 400)).removeprefix("<bos>")
    assert patch.startswith("# textwrap.py\n") and "--- a/textwrap.py\n+++ b/textwrap.py\n@@ -1," in patch
    assert patch.endswith('+# Wrapping text.\n """Text wrapping and filling.\n')  # a context line: the module's first
    quote = quote_prompt(engine, 400)
    assert len(quote) <= 400
    text = engine.tokenizer.decode(quote).removeprefix("<bos>")
    output, _, tail = text.partition("\n\nThe tool printed, unchanged:\n")
    assert tail == "```json\n[\n" and json.loads(output.split("\n", 1)[1])[0]["name"] == "False"


def test_the_default_is_set_against_llama_servers_fastest_ngram_mode():
    def row(mode, workload, tok_s):
        return ModeResult(mode, workload, tok_s, 0.0, 0, 0)

    results = [row("ar", "edit", 40), row(DEFAULT_MODE, "edit", 90), row("llama", "edit", 41),
               row("llama ngram-simple", "edit", 60), row("llama ngram-mod", "edit", 75),
               row("ar", "code", 40), row(DEFAULT_MODE, "code", 40)]  # no llama column for code
    assert versus_llama(results) == [f"edit: {DEFAULT_MODE} 90.0 tok/s = 1.20x llama ngram-mod (75.0)"]


def test_llama_server_answers_the_same_token_ids(engine):
    """A live llama-server (where a build is found) completes our prompt ids greedily and reports its timings."""
    from dflash_agent.bench.cpu import llama_cpp_binary
    from dflash_agent.bench.servers import running_servers

    binary = llama_cpp_binary(None, "llama-server")
    if binary is None:
        pytest.skip("no llama-server build ($LLAMA_CPP_BIN)")
    servers = llama_servers("embedded", str(binary.parent), 1024, 2)
    assert [name for name, _ in servers] == list(LLAMA_MODES)
    prompt = module_prompt(engine, 300)
    with running_servers(servers[2:3]) as urls:  # ngram-mod
        timings = llama_run(urls[0][1], prompt, 24)
    assert timings["prompt_n"] == len(prompt) and timings["predicted_n"] == 24
