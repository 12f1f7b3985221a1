"""The engine's errors: what a caller can cause and fix. Torch-free, so a remote-only client can catch them.

Each is a ValueError, the kind the API layer answers with a 400 and the CLI with one line."""

from __future__ import annotations


class ConfigError(ValueError):
    """The checkpoint's configuration is missing something or describes an unsupported model."""


class GGUFError(ValueError):
    """A file that is not a readable GGUF; the message names the file."""


class UnsupportedTensorType(ValueError):
    """A GGUF tensor type this engine cannot dequantize; the message names it and the supported ones."""


class ModelLoadError(ValueError):
    """A model could not be found or read; the message says which file and why."""


class TokenizerError(ValueError):
    """The tokenizer files are missing, corrupt, or do not describe a tokenizer."""


class DrafterError(ValueError):
    """A drafter checkpoint we cannot load or that does not fit the target."""


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled; the message includes xgrammar's reason."""


class MemoryPlanError(ValueError):
    """A context length (or a model) that does not fit the GPU; the message says what would."""


class ContextOverflowError(ValueError):
    def __init__(self, needed: int, n_ctx: int) -> None:
        super().__init__(f"the sequence needs {needed} tokens but the context holds {n_ctx}")
        self.needed, self.n_ctx = needed, n_ctx
