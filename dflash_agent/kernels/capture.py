"""Capturing work in a CUDA graph, shared by the engine's step graphs and the kernels' timing; importable without
Triton."""

from __future__ import annotations

from typing import Any

import torch


def capture_graph(step, pool=None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run `step` once eagerly on a side stream (compiles the Triton kernels, sets up cuBLAS), then capture it in a
    CUDA graph (memory from `pool`); returns the graph and the outputs every replay writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = step()
    return graph, outputs
