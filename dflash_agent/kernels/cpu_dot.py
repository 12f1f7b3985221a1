"""The CPU's quantized matmuls (cpu_dot.c): built once per machine with the system's C compiler, loaded with
ctypes, called on torch tensors.

torch's own weight-only CPU kernels read bfloat16 activations against int4 / int8 weights and run at a third
of the memory bandwidth on small matrices; this one quantizes the activations to int8 per block of 32, as
llama.cpp does, so AVX2 multiplies 32 byte pairs per instruction, and reads 4-bit formats at 4 bits. It is
compiled with -march=native (scalar C where the machine has no AVX2) into the cache directory, keyed by the
source, the compiler and the CPU, so a changed file or a different machine never loads a stale build.
Without a C compiler `load` returns None and the engine keeps torch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_dot.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c11")
DISABLE_ENV = "DFLASH_AGENT_CPU_DOT"  # "0": keep torch's kernels (comparisons, and machines where a build misbehaves)

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "dfa_simd": ([], ctypes.c_int),
    "dfa_quantize": ([_P, _I, _I, _P, _P, _P, ctypes.c_int], None),
    "dfa_matmul_u4": ([_P, _P, _P, _I, _I, _P, _P, _P, _I, _P, ctypes.c_int], None),
    "dfa_matmul_s8": ([_P, _P, _P, _I, _I, _P, _P, _P, _I, _I, _P, ctypes.c_int], None),
    "dfa_dequantize": ([_P, ctypes.c_int, _P, _P, _I, _I, _I, _P, ctypes.c_int], None),
    "dfa_linear": ([_P, _I, _I, _P, ctypes.c_int, _P, _P, _I, _I, _P, ctypes.c_int], None),
}


@dataclass(frozen=True)
class QuantizedActivations:
    """x [M, K] float32 as int16 per block of 32: x ~ xs * xq; xsum is xs times the sum of each block's xq."""

    xq: torch.Tensor  # [M, K] int16
    xs: torch.Tensor  # [M, K / 32] float32
    xsum: torch.Tensor  # [M, K / 32] float32


class CpuDot:
    """The loaded library. Tensors passed in must be contiguous CPU tensors of the documented dtypes."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.lib, self.path = lib, path
        for name, (args, result) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, result
        self.simd = "avx2" if lib.dfa_simd() == 2 else "scalar"

    def quantize(self, x: torch.Tensor) -> QuantizedActivations:
        m, k = x.shape
        if k % 32:
            raise ValueError(f"quantized activations need rows of a multiple of 32 values, got {k}")
        x = x.float().contiguous()
        out = QuantizedActivations(torch.empty(m, k, dtype=torch.int16), torch.empty(m, k // 32),
                                   torch.empty(m, k // 32))
        self.lib.dfa_quantize(x.data_ptr(), m, k, out.xq.data_ptr(), out.xs.data_ptr(), out.xsum.data_ptr(),
                              torch.get_num_threads())
        return out

    def matmul_u4(self, x: QuantizedActivations, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """y [M, N] for w = d q + m in groups of 32 (q: [N, K / 2] uint8, see cpu_dot.c)."""
        rows, k = x.xq.shape
        n = q.shape[0]
        y = torch.empty(rows, n)
        self.lib.dfa_matmul_u4(x.xq.data_ptr(), x.xs.data_ptr(), x.xsum.data_ptr(), rows, k, q.data_ptr(),
                               d.data_ptr(), m.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
        return y

    def matmul_s8(self, x: QuantizedActivations, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                  group: int) -> torch.Tensor:
        """y [M, N] for w = d q (+ m) in groups of `group` (32, or 16 without m; q: [N, K] int8)."""
        if m is not None and group != 32:
            raise ValueError("an s8 matrix with offsets needs groups of 32")
        rows, k = x.xq.shape
        n = q.shape[0]
        y = torch.empty(rows, n)
        self.lib.dfa_matmul_s8(x.xq.data_ptr(), x.xs.data_ptr(), x.xsum.data_ptr(), rows, k, q.data_ptr(),
                               d.data_ptr(), None if m is None else m.data_ptr(), group, n, y.data_ptr(),
                               torch.get_num_threads())
        return y



    def linear(self, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
               group: int) -> torch.Tensor:
        """y [M, N] = x [M, K] @ (d q + m)^T: quantize and matmul_u4 / matmul_s8 (by q's dtype) in one call."""
        rows, k = x.shape
        if k % 32:
            raise ValueError(f"quantized activations need rows of a multiple of 32 values, got {k}")
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        n = q.shape[0]
        y = torch.empty(rows, n)
        self.lib.dfa_linear(x.data_ptr(), rows, k, q.data_ptr(), int(q.dtype == torch.uint8), d.data_ptr(),
                            None if m is None else m.data_ptr(), group, n, y.data_ptr(), torch.get_num_threads())
        return y

    def dequantize(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group: int) -> torch.Tensor:
        """w [N, K] float32 = d q + m, bit for bit what the GGUF dequantization gives (u4 when q is uint8)."""
        u4 = q.dtype == torch.uint8
        n, k = q.shape[0], q.shape[1] * (2 if u4 else 1)
        w = torch.empty(n, k)
        self.lib.dfa_dequantize(q.data_ptr(), int(u4), d.data_ptr(), None if m is None else m.data_ptr(), group, n,
                                k, w.data_ptr(), torch.get_num_threads())
        return w


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def load(cache_root: Path) -> CpuDot | None:
    """The library, built into cache_root/kernels on first use; None when it cannot be (logged once)."""
    if os.environ.get(DISABLE_ENV) == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: the CPU matmuls use torch's kernels (install gcc for the fast path)")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), _compiler_version(cc).encode(),
                                     _cpu_signature().encode(), platform.machine().encode()])).hexdigest()[:16]
    path = cache_root / "kernels" / f"cpu_dot-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        log.info("compiling the CPU matmul kernels (once per machine) into %s", path)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            try:
                result = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
                                        capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("building the CPU matmul kernels failed (%s): using torch's kernels", exc)
                return None
            if result.returncode != 0:
                log.warning("building the CPU matmul kernels failed: using torch's kernels\n%s", result.stderr[-2000:])
                return None
            os.replace(built, path)  # atomic: concurrent loaders see no half-written library
    try:
        return CpuDot(ctypes.CDLL(str(path)), path)
    except OSError as exc:
        log.warning("loading %s failed (%s): using torch's kernels", path, exc)
        return None
