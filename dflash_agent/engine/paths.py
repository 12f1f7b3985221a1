"""Where the engine keeps what it derives from a model (tokenizer, kernel tuning, repacked weights)."""

from __future__ import annotations

import os
from pathlib import Path

_CACHE_ENV = "DFLASH_AGENT_CACHE"


def default_cache_root() -> Path:
    """`$DFLASH_AGENT_CACHE`, else `~/.cache/dflash-agent`."""
    env = os.environ.get(_CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash-agent"
