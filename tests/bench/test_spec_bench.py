"""bench --spec's pieces that are not timings alone: the module-copy workload and the verification cost table."""

from __future__ import annotations

import pytest

from dflash_agent.bench.spec import module_prompt, verify_costs
from dflash_agent.engine import Engine, SpecConfig


@pytest.fixture(scope="module")
def engine():
    loaded = Engine.load("embedded", ctx_size=1024, spec=SpecConfig(enabled=False), progress=False)
    yield loaded
    loaded.close()


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
    assert costs[2].ms > costs[0].ms  # twenty rows of logits cost more than one
