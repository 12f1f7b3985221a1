"""Kernel tests run the Triton kernels on a GPU when there is one, else on the CPU through Triton's interpreter.

Triton chooses between compiling and interpreting when a @triton.jit function is defined, its own standard
library included, so interpretation needs TRITON_INTERPRET=1 set before triton is first imported, and
torch._dynamo imports triton as soon as anything touches it: tests/conftest.py sets the variable at the
start of the session on a machine without CUDA. The engine sends CPU tensors to the kernels only when
DFLASH_AGENT_CPU_KERNELS=1 as well; this fixture sets it, imports fresh copies of the kernel modules, and
afterwards puts back the environment and the modules imported before, so interpreted kernels never leak
into other tests.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from dflash_agent.kernels.dispatch import CPU_KERNELS_ENV

PACKAGE = "dflash_agent.kernels"


@dataclass(frozen=True)
class Kernels:
    device: torch.device  # where the tests put their tensors: cuda, or cpu under the interpreter

    def load(self, name: str) -> ModuleType:
        """`dflash_agent.kernels.<name>`, imported the way this fixture runs kernels."""
        return importlib.import_module(f"{PACKAGE}.{name}")


@pytest.fixture(scope="module")
def kernels() -> Iterator[Kernels]:
    if torch.cuda.is_available():
        yield Kernels(torch.device("cuda"))
        return
    if "triton" in sys.modules:
        from triton.language import standard
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(standard.zeros, InterpretedFunction):
            pytest.fail("triton was imported without TRITON_INTERPRET=1 before the kernel tests, so its standard "
                        "library is compiled code the interpreter cannot run (tests/conftest.py sets it first)")
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name.startswith(PACKAGE)}
    parent = importlib.import_module("dflash_agent")
    saved_attr = getattr(parent, "kernels", None)
    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_INTERPRET", "1")
    patch.setenv(CPU_KERNELS_ENV, "1")
    try:
        yield Kernels(torch.device("cpu"))
    finally:
        patch.undo()
        for name in [n for n in sys.modules if n.startswith(PACKAGE)]:
            del sys.modules[name]
        sys.modules.update(saved)
        if saved_attr is not None:
            parent.kernels = saved_attr
        elif hasattr(parent, "kernels"):
            del parent.kernels
