"""A copy of a GGUF with recommended-sampling keys added, written by gguf-py's own `gguf_new_metadata` tool (what
llama.cpp's users run to edit a GGUF's metadata), so the engine reads them from a file nobody here wrote."""

from __future__ import annotations

from pathlib import Path

import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

# The values a Gemma checkpoint recommends (top_k 64, top_p 0.95), with a temperature and min_p of our own so that
# every field differs from every interface's fallback.
SAMPLING = {gguf.Keys.General.SAMPLING_TEMP: 0.6, gguf.Keys.General.SAMPLING_TOP_K: 64,
            gguf.Keys.General.SAMPLING_TOP_P: 0.95, gguf.Keys.General.SAMPLING_MIN_P: 0.05}
TYPES = {int: gguf.GGUFValueType.INT32, float: gguf.GGUFValueType.FLOAT32}


def with_sampling(src: Path, dst: Path, sampling: dict[str, float | int] = SAMPLING) -> Path:
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    new = {key: MetadataDetails(TYPES[type(value)], value) for key, value in sampling.items()}
    copy_with_new_metadata(reader, writer, new, remove_metadata=())
    return dst
