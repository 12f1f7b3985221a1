"""The CPU's kernels: quantized matmuls (cpu_dot.c) and a whole decoder layer for decode steps (cpu_layer.c) in one
library, loaded with ctypes, called on torch tensors.

torch's own weight-only CPU kernels read bfloat16 activations against int4 / int8 weights and run at a third of the
memory bandwidth on small matrices; these quantize the activations to int16 per block of 32 (int8, as llama.cpp
does, cost 2-3 points of top-1 agreement), multiply 16 pairs per AVX2 instruction, and read the checkpoint's 4- and
5-bit formats at 4 and 5 bits (IntMatrix).

The library is built when the package installs (setup.py, through build.py), once per ISA variant (VARIANTS), and
`load` picks the best variant this CPU runs, after checking the library's ABI against this module's structs. Where
none loads (a source tree never installed, a CPU the variants do not cover, or only scalar C would run), torch's
kernels serve instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import logging
import math
import mmap
import os
import platform
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .build import MACHINES, MODE_ENV, source_digest

log = logging.getLogger(__name__)

DISABLE_ENV = MODE_ENV  # "0": keep torch's kernels; a variant's name: that build; see load()
ABI_VERSION = 12  # cpu_dot.h's DFA_ABI_VERSION
# The variants setup.py builds at install, best first, and the /proc/cpuinfo flags each needs: x86-64-v4 with VNNI
# (AVX-512 F, BW, CD, DQ, VL and VNNI over x86-64-v3); x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE over
# x86-64-v2); aarch64's NEON ("asimd", part of every aarch64 Linux CPU); a generic build (the scalar C, DFA_SCALAR:
# the reference the vector builds are tested against; torch's kernels beat it); and the build for the installing
# machine, made only when asked for (build.variants), which runs where it was built.
X86_64_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "cx16", "lahf_lm", "popcnt",
                       "sse4_1", "sse4_2", "ssse3"})
VARIANTS: dict[str, frozenset[str]] = {
    "x86_64_v4_vnni": X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"},
    "x86_64_v3": X86_64_V3,
    "aarch64_neon": frozenset({"asimd"}),
    "generic": frozenset(),
    "native": frozenset(),
}
SIMD = {0: "scalar", 1: "neon", 2: "avx2", 3: "avx512"}  # dfa_simd()
# cpu_dot.h's DFA_SCALES_*, by the dtype of an IntMatrix's d: float32, float16, K-quant super-block headers
SCALES = {torch.float32: 0, torch.float16: 1, torch.uint8: 2}
Q6K_SCALES = 3  # and Q6_K super-block tails (uint8 too), which only the 6-bit layout has

_P, _I = ctypes.c_void_p, ctypes.c_int64
_WEIGHT = [_P, ctypes.c_int, _P, ctypes.c_int, _P, ctypes.c_int, _P, _I, _I]
_SIGNATURES = {
    "dfa_simd": ([], ctypes.c_int),
    "dfa_abi": ([ctypes.c_int], _I),
    "dfa_source_digest": ([], ctypes.c_char_p),
    "dfa_quantize": ([_P, _I, _I, _P, _P, _P, ctypes.c_int], None),
    # a weight's arguments (IntMatrix.args): q, bits, qh, offset, d, scales, m, group, N
    "dfa_matmul": ([_P, _P, _P, _I, _I, *_WEIGHT, _P, ctypes.c_int], None),
    "dfa_dequantize": ([_P, ctypes.c_int, _P, ctypes.c_int, _P, ctypes.c_int, _P, _I, _I, _I, _P, _P, ctypes.c_int],
                       None),
    "dfa_linear": ([_P, _I, _I, *_WEIGHT, _P, ctypes.c_int], ctypes.c_int),
    "dfa_gemm_i8": ([_P, _I, _I, _P, _P, ctypes.c_int], ctypes.c_int),
    "dfa_layers_forward": ([_P, _P, _I, _P, _I, _P, _P, _P, _P, _P, _I, _P, ctypes.c_int], ctypes.c_int),
    "dfa_rope_table": ([_P, _I, _P, _I, _P, _P], None),
    "dfa_argmax": ([_P, _I, ctypes.c_int], _I),
    "dfa_repack": ([_P, ctypes.c_int, _I, _I, _P, _P, _P, ctypes.c_int], ctypes.c_int),
    "dfa_release_threads": ([], ctypes.c_int),
    "dfa_norm_linear": ([_P, _I, _P, ctypes.c_float, _P, _P, ctypes.c_int], ctypes.c_int),
    "dfa_norm_head_argmax": ([_P, _I, _P, ctypes.c_float, _P, _P, _P, ctypes.c_int], ctypes.c_int),
}
# GGML's type ids of the formats dfa_repack reads (cpu_dot.h's DFA_GGML_*) -> (bits, offset, group, scale bytes per
# 256 values): the layout each repacks into, its scales as the file stores them (a float16 per 32; the K-quants'
# 16-byte super-block headers, Q6_K's 18-byte tails), so each repacks at the file's own size (Q4_0 / Q4_K 4.5 bits a
# weight, Q5_0 / Q5_K 5.5, Q6_K 6.56, Q8_0 8.5)
REPACK_LAYOUTS: dict[int, tuple[int, int, int, int]] = {
    2: (4, 8, 32, 16),  # Q4_0
    6: (5, 16, 32, 16),  # Q5_0
    8: (8, 0, 32, 16),  # Q8_0
    12: (4, 0, 32, 16),  # Q4_K
    13: (5, 0, 32, 16),  # Q5_K
    14: (6, 32, 16, 18),  # Q6_K
}
SCREEN_PANEL = 32  # a HeadScreen's rows come in pairs of panels of 16 (cpu_layer.c's screen_tile)


@dataclass(frozen=True)
class IntMatrix:
    """A weight [N, K] in one of cpu_dot.c's layouts (`pack` builds them), groups of `group` inputs with scales
    scales d, stored as the GGUF stores them where the kernels read that (`scales`): float32 [N, K / group];
    float16 [N, K / group] (the one scale of each Q4_0 / Q5_0 / Q8_0 block); or uint8 [N, K / 256 * 16], the 16-byte
    header of each Q4_K / Q5_K super-block (float16 d and dmin, 6-bit scales and mins: w = d sc q - dmin mn per
    group of 32; 4 or 5 bits, no m); or, with 6 bits, uint8 [N, K / 256 * 18], the 18-byte tail of each Q6_K
    super-block (16 int8 scales sc, float16 d: w = d sc (q - 32) per group of 16). Offsets m: float32
    [N, K / group], or None:
    - bits 4: q [N, K / 2] uint8, 16 bytes per group of 32 (see cpu_dot.c), w = d (q - offset) + m;
    - bits 5: q as for 4 bits holding the low 4 bits, qh [N, K / 32] int32 holding the fifth, w = d (q - offset) + m;
    - bits 6: q as for 4 bits, qh [N, K / 32, 2] int32 holding the top two (8 bytes a group, see cpu_dot.c), Q6_K
      tails, offset 32;
    - bits 8: q [N, K] int8, w = d q + m, groups of 32, or 16 without m."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bits: int = 8
    group: int = 32
    qh: torch.Tensor | None = None
    offset: int = 0

    def __post_init__(self) -> None:
        if self.bits not in (4, 5, 6, 8) or (self.bits in (5, 6)) != (self.qh is not None):
            raise ValueError(f"no {self.bits}-bit layout {'with' if self.qh is not None else 'without'} high bits")
        sixteens = self.bits == 6 or (self.bits == 8 and self.m is None)  # the layouts that take groups of 16
        if self.group not in (16, 32) or (self.group == 16 and not sixteens) or (self.bits == 6 and self.group != 16):
            raise ValueError("groups of 16 are the 6-bit layout's, or an 8-bit one's without offsets; groups of 32 "
                             "the others'")
        if self.bits == 6 and (self.d.dtype != torch.uint8 or self.offset != 32 or self.m is not None
                               or self.k % 256 or self.d.shape != (self.n, self.k // 256 * 18)):
            raise ValueError(f"the 6-bit layout is Q6_K's: rows of a multiple of 256 values, an 18-byte tail per "
                             f"256 as scales, offset 32, no m; got {self.k} values, scales {self.d.dtype} "
                             f"{tuple(self.d.shape)}, offset {self.offset}")
        if self.d.dtype not in SCALES or (self.d.dtype != torch.float32 and self.m is not None):
            raise ValueError(f"scales d are float32, or float16 or K-quant headers (uint8) without offsets m, not "
                             f"{self.d.dtype}")
        if self.d.dtype == torch.uint8 and self.bits != 6 and (self.bits == 8 or self.group != 32 or self.k % 256
                                            or self.d.shape != (self.n, self.k // 256 * 16)):
            raise ValueError(f"K-quant headers scale 4- or 5-bit rows of a multiple of 256 values, 16 bytes each, got "
                             f"{self.bits} bits, {self.k} values, headers {tuple(self.d.shape)}")
        if self.bits == 8 and self.offset:
            raise ValueError("the 8-bit layout is signed: no offset")

    @classmethod
    def pack(cls, values: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int, group: int = 32,
             offset: int = 0) -> IntMatrix:
        """The layout of integers values [N, K] (0..2^bits - 1 for 4, 5 and 6 bits, int8 for 8) with w = d (values
        - offset) + m."""
        if bits == 8:
            return cls(values.to(torch.int8).contiguous(), d.contiguous(), _contiguous(m), 8, group)
        n, k = values.shape
        runs = values.view(n, k // 32, 2, 2, 8)  # [group, bytes 0-7 | 8-15, low | high nibble, 8]
        q = ((runs[:, :, :, 0] & 15) | ((runs[:, :, :, 1] & 15) << 4)).to(torch.uint8).reshape(n, k // 2)
        qh = None
        if bits == 5:  # bit k of a group's word: the fifth bit of value (R0, R2, R1, R3)[k]
            fifth = (values.view(n, k // 32, 4, 8)[:, :, [0, 2, 1, 3]].reshape(n, k // 32, 32) >> 4) & 1
            word = (fifth.to(torch.int64) << torch.arange(32)).sum(-1)
            qh = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32).contiguous()
        elif bits == 6:  # byte i of a group's 8: the top two bits of run r's value i at bits 2r, 2r + 1
            top = (values.view(n, k // 32, 4, 8) >> 4) << (2 * torch.arange(4))[:, None]
            qh = top.sum(2).to(torch.uint8).view(torch.int32).contiguous()  # [n, groups, 2]
        return cls(q.contiguous(), d.contiguous(), _contiguous(m), bits, group, qh, offset)

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1] * (1 if self.bits == 8 else 2)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.q, self.d, self.m, self.qh) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def _mapped(self, f: Callable[[torch.Tensor], torch.Tensor]) -> IntMatrix:
        """The same layout with f applied to each of its tensors (rows of q, d, m and qh correspond)."""
        def apply(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else f(t)

        return IntMatrix(f(self.q), f(self.d), apply(self.m), self.bits, self.group, apply(self.qh), self.offset)

    def rows(self, start: int, end: int) -> IntMatrix:
        return self._mapped(lambda t: t[start:end])

    @property
    def scales(self) -> int:
        """How d is stored: cpu_dot.h's DFA_SCALES_F32 / F16 / K / Q6K."""
        return Q6K_SCALES if self.bits == 6 else SCALES[self.d.dtype]

    def args(self) -> tuple:
        """(q, bits, qh, offset, d, scales, m, group, N): the weight as cpu_dot.c's entry points take it."""
        return (self.q.data_ptr(), self.bits, _ptr(self.qh), self.offset, self.d.data_ptr(), self.scales,
                _ptr(self.m), self.group, self.n)

    def struct(self) -> Matrix:
        return Matrix(q=self.q.data_ptr(), qh=_ptr(self.qh), d=self.d.data_ptr(), m=_ptr(self.m), group=self.group,
                      bits=self.bits, offset=self.offset, n=self.n, k=self.k, scales=self.scales)


REPACK_CHUNK_BYTES = 32 << 20  # of a matrix's blocks per repacking call: what a load holds of the file at once


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def repacked_shapes(qtype: int, n: int, k: int) -> list[tuple[tuple[int, ...] | None, torch.dtype]]:
    """The (shape, dtype) of q, qh (None: none) and d of a GGML type qtype matrix [n, k] as CpuDot.repack makes it."""
    if qtype not in REPACK_LAYOUTS:
        raise ValueError(f"GGML type {qtype} has no CPU layout (the layouts read {sorted(REPACK_LAYOUTS)})")
    bits, _, _, scale_bytes = REPACK_LAYOUTS[qtype]
    super_blocks = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0] == 256  # the K-quants: headers / tails as d
    q = ((n, k), torch.int8) if bits == 8 else ((n, k // 2), torch.uint8)
    qh = ((n, k // 32), torch.int32) if bits == 5 else ((n, k // 32, 2), torch.int32) if bits == 6 else None
    d = ((n, k // 256 * scale_bytes), torch.uint8) if super_blocks else ((n, k // 32), torch.float16)
    return [q, (qh, torch.int32) if qh is None else qh, d]


def repacked_nbytes(qtype: int, n: int, k: int) -> int:
    """What CpuDot.repack allocates for such a matrix (a HugePageArena's alignment not counted)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in repacked_shapes(qtype, n, k) if shape)


class HugePageArena:
    """One private anonymous mapping advised for transparent huge pages, which tensors are allocated in (`empty`:
    a load repacks the weights straight into it). A decode step streams every weight once, and on 2 MiB pages it
    misses the TLB far less: the 189 MB LM head reads about 8% faster. Linux backs only memory advised so with huge
    pages in THP's default "madvise" mode, and torch's allocations are not; where the advice is not available,
    `empty` is torch.empty. Its tensors are views of the one mapping: pickling or saving one writes all of it (none
    is: they are kernel-only copies)."""

    ALIGN = 64  # a cache line: rows never straddle one more than they must

    def __init__(self, nbytes: int) -> None:
        self._memory: torch.Tensor | None = None
        self._used = self._end = 0
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is None or nbytes <= 0:
            return
        huge = 2 << 20
        try:
            mapping = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:  # no room for a second copy (strict overcommit): the tensors stay where they are
            return
        try:
            mapping.madvise(advice)
        except OSError:  # a kernel without transparent huge pages
            mapping.close()
            return
        self._memory = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
        self._used = -self._memory.data_ptr() % huge  # pages are huge only where 2 MiB-aligned
        self._end = self._used + nbytes

    @property
    def enabled(self) -> bool:
        return self._memory is not None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in the arena (torch.empty's without one, or once the arena is full)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._memory is None or nbytes == 0 or self._used + nbytes > self._end:
            return torch.empty(shape, dtype=dtype)
        out = self._memory[self._used:self._used + nbytes].view(dtype).view(shape)
        self._used = -(-(self._used + nbytes) // self.ALIGN) * self.ALIGN
        return out


class AbiStruct(ctypes.Structure):
    """A struct of the C ABI, filled by field name only: a positional argument binds to whatever field sits at its
    place, and a field moved in this mirror and in cpu_dot.h alike passes the ABI check. Slots and no __dict__: a
    misspelt field name, given here or assigned later, raises AttributeError instead of becoming an attribute C
    never reads."""

    __slots__ = ()

    def __init__(self, **fields) -> None:
        super().__init__(**fields)


class Matrix(AbiStruct):
    """cpu_layer.c's dfa_matrix: a weight as cpu_dot's matmuls take it (q NULL: absent)."""

    __slots__ = ()
    _fields_ = [("q", _P), ("qh", _P), ("d", _P), ("m", _P), ("group", _I), ("bits", _I), ("offset", _I), ("n", _I),
                ("k", _I), ("scales", _I)]


class LayerWeights(AbiStruct):
    """cpu_layer.c's dfa_layer: one decoder layer's weights and shape (norm weights as applied, offset + w)."""

    __slots__ = ()
    _fields_ = [(name, Matrix) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down")] + [
        (name, _P) for name in ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm")
    ] + [(name, _I) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "v_norm")] + [
        (name, ctypes.c_float) for name in ("eps", "scale", "layer_scalar")
    ] + [("router", Matrix)] + [  # a MoE layer's routed experts (experts 0: none)
        (name, _P) for name in ("router_w", "router_scale", "expert_scale", "expert_gate_up", "expert_down",
                                "post_ff_norm_1", "pre_ff_norm_2", "post_ff_norm_2")
    ] + [(name, _I) for name in ("experts", "top_k", "expert_width")] + [  # E2B / E4B's per-layer input
        ("per_layer_gate", Matrix), ("per_layer_proj", Matrix), ("post_per_layer_norm", _P), ("per_layer_width", _I)
    ]


class LayerCache(AbiStruct):
    """cpu_layer.c's dfa_kv: a layer's float32 cache [slots, kv_heads, head_dim] and its slots (C refuses a write
    slot or n_keys past them), where the new keys go (write_slots [T]) and which slots the queries see (key_pos
    [n_keys], NULL: slot = position; window 0: none)."""

    __slots__ = ()
    _fields_ = [("k", _P), ("v", _P), ("slots", _I), ("write_slots", _P), ("key_pos", _P), ("n_keys", _I),
                ("window", _I)]


class Screen(AbiStruct):
    """cpu_dot.h's dfa_screen (HeadScreen.struct)."""

    __slots__ = ()
    _fields_ = [("q", _P), ("d", _P), ("l1", _P), ("err", _P), ("n", _I), ("k", _I)]


@dataclass(frozen=True)
class HeadScreen:
    """An LM head as 8-bit integers per block of 32, in cpu_dot.h's dfa_screen layout: what CpuDot.norm_head_argmax
    screens a block's logits with before computing its candidates exactly. Built from the head's own exact
    dequantization (`of`): a Q8_0 head's own integers and scales, any other requantized, with each block's largest
    error and sum of |w| for the bound."""

    q: torch.Tensor  # [n_pad / 16, k / 4, 16, 4] uint8: the integers + 128
    d: torch.Tensor  # [n_pad / 16, k / 32, 16] float32, likewise l1 and err
    l1: torch.Tensor
    err: torch.Tensor | None  # None: every block exact
    n: int

    @classmethod
    def of(cls, lib: CpuDot, w: IntMatrix, rows_per_chunk: int = 8192) -> HeadScreen:
        n, k = w.n, w.k
        padded, blocks = -(-n // SCREEN_PANEL) * SCREEN_PANEL, k // 32
        q = torch.full((padded, k), 128, dtype=torch.uint8)
        d, l1, err = (torch.zeros(padded, blocks) for _ in range(3))
        own = w.bits == 8 and w.group == 32 and w.m is None  # Q8_0: its own integers and scales, exactly
        for start in range(0, n, rows_per_chunk):
            end = min(n, start + rows_per_chunk)
            if own:
                ints = w.q[start:end].view(end - start, blocks, 32)
                q[start:end] = (ints.to(torch.int16) + 128).to(torch.uint8).view(end - start, k)
                d[start:end] = w.d[start:end].float()
                total = ints.abs().to(torch.int32).sum(2).double()  # exact: at most 32 * 128
                l1[start:end] = _rounded_up(total * d[start:end].double().abs())
                continue
            # in float32, each rounding covered: fl(ints scale) and the difference come within 2^-23 amax of the
            # exact error (2^-22 added), a sum of 32 within 2^-19 of the exact sum (2^-18 added)
            exact = lib.dequantize(w.rows(start, end)).view(end - start, blocks, 32)
            # amax / 127: a Q8_0 block's own scale where its largest integer is 127, and then its integers
            amax = exact.abs().amax(2)
            scale = amax / 127
            ints = (exact / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round_().clamp_(-127, 127)
            q[start:end] = (ints + 128).to(torch.uint8).view(end - start, k)
            d[start:end] = scale
            err[start:end] = (ints.mul_(scale[..., None]).sub_(exact).abs_().amax(2) + amax * 2.0 ** -22) * _SLACK
            l1[start:end] = exact.abs().sum(2) * (1 + 2.0 ** -18)

        def panels(t: torch.Tensor) -> torch.Tensor:  # [n_pad, blocks] -> [n_pad / 16, blocks, 16]
            return t.view(padded // 16, 16, blocks).permute(0, 2, 1).contiguous()

        q = q.view(padded // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
        return cls(q, panels(d), panels(l1), panels(err) if bool(err.any()) else None, n)

    @property
    def k(self) -> int:
        return self.q.shape[1] * 4

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.q, self.d, self.l1, self.err) if t is not None)

    def struct(self) -> Screen:
        return Screen(q=self.q.data_ptr(), d=self.d.data_ptr(), l1=self.l1.data_ptr(), err=_ptr(self.err), n=self.n,
                      k=self.k)


_SLACK = 1 + 2.0 ** -20  # a float32 product's rounding, upwards


def _rounded_up(v: torch.Tensor) -> torch.Tensor:
    """float64 v as the float32 at or above each value."""
    f = v.float()
    return torch.where(f.double() < v, torch.nextafter(f, torch.tensor(float("inf"))), f)


@dataclass(frozen=True)
class QuantizedActivations:
    """x [M, K] float32 as int16 per block of 32: x ~ xs * xq; xsum is xs times the sum of each block's xq."""

    xq: torch.Tensor  # [M, K] int16
    xs: torch.Tensor  # [M, K / 32] float32
    xsum: torch.Tensor  # [M, K / 32] float32


class CpuDot:
    """The loaded library. Each entry point checks what C cannot (a shape, dtype, device or layout C would read
    past or misread raises ValueError) from tensor attributes only, a microsecond or two per call; activations of
    another dtype or layout are converted to contiguous float32."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.lib, self.path = lib, path
        for name, (args, result) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, result
        self.simd = SIMD.get(lib.dfa_simd(), "scalar")
        self._local = threading.local()  # the count `using` set for the calling thread

    def threads(self) -> int:
        """The threads the calling thread's kernel calls run on: what `using` set, else torch's count."""
        return getattr(self._local, "threads", None) or torch.get_num_threads()

    @contextlib.contextmanager
    def using(self, threads: int) -> Iterator[None]:
        """The calling thread's kernel calls run on `threads` threads meanwhile (torch's own ops keep theirs). A
        kernel's results do not depend on it: each output is computed whole by one thread."""
        before = getattr(self._local, "threads", None)
        self._local.threads = threads
        try:
            yield
        finally:
            self._local.threads = before

    def quantize(self, x: torch.Tensor) -> QuantizedActivations:
        if x.dim() != 2 or x.shape[1] % 32:
            raise ValueError(f"quantized activations need rows [M, K] of a multiple of 32 values, got {tuple(x.shape)}")
        m, k = x.shape
        x = _activations(x, k)
        out = QuantizedActivations(torch.empty(m, k, dtype=torch.int16), torch.empty(m, k // 32),
                                   torch.empty(m, k // 32))
        self.lib.dfa_quantize(x.data_ptr(), m, k, out.xq.data_ptr(), out.xs.data_ptr(), out.xsum.data_ptr(),
                              self.threads())
        return out

    def matmul(self, x: QuantizedActivations, w: IntMatrix) -> torch.Tensor:
        """y [M, N] = x @ w^T."""
        if x.xq.dim() != 2 or x.xq.shape[1] != w.k:
            raise ValueError(f"activations of shape {tuple(x.xq.shape)} against a matrix of {w.k} inputs")
        rows, k = x.xq.shape
        _require(x.xq, "xq", torch.int16, rows, k)
        _require(x.xs, "xs", torch.float32, rows, k // 32)
        _require(x.xsum, "xsum", torch.float32, rows, k // 32)
        y = torch.empty(rows, w.n)
        self.lib.dfa_matmul(x.xq.data_ptr(), x.xs.data_ptr(), x.xsum.data_ptr(), rows, k, *w.args(), y.data_ptr(),
                            self.threads())
        return y

    def linear(self, x: torch.Tensor, w: IntMatrix) -> torch.Tensor:
        """y [M, N] = x [M, K] @ w^T: quantize and matmul in one call."""
        x = _activations(x, w.k)
        rows, k = x.shape
        y = torch.empty(rows, w.n)
        if self.lib.dfa_linear(x.data_ptr(), rows, k, *w.args(), y.data_ptr(), self.threads()):
            raise MemoryError("the CPU matmul could not allocate its scratch memory")
        return y

    def gemm_int8(self, x: torch.Tensor, w: IntMatrix) -> torch.Tensor:
        """y [M, N] ~ x [M, K] @ w^T with x quantized to int8 per block of 32 (a prompt's GEMMs, as llama.cpp's):
        not the exact path (int16 activations, `linear`). Fast where the library has VNNI (simd avx512)."""
        x = _activations(x, w.k)
        rows, k = x.shape
        y = torch.empty(rows, w.n)
        status = self.lib.dfa_gemm_i8(x.data_ptr(), rows, k, ctypes.byref(w.struct()), y.data_ptr(),
                                      self.threads()) if rows else 0
        if status == -2:
            raise ValueError(f"the int8 GEMM refused activations of {k} inputs against a matrix of {w.k}")
        if status:
            raise MemoryError("the CPU int8 GEMM could not allocate its scratch memory")
        return y

    def layers_forward(self, layers: ctypes.Array, caches: ctypes.Array, x: torch.Tensor, q_pos: torch.Tensor,
                       cos: ctypes.Array, sin: ctypes.Array, capture: ctypes.Array,
                       groups: torch.Tensor | None = None, per_layer: torch.Tensor | None = None) -> None:
        """The decoder layers (cpu_layer.c, arrays of LayerWeights and LayerCache) over x [T, hidden] float32, in
        place; q_pos [T] int64; cos / sin: each layer's RoPE tables [T, head_dim] float32; capture: where each
        layer's output is copied (None: nowhere). groups [G + 1] int64: the rows of G sequences (sequence g owns
        rows groups[g]:groups[g + 1]), caches then [layers * G], layer i's cache of sequence g at i * G + g, its
        write slots indexed by the sequence's own rows; None: one sequence. per_layer [T, layers, width] float32:
        a PLE model's per-layer inputs (None for other models). All contiguous; the structs must point
        at live tensors, each LayerCache's `slots` no more than its caches hold (C checks the write slots and
        n_keys against it)."""
        n = len(layers)
        if groups is None:
            groups = torch.tensor([0, x.shape[0]])
        _require(groups, "groups", torch.int64, None)
        g = groups.shape[0] - 1
        if not len(caches) == n * g or not len(cos) == len(sin) == len(capture) == n:
            raise ValueError(f"{n} layers of {g} sequences with {len(caches)} caches, {len(cos)} / {len(sin)} RoPE "
                             f"tables and {len(capture)} capture pointers")
        _require(x, "x", torch.float32, None, layers[0].hidden if n else None)
        _require(q_pos, "q_pos", torch.int64, x.shape[0])
        if per_layer is not None:
            _require(per_layer, "per_layer", torch.float32, x.shape[0], n, layers[0].per_layer_width if n else None)
        status = self.lib.dfa_layers_forward(layers, caches, len(layers), x.data_ptr(), x.shape[0], q_pos.data_ptr(),
                                             cos, sin, capture, groups.data_ptr(), g,
                                             _ptr(per_layer), self.threads())
        if status == -2:
            raise ValueError("a write slot or key count outside a layer's KV cache (LayerCache.slots), a top_k "
                             "outside a MoE layer's experts, per-layer inputs missing or of unequal widths, or "
                             f"groups {groups.tolist()} that do not split the {x.shape[0]} rows")
        if status != 0:
            raise MemoryError("the CPU decoder layer could not allocate its scratch memory")

    def rope_table(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [T, 2 len(inv_freq)] float32 of NeoX RoPE at positions [T] int64 (model.gemma.rope_tables)."""
        _require(positions, "positions", torch.int64, None)
        _require(inv_freq, "inv_freq", torch.float32, None)
        half = inv_freq.shape[0]
        cos, sin = torch.empty(positions.shape[0], 2 * half), torch.empty(positions.shape[0], 2 * half)
        self.lib.dfa_rope_table(positions.data_ptr(), positions.shape[0], inv_freq.data_ptr(), half, cos.data_ptr(),
                                sin.data_ptr())
        return cos, sin

    def norm_linear(self, x: torch.Tensor, norm: torch.Tensor, eps: float, w: Matrix) -> torch.Tensor:
        """(x / rms(x) * norm) @ w^T for x [T, K] (float32 contiguous, else converted), norm [K] float32
        (contiguous) as applied (offset + w)."""
        if not w.q:
            raise ValueError("norm_linear of an absent matrix")
        x = _activations(x, w.k)
        _require(norm, "the norm weight", torch.float32, w.k)
        y = torch.empty(x.shape[0], w.n)
        if self.lib.dfa_norm_linear(x.data_ptr(), x.shape[0], norm.data_ptr(), eps, ctypes.byref(w), y.data_ptr(),
                                    self.threads()):
            raise MemoryError("the CPU LM head could not allocate its scratch memory")
        return y

    def norm_head_argmax(self, x: torch.Tensor, norm: torch.Tensor, eps: float, w: Matrix, screen: HeadScreen,
                         keep: Screen | None = None) -> list[int | None]:
        """Each row's argmax of norm_linear(x, norm, eps, w), the first largest as `argmax` picks it, through `screen`
        (HeadScreen.of the same head): only the logits that can be the largest are computed exactly. None for a
        row the screen leaves to the full head (a NaN or an infinity in it, or a tie too wide). keep: the screen's
        struct, where the caller holds one."""
        if not w.q:
            raise ValueError("norm_head_argmax of an absent matrix")
        if screen.n != w.n or screen.k != w.k:
            raise ValueError(f"a screen of [{screen.n}, {screen.k}] for a head of [{w.n}, {w.k}]")
        x = _activations(x, w.k)
        _require(norm, "the norm weight", torch.float32, w.k)
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        status = self.lib.dfa_norm_head_argmax(x.data_ptr(), x.shape[0], norm.data_ptr(), eps, ctypes.byref(w),
                                               ctypes.byref(keep or screen.struct()), tokens.data_ptr(),
                                               self.threads())
        if status:
            raise MemoryError("the CPU LM head's screen could not allocate its scratch memory")
        return [None if t < 0 else t for t in tokens.tolist()]

    def argmax(self, x: torch.Tensor) -> int:
        """int(torch.argmax(x)) for a CPU tensor (converted to contiguous float32 unless it is), several times faster
        on a vocabulary."""
        if x.device.type != "cpu":
            raise ValueError(f"the CPU kernels read CPU tensors, not {x.device} ones")
        if x.numel() == 0:  # torch.argmax raises too, where C would answer 0
            raise ValueError("argmax of an empty tensor")
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        return self.lib.dfa_argmax(x.data_ptr(), x.numel(), self.threads())

    def release_threads(self) -> None:
        """End the OpenMP threads this thread's parallel regions (torch's too: they share the runtime) have kept, so
        that another thread running the kernels is the only one holding threads: with more threads than cores,
        libgomp stops spinning between regions and a decode step pays a wake-up per matmul. Call it from a thread
        that is done computing (it loaded the model; it waits for work)."""
        self.lib.dfa_release_threads()

    def repack(self, blocks: torch.Tensor, qtype: int, n: int, k: int,
               empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
               done: Callable[[torch.Tensor], None] | None = None) -> IntMatrix:
        """A GGUF matrix [n, k] of GGML type id qtype (its blocks, as the file stores them: a memory map's view
        serves) as its IntMatrix, bit for bit the integers and scales the file holds; its tensors from
        empty(shape, dtype) (default torch.empty: a HugePageArena's `empty` places them there). done(blocks) is
        called on each run of rows repacked (a load hands the file's pages back there)."""
        shapes = repacked_shapes(qtype, n, k)
        blocks = blocks.reshape(-1).view(torch.uint8)
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        need = n * k // block * block_bytes
        if blocks.numel() != need or not blocks.is_contiguous() or blocks.device.type != "cpu":
            raise ValueError(f"a GGML type {qtype} matrix [{n}, {k}] is {need} contiguous bytes in CPU memory, got "
                             f"{blocks.numel()}")
        q, qh, d = [(empty or _empty)(shape, dtype) if shape else None for shape, dtype in shapes]
        row_bytes = need // n
        step = max(1, REPACK_CHUNK_BYTES // row_bytes)
        for start in range(0, n, step):  # a few MiB of rows a call, each handed to `done` once repacked
            rows = min(step, n - start)
            chunk = blocks[start * row_bytes:(start + rows) * row_bytes]
            status = self.lib.dfa_repack(chunk.data_ptr(), qtype, rows, k, q[start].data_ptr(),
                                         _ptr(None if qh is None else qh[start]), d[start].data_ptr(), self.threads())
            if status:
                raise ValueError(f"dfa_repack refused GGML type {qtype} [{n}, {k}] ({status})")
            if done is not None:
                done(chunk)
        bits, offset, group, _ = REPACK_LAYOUTS[qtype]
        return IntMatrix(q, d, None, bits, group, qh, offset)

    def dequantize(self, w: IntMatrix, ids: torch.Tensor | None = None) -> torch.Tensor:
        """w [N, K] float32, bit for bit what the GGUF dequantization gives; or its rows ids [R] only."""
        rows = w.n
        if ids is not None:
            if ids.dim() != 1 or ids.device.type != "cpu":
                raise ValueError(f"row ids must be a 1-D CPU tensor, got shape {tuple(ids.shape)} on {ids.device}")
            ids = ids.to(torch.int64).contiguous()
            wanted = ids.tolist()
            rows = len(wanted)
            if rows and not 0 <= min(wanted) <= max(wanted) < w.n:  # C reads past no array
                raise IndexError(f"row {max(wanted) if max(wanted) >= w.n else min(wanted)} of a matrix of {w.n}")
        out = torch.empty(rows, w.k)
        self.lib.dfa_dequantize(w.q.data_ptr(), w.bits, _ptr(w.qh), w.offset, w.d.data_ptr(), w.scales, _ptr(w.m),
                                w.group, rows, w.k, _ptr(ids), out.data_ptr(), self.threads())
        return out


def _activations(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as C reads activations: [M, k] float32, contiguous, in CPU memory; converted where only the dtype or
    layout differs. C reads M * k floats from the pointer and knows no bounds, so a wrong width would read past x or
    leave outputs of garbage."""
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"activations of shape {tuple(x.shape)} against a matrix of {k} inputs")
    if x.device.type != "cpu":
        raise ValueError(f"the CPU kernels read CPU tensors, not {x.device} ones")
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    return x


def _require(t: torch.Tensor, what: str, dtype: torch.dtype, *shape: int | None) -> None:
    """A ValueError unless t is a contiguous CPU tensor of dtype and shape (None: any size on that axis): C reads it
    through a bare pointer."""
    if (t.dtype != dtype or t.device.type != "cpu" or t.dim() != len(shape) or not t.is_contiguous()
            or any(want is not None and want != got for want, got in zip(shape, t.shape))):
        wanted = ", ".join("*" if n is None else str(n) for n in shape)
        raise ValueError(f"{what} must be a contiguous CPU {dtype} tensor [{wanted}], got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _cpuinfo_lines() -> list[str] | None:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None


def cpu_flags() -> frozenset[str] | None:
    """The CPU's features as Linux names them in /proc/cpuinfo ("flags" on x86, "Features" on ARM; None: unknown
    here). Linux lists AVX features only where the OS also saves their registers (XCR0), so a listed flag is one a
    program may use."""
    for line in _cpuinfo_lines() or []:
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return None


def supports(variant: str, flags: frozenset[str] | None = None, machine: str | None = None) -> bool:
    """Whether this CPU (machine: platform.machine()) can run a prebuilt variant. Without /proc/cpuinfo, torch's own
    CPU dispatch says on x86 (it checks CPUID and XCR0 at run time, as ggml's variant scoring does); NEON is part of
    every aarch64 CPU (macOS has no /proc/cpuinfo)."""
    needs = VARIANTS[variant]
    if not needs:
        return True
    if (machine or platform.machine()).lower() not in MACHINES[variant]:
        return False
    flags = cpu_flags() if flags is None else flags
    if flags is None:  # torch's capability does not say whether AVX-512 comes with VNNI: v3 at most
        return variant == "aarch64_neon" or (variant == "x86_64_v3"
                                             and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))
    return needs <= flags


def prebuilt(variant: str) -> Path | None:
    """The library of a variant the package install built (setup.py), or None."""
    folder = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"_cpu_dot_{variant}{suffix}"
        if path.is_file():
            return path
    return None


# The structs of the ABI, numbered as dfa_abi and dfa_abi_field number them.
ABI_STRUCTS: tuple[type[ctypes.Structure], ...] = (Matrix, LayerWeights, LayerCache, Screen)


def library_fields(lib: ctypes.CDLL) -> list[dict[str, tuple[int, int]]]:
    """Each ABI struct's fields as the C library lays them out: name -> (offset, size)."""
    lib.dfa_abi_field.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
                                  ctypes.POINTER(ctypes.c_int64)]
    lib.dfa_abi_field.restype = ctypes.c_char_p
    layouts = []
    for s in range(len(ABI_STRUCTS)):
        offset, size, fields = ctypes.c_int64(), ctypes.c_int64(), {}
        while (name := lib.dfa_abi_field(s, len(fields), ctypes.byref(offset), ctypes.byref(size))) is not None:
            fields[name.decode()] = (offset.value, size.value)
        layouts.append(fields)
    return layouts


def abi_mismatches(layouts: list[dict[str, tuple[int, int]]],
                   structs: tuple[type[ctypes.Structure], ...] = ABI_STRUCTS) -> list[str]:
    """Every field where a ctypes mirror and the C layout disagree (missing on one side, another offset or size)."""
    bad = []
    for struct, c_fields in zip(structs, layouts, strict=True):
        ours = {name: (getattr(struct, name).offset, getattr(struct, name).size) for name, *_ in struct._fields_}
        for name in sorted(set(ours) | set(c_fields)):
            if name not in c_fields:
                bad.append(f"{struct.__name__}.{name} is not in the C struct")
            elif name not in ours:
                bad.append(f"{struct.__name__} lacks the C field {name}")
            elif ours[name] != c_fields[name]:
                bad.append(f"{struct.__name__}.{name} at offset {ours[name][0]} size {ours[name][1]}, C has "
                           f"offset {c_fields[name][0]} size {c_fields[name][1]}")
    return bad


def open_library(path: Path) -> CpuDot | None:
    """The library at path, if it loads and speaks this module's ABI (None, logged, when not)."""
    try:
        lib = ctypes.CDLL(str(path))
        abi = lib.dfa_abi
    except (OSError, AttributeError) as exc:
        log.warning("the CPU kernels in %s cannot be used (%s)", path, exc)
        return None
    abi.argtypes, abi.restype = [ctypes.c_int], ctypes.c_int64
    expected = {-1: ABI_VERSION, 0: ctypes.sizeof(Matrix), 1: ctypes.sizeof(LayerWeights), 2: ctypes.sizeof(LayerCache),
                3: ctypes.sizeof(Screen)}
    found = {which: abi(which) for which in expected}
    if found != expected:
        log.warning("the CPU kernels in %s were built from other sources (ABI %s, expected %s): not used",
                    path, found, expected)
        return None
    try:
        mismatches = abi_mismatches(library_fields(lib), ABI_STRUCTS)
    except AttributeError:
        mismatches = ["the library lists no fields (dfa_abi_field)"]
    if mismatches:
        log.warning("the CPU kernels in %s do not match their ctypes mirror (%s): not used", path,
                    "; ".join(mismatches))
        return None
    try:
        lib.dfa_source_digest.restype = ctypes.c_char_p
        built_from = lib.dfa_source_digest().decode()
        if built_from != source_digest():
            log.warning("the CPU kernels in %s are older than their sources beside them (built from %s, the files are "
                        "%s; an editable install rebuilds with `pip install -e .`): not used", path, built_from,
                        source_digest())
            return None
        return CpuDot(lib, path)
    except AttributeError as exc:  # an entry point missing
        log.warning("the CPU kernels in %s cannot be used (%s)", path, exc)
        return None


def load() -> CpuDot | None:
    """The CPU kernels as DFLASH_AGENT_CPU_DOT says (logged once; None: torch's kernels serve):
    - unset or `auto`: the best installed variant this CPU runs with vector code; else None (the scalar C path is
      slower than torch's);
    - a variant's name (`x86_64_v3`, `aarch64_neon`, `generic`; `native`: the build for the installing machine,
      made by an install run with DFLASH_AGENT_CPU_DOT=native): that library, whatever it runs (tests,
      comparisons);
    - `0`: None."""
    mode = os.environ.get(DISABLE_ENV, "auto") or "auto"
    if mode == "0":
        return None
    if mode in VARIANTS:
        path = prebuilt(mode)
        if path is None:
            log.warning("%s=%s: the package has no %s build of the CPU kernels (an install with %s=%s builds it): "
                        "using torch's kernels", DISABLE_ENV, mode, mode, DISABLE_ENV, mode)
            return None
        return open_library(path)
    if mode != "auto":
        log.warning("%s=%s is none of auto, 0, %s: taken as auto", DISABLE_ENV, mode, ", ".join(VARIANTS))
    vector = [variant for variant in MACHINES if supports(variant)]
    if not vector:
        log.info("no vector build of the CPU kernels for this CPU (%s): using torch's kernels", platform.machine())
        return None
    for variant in vector:
        path = prebuilt(variant)
        lib = open_library(path) if path is not None else None
        if lib is not None and lib.simd != "scalar":
            log.info("CPU kernels: the prebuilt %s build (%s)", variant, lib.simd)
            return lib
    log.warning("none of the CPU kernel builds this CPU runs (%s) is installed and loads (`pip install -e .` builds "
                "them): using torch's kernels", ", ".join(vector))
    return None
