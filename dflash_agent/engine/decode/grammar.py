"""Token-level constrained decoding on top of xgrammar.

`GrammarCompiler` turns a JSON schema or an EBNF grammar into a `TokenGrammar` for one
tokenizer; `TokenGrammar.matcher()` gives each request its own `GrammarMatcher`, which the
decode loop uses to mask logits, advance on sampled tokens and roll back rejected drafts.

Special tokens. xgrammar matches tokens by their text. A control token such as
`<start_of_turn>` has text too, so a free-text rule (the inside of a JSON string) would happily
accept it. We therefore hand xgrammar an empty text for every special token of the tokenizer,
which makes it a token no grammar can produce -- except the ones a grammar names explicitly
with `Token(id)` (Gemma 4's `<|tool_call>`, `<|"|>`): those keep their text, in a tokenizer
view of their own. There are only ever a few such views (one per set of named tokens), each
with its own xgrammar compiler.

Nothing here knows about chat formats; `dflash_agent.chat.constraints` decides what to force.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable
from typing import Any

import torch
import xgrammar as xgr

from ..errors import GrammarError
from ..load.tokenizer import Tokenizer

__all__ = ["GrammarCompiler", "GrammarError", "GrammarMatcher", "TokenGrammar"]

log = logging.getLogger(__name__)

# Distinct grammars kept compiled per compiler; tool schemas repeat across an agent's turns.
DEFAULT_CACHE_SIZE = 64


class GrammarMatcher:
    """The grammar state of one generation.

    The decode loop calls `mask(logits)` before sampling and `accept(token)` after. Speculative
    decoding also runs a drafted block through it (mask and accept each draft token, stopping at
    the first the grammar refuses), rolls the block back, and then verifies: masks, accepts the
    tokens the target keeps, and rolls back the rest.

    Masks are kept per position along the current path of accepted tokens, so a position visited
    again after a rollback (verifying what was just drafted) costs no second fill; they are
    dropped once a different token is accepted before them, or once they fall out of rollback
    reach.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, stop_ids: Collection[int],
                 max_rollback: int) -> None:
        if max_rollback < 0:
            raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = vocab_size
        self._stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long)
        self._max_rollback = max_rollback
        self._rollbackable = 0  # accepted tokens that may still be rolled back
        self._pos = 0  # tokens accepted so far
        # position -> (bitmask [1, ceil(V / 32)], whether it allows every token)
        self._masks: dict[int, tuple[torch.Tensor, bool]] = {}
        self._taken: dict[int, int] = {}  # position -> the token accepted there on that path
        self._device_bitmask: torch.Tensor | None = None

    @property
    def is_terminated(self) -> bool:
        """The grammar has accepted a stop token: generation is over."""
        return self._matcher.is_terminated()

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of the tokens the grammar forbids now to -inf, in place.

        `logits`: [V] or [1, V] with V the model's vocabulary, float32/bf16/fp16, CPU or CUDA.
        Once the grammar is complete only the stop tokens remain (and whatever may still extend
        the output, for a grammar that can go on)."""
        if logits.shape[-1] != self._vocab_size or logits.dim() not in (1, 2) or (
            logits.dim() == 2 and logits.shape[0] != 1
        ):
            raise ValueError(f"logits of shape {tuple(logits.shape)}; expected [{self._vocab_size}] "
                             f"or [1, {self._vocab_size}]")
        if self.is_terminated:
            # xgrammar has no mask after termination; keep the contract "only stops allowed".
            stops = self._stop_ids.to(logits.device)
            kept = logits[..., stops].clone()
            logits.fill_(float("-inf"))
            logits[..., stops] = kept
            return
        bitmask, all_allowed = self._current()
        if all_allowed:
            return
        if logits.device.type != "cpu":
            if self._device_bitmask is None or self._device_bitmask.device != logits.device:
                self._device_bitmask = torch.empty_like(bitmask, device=logits.device)
            self._device_bitmask.copy_(bitmask)
            bitmask = self._device_bitmask
        xgr.apply_token_bitmask_inplace(logits.view(1, -1), bitmask, vocab_size=self._vocab_size)

    def accept(self, token: int) -> bool:
        """Advance by one token. False (and no change) if the grammar does not allow it here."""
        if self.is_terminated or not 0 <= token < self._vocab_size:
            return False
        bitmask, all_allowed = self._current()
        # Checked against the mask first: xgrammar logs a warning on stderr for every rejected
        # token, and rejecting drafted tokens is routine in speculative decoding.
        if not all_allowed and not (int(bitmask[0, token >> 5]) >> (token & 31)) & 1:
            return False
        if not self._matcher.accept_token(token):
            return False
        if self._taken.get(self._pos) != token:
            # A new branch: masks further along the old one no longer apply.
            self._masks = {p: m for p, m in self._masks.items() if p <= self._pos}
            self._taken = {p: t for p, t in self._taken.items() if p < self._pos}
            self._taken[self._pos] = token
        self._pos += 1
        self._rollbackable = min(self._rollbackable + 1, self._max_rollback)
        # Out of rollback reach for good.
        self._masks.pop(self._pos - self._max_rollback - 1, None)
        self._taken.pop(self._pos - self._max_rollback - 1, None)
        return True

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (at most `max_rollback`, and never past the start)."""
        if n < 0 or n > self._rollbackable:
            raise ValueError(f"cannot roll back {n} tokens; {self._rollbackable} can be rolled back")
        if n == 0:
            return
        self._matcher.rollback(n)
        self._rollbackable -= n
        self._pos -= n

    def _current(self) -> tuple[torch.Tensor, bool]:
        """The mask of the current state, filled on first use."""
        entry = self._masks.get(self._pos)
        if entry is None:
            bitmask = xgr.allocate_token_bitmask(1, self._vocab_size)
            entry = self._masks[self._pos] = (bitmask, not self._matcher.fill_next_token_bitmask(bitmask))
        return entry


class TokenGrammar:
    """A grammar compiled for one tokenizer and vocabulary; immutable and shareable between
    requests. Each generation takes its own `matcher()`."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, stop_ids: frozenset[int],
                 description: str) -> None:
        self._compiled = compiled
        self._vocab_size = vocab_size
        self._stop_ids = stop_ids
        self._description = description

    def __repr__(self) -> str:
        return f"TokenGrammar({self._description})"

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end a complete output."""
        return self._stop_ids

    def matcher(self, max_rollback: int = 32) -> GrammarMatcher:
        return GrammarMatcher(self._compiled, self._vocab_size, self._stop_ids, max_rollback)


class GrammarCompiler:
    """Compiles grammars for one tokenizer and model vocabulary, caching the results.

    `vocab_size` is the width of the model's logits, which may exceed the tokenizer's
    vocabulary (ids past the tokenizer are never allowed). A complete output may end with
    `tokenizer.stop_ids` or any of `extra_stop_ids`. Safe to use from several threads.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, extra_stop_ids: Iterable[int] = (),
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        stop_ids = frozenset(tokenizer.stop_ids) | frozenset(extra_stop_ids)
        bad = sorted(i for i in stop_ids if not 0 <= i < vocab_size)
        if bad:
            raise ValueError(f"stop id {bad[0]} is outside the vocabulary (size {vocab_size})")
        if not stop_ids:
            raise GrammarError("a grammar needs at least one stop token; the tokenizer has none")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = stop_ids
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[Hashable, TokenGrammar] = OrderedDict()
        self._compilers: dict[frozenset[int], xgr.GrammarCompiler] = {}
        self._encoded_vocab = _encoded_vocab(tokenizer, vocab_size)
        self._vocab_type = (xgr.VocabType.BYTE_FALLBACK if tokenizer.byte_fallback_ids
                            else xgr.VocabType.RAW)

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stop_ids

    def token_id(self, piece: str) -> int:
        """The id of the vocabulary entry spelled `piece` (`<|tool_call>`), for `Token(id)`."""
        token_id = self._tokenizer.token_id(piece)
        if token_id is None or token_id >= self._vocab_size:
            raise GrammarError(f"{piece!r} is not a single token of this tokenizer")
        return token_id

    def json_schema(self, schema: dict[str, Any], strict: bool = True) -> TokenGrammar:
        """Compact JSON (`", "` and `": "` separators, no other whitespace) valid for `schema`.
        `strict`: no properties or items beyond those the schema lists."""
        try:
            # Not sort_keys: property order is the order the output must follow.
            text = json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"the JSON schema is not serializable ({exc})") from exc
        return self._get(
            ("json_schema", text, strict),
            frozenset(),
            lambda c: c.compile_json_schema(text, any_whitespace=False, strict_mode=strict),
            "JSON schema",
        )

    def json_object(self) -> TokenGrammar:
        """Any JSON object, compact."""
        return self.json_schema({"type": "object"}, strict=False)

    def ebnf(self, text: str, root: str = "root", tokens: Collection[int] = ()) -> TokenGrammar:
        """An EBNF grammar in xgrammar's dialect (the GBNF of llama.cpp plus `Token(id)`).

        `tokens`: the special tokens the grammar names with `Token(id)`. They are matched as
        tokens; every other special token stays out of reach of the grammar's text rules."""
        named = frozenset(tokens)
        bad = sorted(i for i in named if not 0 <= i < self._vocab_size)
        if bad:
            raise GrammarError(f"token id {bad[0]} is outside the vocabulary (size {self._vocab_size})")
        return self._get(
            ("ebnf", text, root, named),
            named,
            lambda c: c.compile_grammar(text, root_rule_name=root),
            f"EBNF, root {root!r}",
        )

    def _get(self, key: Hashable, named: frozenset[int],
             compile_fn: Callable[[xgr.GrammarCompiler], xgr.CompiledGrammar],
             description: str) -> TokenGrammar:
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            compiler = self._compiler(named)
        try:
            compiled = compile_fn(compiler)
        except Exception as exc:  # xgrammar raises RuntimeError / InvalidJSONError with its reason
            raise GrammarError(f"invalid {description}: {_xgrammar_message(exc)}") from exc
        grammar = TokenGrammar(compiled, self._vocab_size, self._stop_ids, description)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _compiler(self, named: frozenset[int]) -> xgr.GrammarCompiler:
        """The xgrammar compiler for the tokenizer view in which exactly the special tokens in
        `named` keep their text (caller holds the lock)."""
        compiler = self._compilers.get(named)
        if compiler is None:
            vocab = list(self._encoded_vocab)
            for token_id in named:
                vocab[token_id] = self._tokenizer.id_to_piece(token_id)
            info = xgr.TokenizerInfo(vocab, self._vocab_type, vocab_size=self._vocab_size,
                                     stop_token_ids=sorted(self._stop_ids), add_prefix_space=False)
            # Our LRU above is the cache; xgrammar's own would grow without bound.
            compiler = self._compilers[named] = xgr.GrammarCompiler(info, cache_enabled=False)
            log.debug("grammar tokenizer view with %d named special tokens", len(named))
        return compiler


def _encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """Pieces by id, as xgrammar expects them (SentencePiece spelling: `▁`, `<0x0A>`), with
    special tokens and ids the tokenizer lacks left empty, which xgrammar never matches. Gemma
    tokenizers never prepend a space, hence `add_prefix_space=False` above."""
    vocab = [""] * vocab_size
    for piece, token_id in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            vocab[token_id] = piece
    for token_id in tokenizer.special_ids:
        if token_id < vocab_size:
            vocab[token_id] = ""
    return vocab


def _xgrammar_message(exc: Exception) -> str:
    # xgrammar prefixes C++ errors with "[time] /path/file.cc:line: "; keep the reason.
    message = str(exc).strip()
    first, _, rest = message.partition(": ")
    return rest if first.startswith("[") and ".cc:" in first and rest else message
