"""A checkpoint's recommended sampling: `generation_config.json` beside Hugging Face weights (what vLLM's
`--generation-config auto` reads) or a GGUF's `general.sampling.*` keys (what llama.cpp reads).

Only the fields SamplingParams has are taken (temperature, top_k, top_p, min_p). transformers' `do_sample` decides
the temperature where the file sets it: `false` means greedy (temperature 0, as `generate()` does), `true` without a
temperature means transformers' own 1.0; a file without `do_sample` is read field by field, as vLLM reads it. A value
out of range is left out with a warning rather than refusing a model that otherwise loads."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import Keys

from ..errors import ModelLoadError, RequestError
from ..types import SamplingDefaults, SamplingParams

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
_FIELDS = ("temperature", "top_k", "top_p", "min_p")
_GGUF_KEYS = {Keys.General.SAMPLING_TEMP: "temperature", Keys.General.SAMPLING_TOP_K: "top_k",
              Keys.General.SAMPLING_TOP_P: "top_p", Keys.General.SAMPLING_MIN_P: "min_p"}
# Recommendations this engine has no sampler for, and the value at which they do nothing.
_UNSUPPORTED = {"repetition_penalty": 1.0, Keys.General.SAMPLING_PENALTY_REPEAT: 1.0}


def read_sampling_defaults(path: Path, gguf_fields: Mapping[str, Any] | None = None) -> SamplingDefaults:
    """The defaults of the checkpoint at `path`: a GGUF's (its parsed `gguf_fields`), else an HF directory's."""
    if gguf_fields is not None:
        raw = {name: gguf_fields[key] for key, name in _GGUF_KEYS.items() if key in gguf_fields}
        for name, value in raw.items():
            if isinstance(value, float):  # stored as float32: its shortest decimal (0.95, not 0.949999988)
                raw[name] = float(str(np.float32(value)))
        # llama.cpp: top_k <= 0 is the whole vocabulary, temp <= 0 greedy.
        if isinstance(raw.get("top_k"), int) and raw["top_k"] < 0:
            raw["top_k"] = 0
        if isinstance(raw.get("temperature"), (int, float)) and raw["temperature"] < 0:
            raw["temperature"] = 0.0
        return _checked(raw, gguf_fields, f"general.sampling.* of {path.name}")
    file = path / GENERATION_CONFIG
    if not path.is_dir() or not file.is_file():
        return SamplingDefaults()
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file} is not a JSON object")
    raw = {name: config[name] for name in _FIELDS if config.get(name) is not None}
    if config.get("do_sample") is False:
        raw["temperature"] = 0.0
    elif config.get("do_sample") is True and "temperature" not in raw:
        raw["temperature"] = 1.0
    return _checked(raw, config, str(file))


def _checked(raw: dict[str, Any], everything: Mapping[str, Any], source: str) -> SamplingDefaults:
    values: dict[str, Any] = {}
    for name, value in raw.items():
        wanted = int if name == "top_k" else float
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (wanted is int and value != int(value)):
            log.warning("%s: ignoring %s %r (not %s)", source, name, value,
                        "an integer" if wanted is int else "a number")
            continue
        try:
            SamplingParams(**{name: wanted(value)})  # its range checks
        except RequestError as exc:
            log.warning("%s: ignoring %s", source, exc)
            continue
        values[name] = wanted(value)
    for key, neutral in _UNSUPPORTED.items():
        if isinstance(everything.get(key), (int, float)) and everything[key] != neutral:
            log.warning("%s: %s %.7g is not supported; sampling without it", source, key, everything[key])
    return SamplingDefaults(**values, source=source) if values else SamplingDefaults()
