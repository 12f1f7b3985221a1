"""What a kernel launch costs a GPU's streaming multiprocessor, found without the GPU.

Triton compiles for any NVIDIA target on a machine without one: the launch's arguments go through the same
binder that picks its specialization on a real device (dtypes, 16-byte alignment, integers divisible by 16),
`triton.compile` lowers it for the target's compute capability, and `cuobjdump --dump-resource-usage` (shipped
in the Triton wheel) reads the cubin's registers per thread, stack (spills) and local memory. Shared memory per
program is the compiler's own figure (Triton allocates it dynamically, so the cubin's static SHARED stays 0).
Compiled kernels land in Triton's cache (TRITON_CACHE_DIR), so a second report is quick.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from ..errors import UserError
from ..kernels.triton.triton_support import Launch

# RTX 3090 / RTX 4090 / H100 / RTX 5090
TARGETS: dict[str, int] = {"sm_86": 86, "sm_89": 89, "sm_90": 90, "sm_120": 120}
# Largest shared memory one program may opt into (CUDA programming guide, "Compute capabilities"): 99 KB on
# sm_86 / sm_89 / sm_120, 227 KB on sm_90.
SHARED_LIMIT: dict[str, int] = {"sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024, "sm_120": 99 * 1024}


@dataclass(frozen=True)
class Usage:
    registers: int  # per thread
    stack: int  # bytes per thread of stack frame: register spills
    local: int  # bytes per thread of local memory
    shared: int  # bytes per program
    num_warps: int

    @property
    def spilled(self) -> int:
        return self.stack + self.local


def _specialize(launch: Launch, capability: int):
    if triton.knobs.runtime.interpret:
        raise UserError("the compile report needs compiled Triton: unset TRITON_INTERPRET")
    backend = make_backend(GPUTarget("cuda", capability, 32))
    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.options())
    return fn._pack_args(backend, launch.options(), bound, specialization, options)


def compile_key(launch: Launch) -> str:
    """Equal for two launches exactly when Triton compiles them to the same kernel (on any target)."""
    options, signature, constexprs, attrs = _specialize(launch, 89)
    return repr((launch.kernel.__name__, sorted(signature.items()), sorted(constexprs.items()),
                 sorted(attrs.items()), options.num_warps, options.num_stages))


def compile_for(launch: Launch, target: str):
    """`launch` compiled by Triton for `target` (a TARGETS key): the CompiledKernel, its cubin in .asm["cubin"]."""
    capability = TARGETS[target]
    options, signature, constexprs, attrs = _specialize(launch, capability)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Triton 3.9's notice about the FP-fusion default
        return triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", capability, 32), options=options.__dict__)


def cuobjdump(cubin: bytes, *flags: str) -> str:
    """What the cuobjdump shipped with Triton prints for a cubin with these flags (-sass, --dump-resource-usage)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([triton.knobs.nvidia.cuobjdump.path, *flags, str(path)],
                              capture_output=True, text=True, check=True).stdout


def resource_usage(launch: Launch, target: str) -> Usage:
    """Compile `launch` for `target` (a TARGETS key) and read its resource usage."""
    return usage_of(compile_for(launch, target))


def usage_of(compiled) -> Usage:
    """A compiled kernel's (compile_for) resource usage."""
    dump = cuobjdump(compiled.asm["cubin"], "--dump-resource-usage")
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", dump))
    if "REG" not in fields:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{dump}")
    return Usage(registers=int(fields["REG"]), stack=int(fields["STACK"]), local=int(fields["LOCAL"]),
                 shared=int(fields["SHARED"]) + compiled.metadata.shared, num_warps=compiled.metadata.num_warps)
