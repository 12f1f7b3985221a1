"""GGUF weights that stay packed, so a 4-bit checkpoint costs about 4 bits a weight in memory and per token.

A `PackedWeight` stands where the model expects a [out, in] weight matrix of the compute dtype
(Linear.weight, the tied embedding / LM head) and supports exactly what the model does with one:
- `F.linear(x, w)`: kernels.triton.quant_matmul's Triton kernel on CUDA; on the CPU, packed kernels when the
  weight was repacked for them at load (`repack_for_cpu`, below), else the
  reference (dequantize to the compute dtype, then F.linear), which is bit-identical to dequantizing at load;
- `w[ids]`: the embedding rows of `ids`, dequantized from the GGUF blocks, exactly (blocks never straddle rows);
- a stack of matrices [experts, out, in] (a MoE layer's routed experts): `w[e]`, expert e's matrix, still packed,
  so a token reads only its chosen experts' blocks.
Anything else that would need the data (`.float()`, `.to()`, arithmetic) raises a TypeError instead of
silently expanding gigabytes.

CPU repacking (the fast default on the CPU), once at load:
- `CpuDotWeight`, kernels.cpu.cpu_dot's C kernels (built when the package installs): every format is rewritten
  as the integers it stores (`_int_groups`: w = d q + m per group of 32, or 16 for Q6_K), bit for bit; Q4_0 /
  Q4_K stay at 4 bits, Q5_0 / Q5_K at 5, Q6_K at 6, Q8_0 at 8. The scales stay as the file has them
  (kernels.cpu.cpu_dot.REPACK_LAYOUTS: the float16 ones of Q4_0 / Q5_0 / Q8_0, the K-quants' super-block headers
  and Q6_K's tails), so every format repacks at the file's own size, in one pass of C (CpuDot.repack).
  Activations are quantized to int16 per block of 32 (a relative error near 1e-5, where bf16 would be 4e-3),
  so the logits match the exact path's to within float rounding: no rescoring, and each row of a batch is
  computed alone (verify steps give what decode steps give, which keeps speculation lossless). Prompt blocks of
  GEMM_ROWS rows and more take GEMMs instead (EngineConfig's `prefill`, see prefill_dtype): int8 activations
  against the file's integers (CpuDot.gemm_int8, VNNI's byte dots), or on the rows dequantized exactly in float32
  (exact) or bfloat16; `bench --fidelity` measures what int8 and bfloat16 cost.
- Without the C kernels (no compiler at install), torch's weight-only kernels, both fast only with bf16 activations:
  `_weight_int4pack_mm_for_cpu` (tinygemm's layout: 4-bit quants q in groups of 32, each with a bf16 scale and
  zero, w = (q - 8) * scale + zero; Q4_0 and Q4_K map onto it exactly up to bf16 scales, 5- and 8-bit formats
  onto two planes) and `_weight_int8pack_mm` (int8 rows with one scale each, requantized from the exact
  dequantization, for Q6_K). The LM head takes the int4 kernel, and the RESCORE best logits of each row are
  recomputed exactly in float32 from the GGUF blocks, since 4 bits alone cost the head's top-1 agreement.
Rows of the embedding are always read exactly from the GGUF blocks.
`bench --fidelity` (bench.fidelity) measures what this costs against the exact path.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ...kernels.cpu.cpu_dot import CpuDot, IntMatrix, cpu_flags, supports
from ...kernels.cpu.cpu_dot import load as load_cpu_dot
from ...kernels.dispatch import PACKED_TYPES, TUNED_WEIGHTS, triton_runs
from ..formats.quant import (
    PackedTensor,
    bit_fields,
    bit_planes,
    dequantize,
    half_floats,
    k_scale_min,
    nibbles,
    q5_values,
)
from ..limits import GEMM_ROWS
from ..paths import default_cache_root

Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # torch.empty's shape and dtype
Done = Callable[[torch.Tensor], None]  # called on a run of a matrix's blocks once repacked

if TYPE_CHECKING:  # Triton is imported where its kernels run: a CPU-only install may lack it
    from ...kernels.triton.quant_matmul import TileChoice

RESCORE = 64  # LM-head candidates per position recomputed exactly after the int4 pass
GROUP = 32  # tinygemm's quant group along the input, the block of Q4_0 and the sub-block of Q4_K
_GEMM_SLICE_BYTES = 16 << 20  # dequantized float32 weights per GEMM: the LM head never expands whole
_ROWS_PER_CHUNK = 8192  # repack big matrices in row slices, so loading never expands one to float32 whole
# bfloat16 prompt GEMMs round their inputs: taken only where they beat float32's by this much on this machine
BF16_GAIN = 1.2
# what the int8 prompt GEMMs gain over float32's (Q4_K [4096, 1024] at 256 rows: 1.5-2.1x on an Emerald Rapids VM):
# where the VNNI build runs, bfloat16 is taken only where it measures more (AMX)
INT8_GAIN = 2.0

log = logging.getLogger(__name__)


@functools.cache
def cpu_dot() -> CpuDot | None:
    """The CPU dot kernels the install built, loaded once per process (None: none loads; torch's kernels serve)."""
    return load_cpu_dot()


def prefill_dtype(choice: str) -> torch.dtype:
    """The dtype of CpuDotWeight's prefill GEMMs for EngineConfig's `prefill` (engine.types.PREFILL). auto takes int8
    where the kernels' AVX-512 VNNI build runs (99.1% top-1 agreement with exact on the embedded model), bfloat16
    where the CPU multiplies it natively (AVX512_BF16 or AMX) and torch's bf16 GEMM is measured to beat float32's by
    BF16_GAIN (by INT8_GAIN where int8 runs), else float32, whose GEMMs are exact on the dequantized rows. The flags
    alone do not say it: oneDNN's bf16 GEMMs ran 2-3x float32's on a Zen 4 and 0.6x on an Emerald Rapids VM that hides
    AMX."""
    if choice == "auto":
        flags = cpu_flags() or frozenset()
        int8 = supports("x86_64_v4_vnni", flags)
        if flags & {"avx512_bf16", "amx_bf16"} and bfloat16_gemm_gain() >= (INT8_GAIN if int8 else BF16_GAIN):
            return torch.bfloat16
        return torch.int8 if int8 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[choice]


@functools.cache
def bfloat16_gemm_gain() -> float:
    """How many times faster torch multiplies bfloat16 than float32 here, at a prompt chunk's shape (256 rows of 1024
    against 1024 outputs, the best of 5 each, about 30 ms once per process); logged."""
    x, w = torch.randn(256, 1024), torch.randn(1024, 1024)

    def best_seconds(dtype: torch.dtype) -> float:
        a, b = x.to(dtype), w.to(dtype)
        a @ b  # oneDNN builds its kernel on the first call
        times = []
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    gain = best_seconds(torch.float32) / best_seconds(torch.bfloat16)
    log.info("bfloat16 GEMMs run %.2fx float32's here", gain)
    return gain


def products_in_c(weights: list[torch.Tensor]) -> bool:
    """Whether every product by these weights, however many rows, runs in the C kernels (int8 prefill GEMMs beside
    the multi-row ones), which compute each output on one thread: torch's GEMMs (oneDNN's, MKL's) may split a sum by
    the thread count, so their bits can change with it."""

    def in_c(w: torch.Tensor) -> bool:
        if not isinstance(w, PackedWeight):
            return False
        if w.experts is not None:
            return all(in_c(e) for e in w.experts)
        return isinstance(w.cpu, CpuDotWeight) and w.cpu.prefill == torch.int8

    return all(in_c(w) for w in weights)


def release_cpu_threads(device: torch.device) -> None:
    """End the OpenMP threads the calling thread's parallel regions kept (CpuDot.release_threads), where a model on
    `device` runs on the CPU kernels."""
    lib = cpu_dot() if device.type == "cpu" else None
    if lib is not None:
        lib.release_threads()


def keeps_packed(source: PackedTensor) -> bool:
    """Whether a checkpoint tensor can stay packed: a matrix of a type the kernel reads, or a stack of them (the
    routed experts of a MoE layer, [experts, out, in])."""
    return source.qtype in PACKED_TYPES and len(source.shape) in (2, 3)


class PackedWeight(torch.Tensor):
    """A [out, in] weight of dtype `dtype` whose data is `packed`'s GGUF blocks (see the module doc)."""

    packed: PackedTensor
    cpu: CpuDotWeight | CpuInt4 | CpuInt8 | None  # set by repack_for_cpu
    rescore: int  # the LM head: candidates per row recomputed exactly after the int4 pass (0: none)
    experts: list[PackedWeight] | None  # a stack's matrices, set by repack_for_cpu
    tile: TileChoice | None  # the Triton launch of steps of up to 16 rows, set by choose_cuda_tiles

    @staticmethod
    def __new__(cls, packed: PackedTensor, dtype: torch.dtype) -> PackedWeight:
        if not keeps_packed(packed):
            raise ValueError(f"a packed weight needs a matrix of {sorted(t.name for t in PACKED_TYPES)}, "
                             f"got {packed.qtype.name} {packed.shape}")
        raw = packed.raw.reshape(-1).view(torch.uint8)
        if not raw.is_contiguous():
            raw = raw.contiguous()
        self = torch.Tensor._make_wrapper_subclass(cls, packed.shape, dtype=dtype, device=raw.device)
        self.packed = PackedTensor(raw, packed.qtype, packed.shape)
        self.cpu = None
        self.rescore = 0
        self.experts = None  # a stack's matrices, each repacked for the CPU kernels (repack_for_cpu)
        self.tile = None
        return self

    def expert(self, index: int) -> PackedWeight:
        """Matrix `index` of a stack [experts, out, in], still packed (its blocks are a slice of the stack's), or as
        repacked for the CPU kernels."""
        if self.dim() != 3:
            raise TypeError("only a stack of packed matrices is indexed by an expert")
        if self.experts is not None:
            return self.experts[index]
        per_expert = self.packed.raw.numel() // self.shape[0]
        raw = self.packed.raw[index * per_expert:(index + 1) * per_expert]
        return PackedWeight(PackedTensor(raw, self.packed.qtype, tuple(self.shape[1:])), self.dtype)

    def __repr__(self) -> str:  # the default would try to print the values
        kernel = f", cpu={type(self.cpu).__name__}" if self.cpu is not None else ""
        return (f"PackedWeight({self.packed.qtype.name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}{kernel})")

    def repack_for_cpu(self, head: bool = False, prefill: torch.dtype = torch.float32,
                       empty: Empty | None = None, done: Done | None = None) -> None:
        """Repack once for the CPU kernels (see the module doc); head: the LM head, which torch's kernels
        take as int4 with the best RESCORE logits of each row recomputed exactly; prefill: the dtype of the C
        kernels' GEMMs on blocks of GEMM_ROWS rows and more (CpuDotWeight); empty: where the C kernels' matrices
        are allocated (torch.empty; at load, a HugePageArena); done: called on each run of blocks the C kernels'
        repacking has read (a load releases the file's pages there). The GGUF blocks stay for `rows`."""
        if self.device.type != "cpu":
            raise ValueError("repack_for_cpu needs a weight on the CPU")
        if self.dim() == 3:  # a stack of experts: each matrix on its own, as a token reads only its experts
            self.experts = [self.expert(i) for i in range(self.shape[0])]
            for matrix in self.experts:
                matrix.repack_for_cpu(prefill=prefill, empty=empty, done=done)
            return
        lib = cpu_dot()
        if lib is not None:  # exact, the head included: no rescoring
            self.cpu, self.rescore = CpuDotWeight.from_packed(lib, self.packed, prefill, empty, done), 0
            return
        if self.packed.qtype in PLANE_TYPES or head:
            self.cpu = CpuInt4.from_packed(self.packed)
        else:
            self.cpu = CpuInt8.from_packed(self.packed)
        self.rescore = min(RESCORE, self.shape[0]) if head else 0

    def _cpu_linear(self, x: torch.Tensor) -> torch.Tensor:
        assert self.cpu is not None
        y = self.cpu(x)
        if self.rescore:
            flat, out = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
            top = out.topk(self.rescore, dim=-1).indices  # [rows, RESCORE]
            exact = torch.einsum("rk,rck->rc", flat.float(), self.rows(top).float())
            out.scatter_(-1, top, exact.to(out.dtype))
        return y

    def linear(self, x: torch.Tensor, one_token_rows: int | None = None) -> torch.Tensor:
        """x @ W^T. one_token_rows: x holds several sequences' steps, this many one-token ones first (Triton only:
        kernels.triton.quant_matmul's, which computes each row as its sequence's step alone does)."""
        if self.cpu is not None and x.device.type == "cpu" and one_token_rows is None:
            return self._cpu_linear(x)
        if triton_runs(x):
            from ...kernels.triton.quant_matmul import quant_matmul

            return quant_matmul(x, self.packed.raw, self.packed.qtype, self.shape[0], one_token_rows, self.tile)
        if one_token_rows is not None:
            raise ValueError("only the Triton kernels multiply several sequences' steps at once")
        return F.linear(x, self.packed.dequantize(self.dtype))

    def expert_linear(self, x: torch.Tensor, rows: torch.Tensor, chosen: torch.Tensor,
                      single: bool) -> torch.Tensor | None:
        """y [P, out] with y[p] = x[rows[p]] @ W[chosen[p]]^T for a stack W [experts, out, in], every pair in one
        grouped launch (kernels.triton.quant_matmul.grouped_quant_matmul; single: no expert twice in `chosen`), where
        the Triton kernels run; None elsewhere, where the caller takes the experts one at a time."""
        if self.dim() != 3 or not triton_runs(x):
            return None
        from ...kernels.triton.quant_matmul import grouped_quant_matmul

        return grouped_quant_matmul(x, self.packed.raw, self.packed.qtype, self.shape[0], self.shape[1], rows,
                                    chosen, single)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[*ids.shape, in] in the weight's dtype."""
        if isinstance(self.cpu, CpuDotWeight) and ids.device.type == "cpu":
            return self.cpu.rows(ids).to(self.dtype)  # a decode step's embedding, faster than torch's gather
        block, type_size = GGML_QUANT_SIZES[self.packed.qtype]
        n, k = self.shape
        raw = self.packed.raw.view(n, k // block * type_size)[ids.reshape(-1)]
        return dequantize(raw, self.packed.qtype, (raw.shape[0], k)).to(self.dtype).reshape(*ids.shape, k)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], PackedWeight):
            if (len(args) > 2 and args[2] is not None) or kwargs.get("bias") is not None:
                raise TypeError("a packed GGUF weight has no bias")
            return args[1].linear(args[0])
        if func is torch.Tensor.__getitem__ and isinstance(args[0], PackedWeight):
            if args[0].dim() == 3 and isinstance(args[1], int):
                return args[0].expert(args[1])
            if not isinstance(args[1], torch.Tensor) or args[1].dtype not in (torch.long, torch.int):
                raise TypeError("a packed GGUF weight is indexed by a tensor of row ids only")
            return args[0].rows(args[1])
        # metadata (shape, dtype, device, ...) is answered by the wrapper; data access reaches
        # __torch_dispatch__ and fails there
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None) -> Any:
        raise TypeError(f"{func} on a packed GGUF weight: only F.linear(x, w) and w[ids] are supported")


TILE_TUNING_FILE = "kernel-tuning.json"  # under the cache root: kernels.triton.quant_tuning's choices, by GPU


def choose_cuda_tiles(matrices: Iterable[torch.Tensor], path: Path | None = None) -> None:
    """Give each packed CUDA matrix of `matrices` (those steps multiply by: GemmaModel.matmul_weights) of at least
    TUNED_WEIGHTS weights the decode / verification tile timed fastest on its GPU (kernels.triton.quant_tuning): each
    shape timed once, then read from `path` (default: TILE_TUNING_FILE under the cache root). A shape the GPU has no
    memory left to time keeps the default."""
    weights = [w for w in matrices if isinstance(w, PackedWeight) and w.dim() == 2 and w.is_cuda
               and w.shape.numel() >= TUNED_WEIGHTS]
    if not weights:
        return
    from ...kernels.triton.quant_tuning import TileTuning

    tuning = TileTuning.for_device(weights[0].device, path or default_cache_root() / TILE_TUNING_FILE)
    shapes = {(w.packed.qtype, *w.shape, w.dtype) for w in weights}
    untimed = sum(1 for qtype, n, k, dtype in shapes if not tuning.kept(qtype, n, k, dtype))
    if untimed:
        log.info("timing the decode tiles of %d matrix shapes on this GPU (once: kept in %s)", untimed,
                 tuning.path)
    chosen: dict[tuple, TileChoice | None] = {}
    try:
        for w in weights:
            key = (w.packed.qtype, *w.shape, w.dtype)
            if key not in chosen:
                try:
                    chosen[key] = tuning.choose(w.packed.raw, *key)
                except torch.cuda.OutOfMemoryError:
                    log.warning("no GPU memory left to time %s %s's tiles: the default serves", key[0].name,
                                list(w.shape))
                    chosen[key] = None
            w.tile = chosen[key]
    finally:
        torch.cuda.empty_cache()  # the timing's weight copies


def _row_slices(packed: PackedTensor, dequantized: bool = True):
    """(blocks, float32 [rows, in] exact dequantization or None) slices of a packed matrix."""
    block, type_size = GGML_QUANT_SIZES[packed.qtype]
    n, k = packed.shape
    raw = packed.raw.view(n, k // block * type_size)
    for start in range(0, n, _ROWS_PER_CHUNK):
        part = raw[start:start + _ROWS_PER_CHUNK]
        yield part, dequantize(part, packed.qtype, (part.shape[0], k)) if dequantized else None


U4_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_K})  # read at 4 bits by cpu_dot
U5_TYPES = frozenset({GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_K})  # and these at 5
U6_TYPES = frozenset({GGMLQuantizationType.Q6_K})  # and this at 6
# What makes the integers of `_int_groups` unsigned (u = q + offset) for the formats wider than 4 bits.
_UNSIGNED_OFFSET = {GGMLQuantizationType.Q5_0: 16, GGMLQuantizationType.Q8_0: 128, GGMLQuantizationType.Q5_K: 0}
PLANE_TYPES = U4_TYPES | frozenset(_UNSIGNED_OFFSET)


def _planes(blocks: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int) -> list[tuple]:
    """Blocks of n rows of a format on groups of 32 -> int4 planes [(q [n, k] int32 in 0..15, scale, zero
    [n, k / 32] float32)] whose sum of (q - 8) * scale + zero is the weight exactly (up to rounding scale and
    zero to bf16). A 4-bit format is one plane; a 5- or 8-bit one splits its unsigned quants u = low + 16 high
    into two, the second with 16 times the scale. Each zero is 0, 8 scale, or (K formats) 8 scale - dmin m, so
    bf16 rounding moves it by a fraction of a step at most."""
    q, d, m, _ = _int_groups(blocks, qtype, n, k)
    low_zero = 8 * d if m is None else 8 * d + m
    if qtype in U4_TYPES:
        return [(q, d, low_zero)]
    offset = _UNSIGNED_OFFSET[qtype]  # d q + m = d (u & 15) + 16 d (u >> 4) - d offset + m
    u = q + offset
    return [(u & 15, d, low_zero), ((u >> 4) + 8 - offset // 16, 16 * d, torch.zeros_like(d))]


def _fit_int4(w: torch.Tensor):
    """float32 [n, k] -> (q, scale, zero) of the same form, fitted to each group's min and max (scale and
    zero rounded to bf16 first, so the quants are chosen against the grid the kernel will use)."""
    n, k = w.shape
    groups = w.view(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15).to(torch.int32).view(n, k)
    return q, scale, zero


class CpuInt4:
    """tinygemm int4: y = sum over planes of x @ ((q - 8) * scale + zero)^T per group of 32 inputs, bf16
    activations (one plane, or two for 5- and 8-bit formats: see _planes)."""

    def __init__(self, planes: list[tuple[torch.Tensor, torch.Tensor]], out_features: int) -> None:
        self.planes, self.out_features = planes, out_features  # [(packed weight, [k / 32, n, 2] bf16)]

    @classmethod
    def from_packed(cls, packed: PackedTensor) -> CpuInt4:
        """Exact planes for PLANE_TYPES; any other format is fitted to one plane by each group's min and max."""
        n, k = packed.shape
        if k % GROUP:
            raise ValueError(f"int4 repacking needs rows of a multiple of {GROUP} values, got {k}")
        parts: list[list] = []
        for blocks, w in _row_slices(packed, dequantized=packed.qtype not in PLANE_TYPES):
            planes = _planes(blocks, packed.qtype, blocks.shape[0], k) if w is None else [_fit_int4(w)]
            parts.append([(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1),
                           torch.stack((scale, zero), dim=-1).to(torch.bfloat16)) for q, scale, zero in planes])
        planes = [(torch.cat([p[i][0] for p in parts]),
                   torch.cat([p[i][1] for p in parts]).transpose(0, 1).contiguous()) for i in range(len(parts[0]))]
        return cls(planes, n)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes + sz.nbytes for w, sz in self.planes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = None
        for weight, scale_zeros in self.planes:
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, weight, GROUP, scale_zeros).float()
            y = part if y is None else y.add_(part)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class CpuDotWeight:
    """A matrix repacked for kernels.cpu.cpu_dot (an IntMatrix): the integers and scales of its GGUF format
    (`_int_groups`), exactly; Q4_0 / Q4_K at 4 bits, Q5_0 / Q5_K at 5, Q6_K at 6, Q8_0 at 8. Blocks of GEMM_ROWS
    rows and more (prefill) take GEMMs in `prefill`: float32 or bfloat16 on the rows dequantized exactly, or int8
    (the activations quantized to int8 per block of 32 against the weight's own integers, CpuDot.gemm_int8)."""

    def __init__(self, lib: CpuDot, matrix: IntMatrix, prefill: torch.dtype = torch.float32) -> None:
        if prefill not in (torch.float32, torch.bfloat16, torch.int8):
            raise ValueError(f"prefill GEMMs run in float32, bfloat16 or int8, not {prefill}")
        self.lib, self.matrix, self.out_features, self.prefill = lib, matrix, matrix.n, prefill

    @classmethod
    def from_packed(cls, lib: CpuDot, packed: PackedTensor, prefill: torch.dtype = torch.float32,
                    empty: Empty | None = None, done: Done | None = None) -> CpuDotWeight:
        """The matrix's blocks repacked in one pass of C (CpuDot.repack; its tensors from `empty`, a HugePageArena's
        at load; `done` called on each run of blocks repacked)."""
        n, k = packed.shape
        if k % GROUP:
            raise ValueError(f"CPU dot repacking needs rows of a multiple of {GROUP} values, got {k}")
        return cls(lib, lib.repack(packed.raw, int(packed.qtype), n, k, empty, done), prefill)

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids of the weight, float32 [*ids.shape, in], dequantized exactly (as the GGUF blocks give them)."""
        return self.lib.dequantize(self.matrix, ids.reshape(-1)).view(*ids.shape, self.matrix.k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # reached from F.linear through PackedWeight.__torch_function__, which skips torch's own shape check
        if x.dim() == 0 or x.shape[-1] != self.matrix.k:
            raise ValueError(f"input of shape {tuple(x.shape)} against a weight of {self.matrix.k} inputs")
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] >= GEMM_ROWS:
            return self._gemm(flat.float()).to(x.dtype).view(*x.shape[:-1], self.out_features)
        y = self.lib.linear(flat, self.matrix)
        return (y if x.dtype == torch.float32 else y.to(x.dtype)).view(*x.shape[:-1], self.out_features)


    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows at once (prefill): int8 GEMMs on the packed weight, or GEMMs in self.prefill on rows dequantized
        exactly, at most a few MiB of them at a time."""
        if self.prefill == torch.int8:
            return self.lib.gemm_int8(x, self.matrix)
        x = x.to(self.prefill)
        step = max(1, _GEMM_SLICE_BYTES // (4 * x.shape[1]))
        if step >= self.out_features:
            return (x @ self._dequantized(0, self.out_features).T).float()
        y = torch.empty(x.shape[0], self.out_features)
        for start in range(0, self.out_features, step):
            end = min(start + step, self.out_features)
            y[:, start:end] = x @ self._dequantized(start, end).T
        return y

    def _dequantized(self, start: int, end: int) -> torch.Tensor:
        return self.lib.dequantize(self.matrix.rows(start, end)).to(self.prefill)


def _int_groups(blocks: torch.Tensor, qtype: GGMLQuantizationType, n: int,
                k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Blocks of n rows -> (q [n, k] int32, d, m or None [n, k / group], group) with w = d q + m exactly:
    the integers and scales each format stores (Q6_K scales runs of 16, the others runs of 32)."""
    T = GGMLQuantizationType
    blocks = blocks.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    group, m = GROUP, None
    if qtype in (T.Q4_0, T.Q5_0, T.Q8_0):
        d = half_floats(blocks[:, :2])
        if qtype == T.Q4_0:  # kept unsigned, the offset in m, so the kernel reads it at 4 bits
            q, m = nibbles(blocks[:, 2:], 16).reshape(-1, 32).to(torch.int32), -8 * d
        elif qtype == T.Q5_0:
            q = q5_values(blocks[:, 2:6], blocks[:, 6:]).to(torch.int32) - 16
        else:
            q = blocks[:, 2:].view(torch.int8).to(torch.int32)
    elif qtype in (T.Q4_K, T.Q5_K):
        super_d, dmin = half_floats(blocks[:, 0:2]), half_floats(blocks[:, 2:4])
        sc, mn = k_scale_min(blocks[:, 4:16])
        d, m = (super_d * sc.to(torch.float32)).reshape(-1, 1), (-dmin * mn.to(torch.float32)).reshape(-1, 1)
        if qtype == T.Q4_K:
            q = nibbles(blocks[:, 16:], 32).reshape(-1, 32).to(torch.int32)
        else:
            q = nibbles(blocks[:, 48:], 32).reshape(-1, 32).to(torch.int32) | \
                (bit_planes(blocks[:, 16:48], 32).reshape(-1, 32).to(torch.int32) << 4)
    elif qtype == T.Q6_K:
        group = 16
        d = (half_floats(blocks[:, 208:210]) * blocks[:, 192:208].view(torch.int8).to(torch.float32)).reshape(-1, 1)
        low = nibbles(blocks[:, :128], 64).reshape(-1, 8, 32)
        high = bit_fields(blocks[:, 128:192].reshape(-1, 2, 32), (0, 2, 4, 6), 0x03).reshape(-1, 8, 32)
        q = (low | (high << 4)).to(torch.int32) - 32
    else:
        raise ValueError(f"{qtype.name} has no integer groups for the CPU dot kernels")
    q = q.reshape(n, k)
    return q, d.reshape(n, k // group), None if m is None else m.reshape(n, k // group), group


class CpuInt8:
    """int8 rows with one bf16 scale each: y = (x @ q^T) * scale, bf16 activations."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        self.weight, self.scale = weight, scale

    @classmethod
    def from_packed(cls, packed: PackedTensor) -> CpuInt8:
        weights, scales = [], []
        for _, w in _row_slices(packed):
            scale = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).to(torch.bfloat16)
            weights.append(torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8))
            scales.append(scale)
        return cls(torch.cat(weights), torch.cat(scales))

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scale)
        return y.to(x.dtype).view(*x.shape[:-1], self.weight.shape[0])
