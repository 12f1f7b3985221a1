"""Instructions a weight of the quant matmul's compiled K loop, per format and launch shape, without a GPU.

    python3 scripts/kernel_sass.py [N K]     (default: the 31B's gate projection, 21504 x 5376)

The H200 showed the decode matmuls are bound by the instructions they issue, not by bytes (a GEMV of 0.38 warp
instructions a Q4_0 weight ran at ~1 TB/s of 4.8): at that card's 4 warp instructions a clock an SM, reading Q4_0's
0.5625 bytes a weight at the roofline leaves about 0.12. This compiles the launch the engine makes for one row (the
16-row tile) and the one-row GEMV for sm_89 and sm_90 as `bench --kernels` does, disassembles the cubin
(cuobjdump -sass, shipped with Triton) and counts the K-step loop: its body, plus once more any loop nested in it
(Q6_K's tile takes its two halves in a loop), times the program's warps over the weights one step covers.
"""

from __future__ import annotations

import re
import sys

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dflash_agent.bench import compile_check
from dflash_agent.kernels.triton import quant_matmul as qm
from dflash_agent.kernels.triton.triton_support import Launch

T = GGMLQuantizationType
FORMATS = (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def sass(launch: Launch, target: str) -> tuple[list[tuple[int, str]], int, int]:
    """The launch's SASS as (address, instruction) pairs, its registers and its spilled bytes a thread."""
    compiled = compile_check.compile_for(launch, target)
    text = compile_check.cuobjdump(compiled.asm["cubin"], "-sass")
    usage = compile_check.usage_of(compiled)
    code = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, text.splitlines()) if m]
    return code, usage.registers, usage.spilled


def loop_instructions(code: list[tuple[int, str]]) -> int:
    """Instructions one trip of the outermost loop issues: its body, plus once more each loop inside it."""
    loops = []
    for address, text in code:
        branch = _BRANCH.search(text)
        if branch and int(branch.group(1), 16) < address:
            loops.append((int(branch.group(1), 16), address))
    if not loops:
        raise RuntimeError("no loop in the kernel's SASS")
    first, last = max(loops, key=lambda span: span[1] - span[0])
    inside = [(a, b) for a, b in loops if first <= a and b <= last and (a, b) != (first, last)]
    count = sum(1 for address, _ in code if first <= address <= last)
    return count + sum(sum(1 for address, _ in code if a <= address <= b) for a, b in inside)


def launch(qtype: GGMLQuantizationType, shape: qm.LaunchShape, n: int, k: int) -> Launch:
    meta = torch.device("meta")
    block, type_size = GGML_QUANT_SIZES[qtype]
    x = torch.empty(shape.block_m, k, dtype=torch.bfloat16, device=meta)
    raw = torch.empty(n * (k // block) * type_size, dtype=torch.uint8, device=meta)
    y = torch.empty(shape.block_m, n, dtype=torch.bfloat16, device=meta)
    return qm._launch(x, raw, qtype, y, shape, k // block * type_size).launch


def main() -> None:
    n, k = (int(v) for v in sys.argv[1:3]) if len(sys.argv) > 2 else (21504, 5376)
    print(f"warp instructions a weight in the K loop (registers a thread), [{n}, {k}]")
    for qtype in FORMATS:
        for name, shape in (("tile", qm.launch_shape(1, qtype)), ("GEMV", qm.decode_shape(qtype))):
            plan = launch(qtype, shape, n, k)
            weights = shape.block_n * plan.meta["NB"] * GGML_QUANT_SIZES[qtype][0]
            cells = []
            for target in ("sm_89", "sm_90"):
                code, registers, spilled = sass(plan, target)
                cells.append(f"{target} {loop_instructions(code) * shape.num_warps / weights:.3f} "
                             f"({registers}{f', {spilled} spilled' if spilled else ''})")
            print(f"{qtype.name:5} {name:4}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
