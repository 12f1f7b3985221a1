"""Random blocks of GGUF's packed types and the rounding bound of a matmul over them, for the dequantizer's and the
matmul kernels' tests."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

# byte offsets of the fp16 scale fields inside one block; random bytes there would
# give inf/NaN scales, which say nothing about the unpacking
FP16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    # plain float types: every bit pattern is fair game, NaNs included
    T.F32: (),
    T.F16: (),
    T.BF16: (),
}

N, K = 48, 512  # the matmul tests' weight: N rows, K = 2 super-blocks of 256 (tests/kernels/test_quant_matmul.py)
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def random_weight(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> torch.Tensor:
    """Random blocks with finite, moderate fp16 scales (so float16 outputs cannot overflow)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // block, type_size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        scales = (rng.standard_normal(blocks.shape[0]) * 2.0**-6).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(-1).copy())


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y = x @ w^T within the worst-case rounding of its dtype: float32 accumulation over K terms
    ((K - 1) u32 per unit of sum |x||w|), plus, for half types, rounding w to that type for tl.dot and
    rounding the output (one unit roundoff each, relative to the same sum)."""
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    u = UNIT_ROUNDOFF[x.dtype]
    bound = (K * 2.0**-24 + (2 * u if x.dtype != torch.float32 else 0.0)) * magnitude + 1e-30
    err = (y.double() - exact).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"error {float(err.max()):.3g} is {worst:.2f}x the rounding bound"


