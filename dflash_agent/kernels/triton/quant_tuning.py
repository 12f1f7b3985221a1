"""Each large packed matrix's decode / verification launch, chosen by timing on the GPU that runs it.

The tile that keeps enough weight bytes in flight depends on the card (an RTX 4090: 128 SMs and 1 TB/s; an H200: 132
SMs and 4.8 TB/s, 3x the registers' worth of loads to cover) and on the matrix (a down projection has a quarter of a
gate's output tiles): `launch_shape`'s one default, set without a GPU to time it, cannot be right for both. So, as
Triton's autotuner and vLLM's per-device MoE configs do, a matrix shape is timed once over the candidate tiles
(`tile_shapes`: output columns per program, warps, pipeline stages, blocks per K step) and K splits, and the fastest
is kept for every step of up to VERIFY_ROWS rows of that shape: one choice for 1 to 16 rows, so a row still comes out
as its step alone gives it. The cost timed is a decode row plus a 16-row verification block (what DFlash and several
slots run), inside a CUDA graph (a Triton launch's host cost is more than a small matrix's GEMV), over copies of the
weights that together outgrow the L2 cache, as a step's matrices do. Choices are kept in a JSON file keyed by the
device's name and SMs, torch's and Triton's versions and the kernel's source, so a model loads untimed the second
time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from ..capture import capture_graph
from ..dispatch import VERIFY_ROWS
from . import quant_matmul as qm
from . import triton_support

log = logging.getLogger(__name__)

SPLITS = (1, 2, 4, 8)
ROTATED_BYTES = 256 << 20  # weight copies timed in turn: several times an H200's 50 MB of L2
MAX_COPIES = 128
Cost = Callable[[qm.TileChoice], float]  # microseconds of a decode row plus a verification block
# what a candidate that does not fit this card raises: too much shared memory or too many registers to launch, a
# compile the backend refuses, or no memory left for its split's partial sums
UNFIT = (OutOfResources, CompilationError, torch.cuda.OutOfMemoryError)


def tile_shapes(qtype: GGMLQuantizationType) -> list[qm.LaunchShape]:
    """The 16-row tl.dot shapes timed: the default first (its time is the baseline the log reports)."""
    default = qm.launch_shape(VERIFY_ROWS, qtype)
    # K-quants step one super-block whatever `blocks` says: their candidates keep the default's
    blocks = (4, 8) if GGML_QUANT_SIZES[qtype][0] == 32 else (default.blocks,)
    shapes = [qm.LaunchShape(VERIFY_ROWS, bn, warps, nb, num_stages=stages)
              for bn in (32, 64, 128) for warps in (4, 8) for stages in (2, 3) for nb in blocks]
    return [default] + [s for s in shapes if s != default]


def choose_tile(qtype: GGMLQuantizationType, n: int, k: int, sms: int, cost: Cost) -> tuple[qm.TileChoice, dict]:
    """The cheapest TileChoice by `cost`, and what was measured ({"default_us", "best_us", "timed"}): every shape at
    its default split, then the fastest shape at every split K allows. A candidate whose cost raises (one that does
    not compile for this card) is skipped; when none runs, the default stands."""
    def timed(choice: qm.TileChoice) -> float:
        try:
            return cost(choice)
        except UNFIT as exc:  # not a candidate on this card; anything else is a bug, or a GPU in trouble
            log.debug("tile %s does not run: %s", choice, exc)
            return float("inf")

    candidates = [qm.TileChoice(shape, qm.default_split(qtype, n, k, shape, sms)) for shape in tile_shapes(qtype)]
    default = candidates[0]  # launch_shape's, untuned
    timed(default)  # once untimed first: clocks ramp up, and the baseline the log reports is timed warm
    times = {choice: timed(choice) for choice in candidates}
    best = min(times, key=times.__getitem__)
    steps = qm.k_steps(qtype, k, best.shape)
    for split in SPLITS:
        choice = qm.TileChoice(best.shape, split)
        if steps % split == 0 and choice not in times:
            times[choice] = timed(choice)
    best = min(times, key=times.__getitem__)
    if times[best] == float("inf"):
        best = default
    return best, {"default_us": times[default], "best_us": times[best], "timed": len(times)}


def graphed_ms(fn: Callable[[], None], calls: int = 4, replays: int = 5) -> float:
    """Milliseconds of GPU time one call of `fn` takes: `calls` of it captured in one CUDA graph (run eagerly
    first: capture_graph), replayed `replays` times; the median."""
    def step() -> None:
        for _ in range(calls):
            fn()

    graph, _ = capture_graph(step)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def graphed_cost(raw: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int, dtype: torch.dtype) -> Cost:
    """The cost of a TileChoice for the matrix in `raw` (packed, on CUDA): a decode row and a verification block
    against each of its copies in turn (ROTATED_BYTES of them, at most MAX_COPIES), microseconds per copy."""
    copies = [raw] + [raw.clone() for _ in range(min(MAX_COPIES, -(-ROTATED_BYTES // raw.numel())) - 1)]
    generator = torch.Generator(device=raw.device).manual_seed(0)
    xs = [torch.randn(m, k, device=raw.device, dtype=dtype, generator=generator) for m in (1, VERIFY_ROWS)]
    ys = [torch.empty(x.shape[0], n, device=raw.device, dtype=dtype) for x in xs]

    def cost(choice: qm.TileChoice) -> float:
        # every copy's decode row, then every copy's block: no launch reads what the one before it left in L2
        launches = [qm.quant_matmul_launch(x, w, qtype, y, tile=choice) for x, y in zip(xs, ys) for w in copies]

        def run() -> None:
            for launch in launches:
                launch()

        return graphed_ms(run) * 1e3 / len(copies)

    return cost


def _kept_choice(kept: object, qtype: GGMLQuantizationType, k: int) -> qm.TileChoice | None:
    """The TileChoice a tuning file's entry names, if it is one of tile_shapes' with a split K allows."""
    fields = ("block_n", "num_warps", "blocks", "num_stages", "split")
    if not isinstance(kept, dict) or any(type(kept.get(f)) is not int for f in fields):  # 64.0 or True: not a tile
        return None
    shape = qm.LaunchShape(VERIFY_ROWS, kept.get("block_n"), kept.get("num_warps"), kept.get("blocks"),
                           num_stages=kept.get("num_stages"))
    split = kept.get("split")
    if shape not in tile_shapes(qtype) or split not in SPLITS or qm.k_steps(qtype, k, shape) % split:
        return None
    return qm.TileChoice(shape, split)


def _read_choices(path: Path) -> dict:
    """A tuning file's entries ({} where there is none yet); ValueError where it is not a JSON object."""
    if not path.exists():
        return {}
    choices = json.loads(path.read_text())
    if not isinstance(choices, dict):
        raise ValueError("not a JSON object")
    return choices


def _kernel_source_hash() -> str:
    """The kernel's source and its compile options' (triton_support): a change to either times the tiles again."""
    digest = hashlib.sha256()
    for module in (qm, triton_support):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:12]


class TileTuning:
    """Tile choices for one GPU (its name and SM count; torch, Triton and the kernel's source), timed on first use of
    a matrix shape and kept in `path` (None: this process only)."""

    def __init__(self, device_name: str, sms: int, path: Path | None) -> None:
        self.sms, self.path = sms, path
        self.prefix = (f"{device_name}|{sms} SMs|torch {torch.__version__}|triton {triton.__version__}|"
                       f"{_kernel_source_hash()}")
        self.choices: dict[str, dict] = {}
        if path is not None:
            try:
                self.choices = _read_choices(path)
            except (OSError, ValueError) as exc:
                log.warning("ignoring the kernel tuning file %s (%s): tiles are timed again", path, exc)

    @classmethod
    def for_device(cls, device: torch.device, path: Path | None) -> TileTuning:
        properties = torch.cuda.get_device_properties(device)
        return cls(properties.name, properties.multi_processor_count, path)

    def _key(self, qtype: GGMLQuantizationType, n: int, k: int, dtype: torch.dtype) -> str:
        return f"{self.prefix}|{qtype.name}|{n}x{k}|{str(dtype).removeprefix('torch.')}"

    def kept(self, qtype: GGMLQuantizationType, n: int, k: int, dtype: torch.dtype) -> qm.TileChoice | None:
        """The choice kept for this shape, if there is a valid one."""
        key = self._key(qtype, n, k, dtype)
        return _kept_choice(self.choices[key], qtype, k) if key in self.choices else None

    def choose(self, raw: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int,
               dtype: torch.dtype, cost: Cost | None = None) -> qm.TileChoice:
        """The tile of the packed [n, k] matrix in `raw` with `dtype` activations: the kept one, or timed (by
        `cost`, default graphed_cost) and kept."""
        kept = self.kept(qtype, n, k, dtype)
        if kept is not None:
            return kept
        key = self._key(qtype, n, k, dtype)
        if key in self.choices:
            log.warning("the kernel tuning file's entry for %s is not a tile: timed again", key)
        choice, measured = choose_tile(qtype, n, k, self.sms, cost or graphed_cost(raw, qtype, n, k, dtype))
        if measured["best_us"] == float("inf"):  # nothing ran: the default, timed again at the next load
            log.warning("no tile of %s [%d, %d] could be timed on this GPU: the default serves", qtype.name, n, k)
            return choice
        shape = choice.shape
        log.info("%s [%d, %d]: tile of %d columns, %d warps, %d stages, %d blocks a step, K split %d: %.1f us "
                 "(default %.1f us; %d timed)", qtype.name, n, k, shape.block_n, shape.num_warps, shape.num_stages,
                 shape.blocks, choice.split, measured["best_us"], measured["default_us"], measured["timed"])
        self.choices[key] = {"block_n": shape.block_n, "num_warps": shape.num_warps, "num_stages": shape.num_stages,
                             "blocks": shape.blocks, "split": choice.split, **measured}
        self._save()
        return choice

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:  # another process (or GPU) may have kept its choices since this one read the file
                self.choices = {**_read_choices(self.path), **self.choices}
            except ValueError:  # not this process's to mend: replaced by what it knows
                pass
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            try:
                with os.fdopen(handle, "w") as file:
                    json.dump(self.choices, file, indent=1, sort_keys=True)
                os.replace(temporary, self.path)
            except BaseException:
                os.unlink(temporary)
                raise
        except OSError as exc:
            log.warning("could not keep the kernel tuning in %s (%s): the next load times again", self.path, exc)
