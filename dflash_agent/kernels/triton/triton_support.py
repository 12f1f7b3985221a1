"""What every Triton kernel here needs to know about the runtime: dtypes, and whether the interpreter runs it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# Every kernel here compiles in several variants that must round alike (a sequence's rows alone and beside others',
# a GEMV program of one row and of eight): with a multiply and an add fused where the compiler chooses, the H200
# found a Q6_K GEMV's row of eight a last bit off the same row alone. Explicit tl.fma still fuses.
COMPILE_OPTIONS: dict[str, Any] = {"enable_fp_fusion": False}


@dataclass(frozen=True)
class Launch:
    """One kernel launch, built by the function that also runs it, so a compile report (bench.compile_check)
    sees exactly the arguments, constexprs and warps the engine's launches use."""

    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple
    meta: dict[str, Any] = field(default_factory=dict)  # constexprs by name, num_warps, num_stages

    def options(self) -> dict[str, Any]:
        """What the launch passes besides its arguments: its meta and the COMPILE_OPTIONS."""
        return {**self.meta, **COMPILE_OPTIONS}

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.options())


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where kernels run through numpy on CPU tensors (the tests)."""
    return bool(triton.knobs.runtime.interpret)


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    if dtype not in _TL_DTYPES:
        raise TypeError(f"Triton kernels take float32, float16 or bfloat16 activations, not {dtype}")
    return _TL_DTYPES[dtype]


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The operand type of tl.dot for activations of `dtype`.

    The interpreter multiplies bfloat16 operands as their raw uint16 bit patterns (numpy has no
    bfloat16), so under it bfloat16 operands are widened to float32; on a GPU they stay bfloat16.
    """
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return tl_dtype(dtype)
