"""Where work goes to the Triton kernels and how they split it; importable without Triton (a CPU-only
install may lack it, and the memory plan reads these figures)."""

from __future__ import annotations

import os

import torch
from gguf import GGMLQuantizationType

_T = GGMLQuantizationType
# The GGUF block types kernels.triton.quant_matmul reads: the matrices the engine keeps packed.
PACKED_TYPES: frozenset[GGMLQuantizationType] = frozenset({_T.Q4_0, _T.Q5_0, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K})

# Set (with TRITON_INTERPRET=1) to run the kernels on CPU tensors through Triton's interpreter: how the tests
# check them without a GPU. A TRITON_INTERPRET set for any other reason never sends the CPU engine there.
CPU_KERNELS_ENV = "DFLASH_AGENT_CPU_KERNELS"


def triton_runs(t: torch.Tensor) -> bool:
    """Kernels run on CUDA tensors, and on CPU tensors only when the tests ask for the interpreter."""
    return t.is_cuda or (os.environ.get(CPU_KERNELS_ENV) == "1" and os.environ.get("TRITON_INTERPRET") == "1")


# The attention kernel splits the keys of decode / verification steps (up to SPLIT_ROWS new tokens: a
# speculative block of 16 drafts and its anchor) into chunks of KEYS_PER_CHUNK (flash-decoding), so long
# contexts keep every SM busy; each chunk leaves a float32 partial output.
SPLIT_ROWS = 17
KEYS_PER_CHUNK = 512
# A sliding layer's ring holds a window's keys whatever the context, so its chunks are what fills the GPU: at 512
# keys a 31B ring (1040 slots, 16 KV heads) makes 48 programs for an H200's 132 SMs, far from its bandwidth
# (docs/benchmarks.md). 128-key chunks make 144 programs a row; the ring's partials stay small, so the memory plan
# barely moves.
RING_KEYS_PER_CHUNK = 128
# The rows of kernels.triton.quant_matmul's verification tile: steps of up to this many rows of several sequences
# share a forward there (engine.runner.StepRunner.batches)
VERIFY_ROWS = 16
# Packed matrices of at least this many weights get a decode / verification tile timed on their GPU
# (kernels.triton.quant_tuning); smaller ones cost a launch more than their bytes and keep the default.
TUNED_WEIGHTS = 1 << 22
