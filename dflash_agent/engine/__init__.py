"""The engine's public contract: what the layers above (chat, api, agent, mcp, bench, train) import.

```python
engine = Engine.from_config(EngineConfig(model="embedded", draft=None, ...))  # or Engine.load(model=..., ...)
request = GenerateRequest(prompt_ids, SamplingParams(...), StopCriteria(...))
result = await engine.complete(request)  # GenerateResult(text, ids, final: FinalEvent(finish_reason, usage, timings))
async with engine.stream(request) as events:  # leaving the block cancels the request
    async for event in events:
        ...  # TokenEvent(ids, text_delta) ... FinalEvent(finish_reason, usage, timings)
engine.cancel(request_id)
```

The request, event, error and option types are torch-free (`types.py`, `errors.py`, `engine_config.py`) and
load eagerly; `Engine`
and the other torch-backed names load on first use, so a remote-only client (`run --server`) that needs
only `Usage` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import UserError
from .engine_config import EMBEDDED, EngineConfig, SpecConfig
from .errors import (
    ConfigError,
    ContextOverflowError,
    DrafterError,
    GGUFError,
    GrammarError,
    MemoryPlanError,
    ModelLoadError,
    OptionError,
    RequestError,
    TokenizerError,
    UnsupportedTensorType,
)
from .types import (
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    GenerateResult,
    SamplingDefaults,
    SamplingParams,
    SlotInfo,
    SpecStats,
    StopCriteria,
    Timings,
    TokenEvent,
    Usage,
)

if TYPE_CHECKING:
    from .decode.grammar import GrammarCompiler, TokenGrammar
    from .engine import DEFAULT_CTX, Engine
    from .load.tokenizer import Tokenizer
    from .load.weights import default_drafter

# name -> the module that defines it; imported (with torch) when first asked for.
_LAZY = {
    "Engine": "engine",
    "DEFAULT_CTX": "engine",
    "Tokenizer": "load.tokenizer",
    "GrammarCompiler": "decode.grammar",
    "TokenGrammar": "decode.grammar",
    "default_drafter": "load.weights",
}

__all__ = [
    "ConfigError", "ContextOverflowError", "DrafterError", "GGUFError", "GrammarError", "MemoryPlanError",
    "ModelLoadError", "OptionError", "RequestError", "TokenizerError", "UnsupportedTensorType", "UserError",
    "ErrorEvent", "FinalEvent", "GenerateRequest", "GenerateResult", "SamplingDefaults", "SamplingParams", "SlotInfo",
    "SpecStats", "StopCriteria", "Timings", "TokenEvent", "Usage", "EngineConfig", "SpecConfig", "EMBEDDED",
    "Engine", "DEFAULT_CTX", "Tokenizer", "GrammarCompiler", "TokenGrammar", "default_drafter",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
