"""The engine's errors: what a caller can cause and fix. Torch-free, so a remote-only client can catch them.

Each is a `UserError` (a ValueError): the CLI prints it as one line."""

from __future__ import annotations

from ..errors import UserError


class ConfigError(UserError):
    """The checkpoint's configuration is missing something or describes an unsupported model."""


class GGUFError(UserError):
    """A file that is not a readable GGUF; the message names the file."""


class UnsupportedTensorType(UserError):
    """A GGUF tensor type this engine cannot dequantize; the message names it and the supported ones."""


class ModelLoadError(UserError):
    """A model could not be found or read; the message says which file and why."""


class TokenizerError(UserError):
    """The tokenizer files are missing, corrupt, or do not describe a tokenizer."""


class DrafterError(UserError):
    """A drafter checkpoint we cannot load or that does not fit the target."""


class GrammarError(UserError):
    """A schema or grammar that cannot be compiled; the message includes xgrammar's reason."""


class MemoryPlanError(UserError):
    """A context length (or a model) that does not fit the GPU; the message says what would."""


class ContextOverflowError(UserError):
    def __init__(self, needed: int, n_ctx: int) -> None:
        super().__init__(f"the sequence needs {needed} tokens but the context holds {n_ctx}")
        self.needed, self.n_ctx = needed, n_ctx


class OptionError(UserError):
    """An `EngineConfig` option this engine or machine cannot take (device, dtype, threads, KV cache type...)."""


class RequestError(UserError):
    """A generation request the engine cannot run: an empty prompt, a token outside the vocabulary, bad sampling."""
