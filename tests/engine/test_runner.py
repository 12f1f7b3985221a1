"""engine.runner: the step runner owns the backends; nothing attaches them to the model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import dflash_agent
from dflash_agent.engine.backends.cpu import CpuDecodeLayers
from dflash_agent.engine.load.weights import build_model
from dflash_agent.engine.model.packed import cpu_dot
from dflash_agent.engine.runner import StepRunner
from tests.helpers.packed import VOCAB, tiny_packed_checkpoint

PACKAGE = Path(dflash_agent.__file__).parent
# the backends' names on the runner, and the names they had when the loader attached them to the model
BACKEND_ATTRIBUTES = {"cpu", "graphs", "cpu_layers", "step_graphs"}


def backend_assignments(source: str) -> list[int]:
    """The lines of `source` that set a backend attribute on anything but the object's own `self`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in (t for top in targets for t in ast.walk(top)):
            if (isinstance(target, ast.Attribute) and target.attr in BACKEND_ATTRIBUTES
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self")):
                lines.append(target.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in BACKEND_ATTRIBUTES:
            lines.append(node.lineno)
    return lines


def test_no_module_attaches_a_backend_to_another_object():
    found = {str(path.relative_to(PACKAGE)): lines for path in sorted(PACKAGE.rglob("*.py"))
             if (lines := backend_assignments(path.read_text()))}
    assert found == {}


def test_the_scan_sees_an_attached_backend():
    assert backend_assignments("model.cpu_layers = CpuDecodeLayers.build(model)\n") == [1]
    assert backend_assignments("x = 1\ntarget.step_graphs, y = None, 2\n") == [2]
    assert backend_assignments("setattr(runner, 'graphs', None)\n") == [1]
    assert backend_assignments("self.cpu = cpu\nself.model.forward(x)\n") == []


@pytest.mark.skipif(cpu_dot() is None, reason="no C compiler: the CPU kernels cannot be built")
def test_the_runner_holds_the_c_layers_and_the_model_holds_none():
    model = build_model(tiny_packed_checkpoint(), "cpu", torch.float32, progress=False, repack_cpu=True)
    runner = StepRunner.build(model)
    assert isinstance(runner.cpu, CpuDecodeLayers) and runner.graphs is None
    held = [name for module in model.modules() for name, value in vars(module).items()
            if isinstance(value, CpuDecodeLayers)]
    assert held == []
    # the model alone is the eager reference: the same tokens, computed without the C layers
    ids = torch.arange(12) % VOCAB
    eager = model.forward(ids, model.new_cache(32), logits_at=torch.arange(12)).logits
    fast = runner.forward(ids, runner.new_cache(32), logits_at=torch.arange(12)).logits
    assert (fast - eager).norm() / eager.norm() < 1e-3 and torch.equal(fast.argmax(-1), eager.argmax(-1))
