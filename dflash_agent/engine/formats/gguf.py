"""A fast GGUF reader: metadata as plain values, tensors as zero-copy views of a memory map.

gguf-py's GGUFReader builds a numpy view per array element, which costs ~12 s on a Gemma vocabulary of
262,144 tokens at every start; this parser reads the same header in well under a second. gguf-py stays the
source of the type constants and block sizes, and the reference in tests.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import GGUFError

_MAGIC = b"GGUF"
_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType | int  # an int when gguf-py does not know the type
    shape: tuple[int, ...]  # torch order (GGUF lists dimensions innermost first)
    data: np.ndarray  # uint8 view of the packed bytes


@dataclass
class GGUFFile:
    path: Path
    fields: dict[str, Any]  # numeric arrays as numpy arrays, string arrays as lists
    tensors: dict[str, GGUFTensor]
    # Byte range of each metadata entry in the file, from its key's length prefix to the end of its value:
    # what a cache keyed by the raw metadata (the tokenizer's) hashes.
    field_spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    mapping: np.memmap | None = None  # the file, mapped: what the tensors' data are views of

    def _pages(self, view: Any, inside: bool) -> tuple[int, int] | None:
        """The page-aligned byte range of `view` (a torch view of `mapping`) in `mapping` (inside: the pages wholly
        within it; else all it touches), None off a mapping."""
        if self.mapping is None:
            return None
        start = view.data_ptr() - self.mapping.ctypes.data
        end, page = start + view.nbytes, mmap.PAGESIZE
        first = -(-start // page) * page if inside else start // page * page
        last = end // page * page if inside else min(-(-end // page) * page, self.mapping.shape[0])
        return (first, last) if 0 <= first < last <= self.mapping.shape[0] else None

    def read_ahead(self, view: Any) -> None:
        """Ask the kernel to start reading the pages of `view` from disk now (MADV_WILLNEED), so a load that
        computes on one tensor meanwhile finds the next one's in memory."""
        span = self._pages(view, inside=False)
        if span is not None and hasattr(mmap, "MADV_WILLNEED"):
            self.mapping._mmap.madvise(mmap.MADV_WILLNEED, span[0], span[1] - span[0])

    def release(self, view: Any) -> None:
        """Hand the mapped pages of `view` (a tensor's data, a torch view of `mapping`) back: the file stays
        mapped and a later read pages it in again, but a load that has repacked a tensor no longer holds its blocks
        in memory beside the copy. Only the pages wholly inside the view go (neighbours share the others)."""
        span = self._pages(view, inside=True)
        if span is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping._mmap.madvise(mmap.MADV_DONTNEED, span[0], span[1] - span[0])


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFError(f"{self.path}: truncated GGUF header") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """count length-prefixed strings in a row: a vocabulary's 262,144 pieces, read in one tight loop."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        unpack, append = struct.Struct("<Q").unpack_from, out.append
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > end:
                    raise GGUFError(f"{self.path}: truncated GGUF header")
                append(str(buf[pos:pos + n], "utf-8", "replace"))
                pos += n
        except struct.error:
            raise GGUFError(f"{self.path}: truncated GGUF header") from None
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
            if etype == GGUFValueType.STRING:
                return self.strings(count)
            if etype == GGUFValueType.ARRAY:
                return [self.value(etype) for _ in range(count)]
            dtype = np.dtype(_SCALARS[etype])
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise GGUFError(f"{self.path}: truncated GGUF header")
            arr = np.frombuffer(self.buf[self.pos : end], dtype=dtype).copy()
            self.pos = end
            return arr.astype(bool) if etype == GGUFValueType.BOOL else arr
        return self.unpack(_SCALARS[vtype])


def read_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    try:
        data = np.memmap(path, mode="c")
    except FileNotFoundError:
        raise GGUFError(f"{path} not found") from None
    except (OSError, ValueError) as exc:
        raise GGUFError(f"{path} could not be read ({exc})") from None
    cur = _Cursor(memoryview(data), path)
    if bytes(data[:4]) != _MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2, 3)")
    n_tensors, n_fields = cur.unpack("<Q"), cur.unpack("<Q")
    fields: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    try:
        for _ in range(n_fields):
            start = cur.pos
            key = cur.string()
            fields[key] = cur.value(cur.unpack("<I"))
            spans[key] = (start, cur.pos)
    except ValueError as exc:  # an unknown value type
        raise GGUFError(f"{path}: corrupt GGUF metadata ({exc})") from None
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        infos.append((name, cur.unpack("<I"), tuple(reversed(dims)), cur.unpack("<Q")))
    alignment = int(fields.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, type_id, shape, offset in infos:
        try:
            qtype: GGMLQuantizationType | int = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
        except (ValueError, KeyError):
            qtype, nbytes = type_id, 0  # unknown type: the loader reports it by name
        begin = start + offset
        if begin + nbytes > data.shape[0]:
            raise GGUFError(f"{path}: tensor {name} lies past the end of the file (truncated download?)")
        tensors[name] = GGUFTensor(name, qtype, shape, data[begin : begin + nbytes])
    return GGUFFile(path, fields, tensors, spans, data)
