"""Gemma 3 / Gemma 4 tokenizer on top of the Rust `tokenizers` library.

Two sources:

* a Hugging Face model directory (`tokenizer.json` plus the optional config files that
  say which ids are BOS/EOS/PAD and which extra ids end a turn);
* a GGUF file. A GGUF has no `tokenizer.json`, only llama.cpp metadata
  (`tokenizer.ggml.*`). We let transformers' own GGUF converter build the fast tokenizer
  once -- the same code `AutoTokenizer.from_pretrained(..., gguf_file=...)` runs, so ids
  agree with the reference -- and cache the resulting `tokenizer.json`. Conversion costs
  seconds plus importing transformers; a cache hit only hashes the GGUF's tokenizer metadata
  (parsed by `engine.formats.gguf.read_gguf`, usually already done by the weight loader) and parses
  the cached json.

`IncrementalDetokenizer` turns a stream of ids into text without ever emitting half a
UTF-8 character.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import tokenizers

from ..errors import TokenizerError
from ..formats.gguf import GGUFError, GGUFFile, read_gguf
from ..paths import default_cache_root

__all__ = ["IncrementalDetokenizer", "SpecialTokens", "Tokenizer", "TokenizerError"]

log = logging.getLogger(__name__)

# Bump when the cached layout or the way special ids are derived changes: old entries are
# then simply never looked up again.
_CACHE_FORMAT = 2
_TOKENIZER_JSON = "tokenizer.json"
_SPECIALS_JSON = "special_tokens.json"

# llama.cpp recognises Gemma 3's `<end_of_turn>` and Gemma 4's `<turn|>` by their text as end-of-generation tokens,
# because Gemma GGUFs store a single `eos_token_id` (<eos>) while the instruction-tuned checkpoints end every
# assistant turn with one of them (their generation_config lists [1, 106]). Without it an -it model run from a GGUF
# would talk straight past its turn.
_END_OF_TURN = ("<end_of_turn>", "<turn|>")
# The GGUF keys whose ids should stop generation besides eos.
_GGUF_EXTRA_STOP_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")



@dataclass(frozen=True)
class SpecialTokens:
    """The ids the engine needs to know about; `None` where the checkpoint has none."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    stop_ids: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"format": _CACHE_FORMAT, **asdict(self), "stop_ids": list(self.stop_ids)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpecialTokens:
        if data.get("format") != _CACHE_FORMAT:
            raise ValueError(f"cache format {data.get('format')!r}, expected {_CACHE_FORMAT}")
        return cls(
            bos_id=_opt_int(data["bos_id"]),
            eos_id=_opt_int(data["eos_id"]),
            pad_id=_opt_int(data["pad_id"]),
            unk_id=_opt_int(data["unk_id"]),
            stop_ids=tuple(int(i) for i in data["stop_ids"]),
        )


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


class Tokenizer:
    """A loaded tokenizer. Build with `from_dir` or `from_gguf`."""

    def __init__(self, backend: tokenizers.Tokenizer, specials: SpecialTokens, source: str) -> None:
        # The engine handles BOS itself and never wants a silently truncated or padded prompt,
        # whatever the tokenizer.json asked for.
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self._specials = specials
        self._source = source
        added = backend.get_added_tokens_decoder()
        named = (specials.bos_id, specials.eos_id, specials.pad_id, specials.unk_id)
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special) | frozenset(
            i for i in named if i is not None
        )
        self._stop_ids = frozenset(specials.stop_ids)
        # The spellings `encode` reads as special tokens, to find them in text that must stay text.
        self._special_pieces = {tok.content: i for i, tok in added.items() if tok.special and tok.content}
        self._special_lengths = sorted({len(p) for p in self._special_pieces}, reverse=True)
        firsts = "".join(sorted({p[0] for p in self._special_pieces}))
        self._special_start = re.compile(f"[{re.escape(firsts)}]") if firsts else None
        # Byte-fallback pieces (`<0xE4>`) are looked up by name rather than by scanning the
        # 262k-entry vocabulary.
        self._byte_ids = frozenset(
            i for i in (backend.token_to_id(f"<0x{b:02X}>") for b in range(256)) if i is not None
        )

    def __repr__(self) -> str:
        return f"Tokenizer(source={self._source!r}, vocab_size={self.vocab_size})"

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load `tokenizer.json` from a Hugging Face model directory.

        BOS/EOS/PAD come from tokenizer_config.json or special_tokens_map.json, falling back
        to the ids in generation_config.json / config.json. `stop_ids` is eos plus every
        `eos_token_id` listed there (Gemma 4: `[1, 106, 50]`).
        """
        root = Path(path)
        tok_file = root / _TOKENIZER_JSON
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file}: missing; a tokenizer directory needs a tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises a bare Exception on bad json
            raise TokenizerError(f"{tok_file}: not a valid tokenizer.json ({exc})") from exc

        tok_config = _read_optional_json(root / "tokenizer_config.json")
        special_map = _read_optional_json(root / "special_tokens_map.json")
        gen_config = _read_optional_json(root / "generation_config.json")
        model_config = _read_optional_json(root / "config.json")
        # Multimodal Gemma configs keep the language model's ids under text_config.
        text_config = model_config.get("text_config") or {}
        id_sources = (gen_config, model_config, text_config)

        def resolve(name: str, default_piece: str) -> int | None:
            for source in (tok_config, special_map):
                piece = _token_content(source.get(f"{name}_token"))
                if piece is not None and (token_id := backend.token_to_id(piece)) is not None:
                    return token_id
            for source in id_sources:
                ids = _id_list(source.get(f"{name}_token_id"))
                if ids:
                    return ids[0]
            # Last resort: Gemma's own spelling, for a bare tokenizer.json.
            return backend.token_to_id(default_piece)

        eos_id = resolve("eos", "<eos>")
        extra_eos = [i for source in id_sources for i in _id_list(source.get("eos_token_id"))]
        specials = SpecialTokens(
            bos_id=resolve("bos", "<bos>"),
            eos_id=eos_id,
            pad_id=resolve("pad", "<pad>"),
            unk_id=resolve("unk", "<unk>"),
            stop_ids=_stop_tuple(backend, [eos_id, *extra_eos], tok_file),
        )
        return cls(backend, specials, str(root))

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike[str],
        gguf: GGUFFile | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> Tokenizer:
        """Build from a GGUF's `tokenizer.ggml.*` metadata, converting once and caching.

        `gguf`: the same file as already parsed by `read_gguf` (the weight loader has it);
        without it the header is parsed here.
        `cache_dir`: cache root, default `default_cache_root()`. Entries are keyed by a hash
        of the tokenizer metadata bytes (plus the transformers version that converted them),
        so quantizations of one model share an entry and a changed file never hits a stale one.
        """
        gguf_path = Path(path)
        if gguf is None:
            try:
                gguf = read_gguf(gguf_path)
            except GGUFError as exc:  # its messages start with the path
                raise TokenizerError(str(exc)) from exc
        root = Path(cache_dir) if cache_dir is not None else default_cache_root()
        entry = root / "tokenizers" / _gguf_cache_key(gguf)

        cached = _load_cache_entry(entry, gguf_path)
        if cached is not None:
            backend, specials = cached
            log.debug("tokenizer for %s loaded from cache %s", gguf_path, entry)
            return cls(backend, specials, str(gguf_path))

        started = time.perf_counter()
        backend = _convert_gguf_tokenizer(gguf_path)
        specials = _gguf_specials(backend, gguf.fields, gguf_path)
        log.info(
            "converted the tokenizer of %s in %.1f s; caching it in %s",
            gguf_path,
            time.perf_counter() - started,
            entry,
        )
        _write_cache_entry(entry, backend, specials)
        return cls(backend, specials, str(gguf_path))

    # --- encoding -----------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True, plain_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of `text`. Special tokens spelled in the text (`<start_of_turn>`) become
        their ids, except inside `plain_spans` (sorted, disjoint character spans), where they are
        read as the text they spell: a chat prompt passes the spans its messages wrote there, so
        only the template's own structure makes control tokens. BOS is prepended unless the text
        already starts with it, since chat templates usually write `<bos>` themselves and a
        doubled BOS degrades Gemma."""
        # encode_batch releases the GIL and encode does not: a long text tokenized in a thread must not
        # stall the thread running the server's event loop (same ids).
        encoding = self._backend.encode_batch([text], add_special_tokens=False)[0]
        ids = encoding.ids
        if plain_spans:
            ids = self._defuse(text, ids, encoding.offsets, plain_spans)
        bos = self._specials.bos_id
        # Checked on the ids, not the text: if "<bos>" were not a special token it would be
        # split into ordinary pieces and the model would still need a real BOS.
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def find_special_pieces(self, text: str) -> list[tuple[int, int]]:
        """Character spans of `text` that `encode` would read as special tokens: leftmost first,
        longest at each place, as the tokenizer matches them."""
        spans: list[tuple[int, int]] = []
        if self._special_start is None:
            return spans
        pieces, lengths, search = self._special_pieces, self._special_lengths, self._special_start.search
        pos = 0
        while (found := search(text, pos)) is not None:
            start = found.start()
            end = next((start + n for n in lengths if text[start:start + n] in pieces), None)
            if end is None:
                pos = start + 1
            else:
                spans.append((start, end))
                pos = end
        return spans

    def _defuse(self, text: str, ids: list[int], offsets: list[tuple[int, int]],
                plain_spans: Sequence[tuple[int, int]]) -> list[int]:
        """`ids` with each special token that lies inside a plain span replaced by its text's
        ordinary pieces. The tokenizer splits the text at every special token before the model
        sees it, so the tokens around one are the same whether it is special or not."""
        starts = [start for start, _ in plain_spans]
        special = set(self._special_pieces.values())
        out: list[int] = []
        for token, (start, end) in zip(ids, offsets):
            k = bisect_right(starts, start) - 1
            if token in special and k >= 0 and end <= plain_spans[k][1]:
                out.extend(self._encode_literal(text[start:end]))
            else:
                out.append(token)
        return out

    def _encode_literal(self, text: str) -> list[int]:
        """Ordinary pieces for `text`, special spellings included: each one is cut after its
        first character, which breaks that match (the rest is searched again)."""
        ids: list[int] = []
        pos = 0
        for start, end in self.find_special_pieces(text):
            ids += self._plain(text[pos:start]) + self._plain(text[start]) + self._encode_literal(text[start + 1:end])
            pos = end
        return ids + self._plain(text[pos:])

    def _plain(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, id: int) -> str:
        """The vocabulary entry for `id` (SentencePiece spelling, e.g. `▁hello`, `<0x0A>`)."""
        piece = self._backend.id_to_token(id) if id >= 0 else None
        if piece is None:
            raise IndexError(f"token id {id} is outside the vocabulary (size {self.vocab_size})")
        return piece

    def token_id(self, piece: str) -> int | None:
        return self._backend.token_to_id(piece)

    @functools.cached_property
    def longest_piece(self) -> int:
        """The most characters one token spells: a text of n characters has at least n / this many tokens, which
        bounds a prompt before it is tokenized (a 60 MB one took 90 s and 8 GB to tokenize)."""
        return max(1, max(len(self.id_to_piece(i)) for i in range(self.vocab_size)))

    # --- properties ---------------------------------------------------------------------

    @property
    def bos_id(self) -> int | None:
        return self._specials.bos_id

    @property
    def eos_id(self) -> int | None:
        return self._specials.eos_id

    @property
    def pad_id(self) -> int | None:
        return self._specials.pad_id

    @property
    def unk_id(self) -> int | None:
        return self._specials.unk_id

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation: eos plus the checkpoint's end-of-turn ids."""
        return self._stop_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of special tokens: the ones `skip_special_tokens=True` drops, plus bos/eos/pad/unk."""
        return self._special_ids

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of the `<0xXX>` byte tokens (empty for a tokenizer without byte fallback)."""
        return self._byte_ids

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`, for batch calls and offsets."""
        return self._backend


class IncrementalDetokenizer:
    """Streams text for a growing id sequence, emitting only complete characters.

    `"".join(push(...) for each chunk) + flush() == tokenizer.decode(all ids)`.

    Each push decodes only a short window: the last emitted token, kept as left context,
    then everything up to the newest safe boundary; the left context's own text is cut off
    again. That is the prefix-offset scheme of vLLM / TextStreamer (the left context keeps
    decoders that treat a sequence's first token specially in agreement with a full decode),
    made exact for byte fallback: the `ByteFallback` decoder decodes a run of consecutive
    `<0xXX>` tokens as one unit and turns the *whole* run into U+FFFD if it is not valid
    UTF-8, so an invalid byte arriving later can rewrite characters that already looked
    complete. Text is therefore only emitted up to a token that closes any byte run before
    it (a non-byte token that the decode keeps), and such a token is also a safe place to
    start the next window. Text ending in U+FFFD waits too, which covers byte-level BPE
    tokenizers mid-character. Cost per push: the new ids plus any still-open byte run.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # the window: left context, then ids not yet emitted
        self._read = 0  # _ids[:_read] has been emitted
        self._prefix_len = 0  # len(decode(_ids[:_read]))

    def push(self, ids: Sequence[int]) -> str:
        """Add ids; return the text they completed (possibly empty)."""
        self._ids.extend(ids)
        end = self._last_boundary()
        if end is None:
            return ""
        text = self._decode(self._ids[:end])
        if text.endswith("\ufffd"):
            return ""
        out = text[self._prefix_len :]
        # _ids[end - 1] closes any byte run before it, so the next window may start there;
        # everything before it is never decoded again.
        del self._ids[: end - 1]
        self._read = 1
        self._prefix_len = len(self._decode(self._ids[:1]))
        return out

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished byte run ends up as U+FFFD) and start a
        fresh stream."""
        out = self._decode(self._ids)[self._prefix_len :]
        self._ids.clear()
        self._read = self._prefix_len = 0
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _last_boundary(self) -> int | None:
        """The largest j > _read such that _ids[:j] decodes to final text, or None."""
        byte_ids = self._tok.byte_fallback_ids
        special_ids = self._tok.special_ids
        # A skipped special token vanishes before decoding, so it does not separate the
        # byte runs on either side of it.
        for j in range(len(self._ids), self._read, -1):
            token = self._ids[j - 1]
            if token not in byte_ids and not (self._skip and token in special_ids):
                return j
        return None


# --- from_dir helpers ---------------------------------------------------------------------


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special-token entry is either the piece itself or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _stop_tuple(backend: tokenizers.Tokenizer, ids: Iterable[int | None], source: Path) -> tuple[int, ...]:
    size = backend.get_vocab_size(with_added_tokens=True)
    stops: list[int] = []
    for token_id in ids:
        if token_id is None or token_id in stops:
            continue
        if not 0 <= token_id < size:
            log.warning("%s: ignoring stop id %d outside the vocabulary (size %d)", source, token_id, size)
            continue
        stops.append(token_id)
    return tuple(stops)


# --- GGUF metadata ------------------------------------------------------------------------


def _gguf_cache_key(gguf: GGUFFile) -> str:
    """sha256 over the raw bytes of `general.architecture` and every `tokenizer.*` entry (the
    architecture picks the converter: gemma3 vs gemma4), read back from the file at the spans
    `read_gguf` recorded, prefixed by the converting transformers version."""
    for required in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        if required not in gguf.fields:
            raise TokenizerError(f"{gguf.path}: GGUF has no tokenizer metadata (missing {required!r})")
    try:
        converter = importlib_metadata.version("transformers")
    except importlib_metadata.PackageNotFoundError:
        converter = "none"
    # A newer transformers may convert differently (it did between 4.x and 5.x).
    h = hashlib.sha256(f"dflash-agent-tokenizer/{_CACHE_FORMAT}/transformers-{converter}\0".encode())
    try:
        with open(gguf.path, "rb") as f:
            for key, (start, end) in gguf.field_spans.items():
                if key == "general.architecture" or key.startswith("tokenizer."):
                    f.seek(start)
                    h.update(f.read(end - start))
    except OSError as exc:
        raise TokenizerError(f"{gguf.path}: cannot read GGUF metadata ({exc})") from exc
    return h.hexdigest()


def _convert_gguf_tokenizer(path: Path) -> tokenizers.Tokenizer:
    """transformers' GGUF -> fast tokenizer conversion, i.e. exactly what
    `AutoTokenizer.from_pretrained(dir, gguf_file=name)` builds its backend from.

    `tokenizer.ggml.add_space_prefix` is deliberately not acted on: transformers' Gemma
    builder never prepends "▁" (neither does Hugging Face's own Gemma tokenizer), and the
    Gemma 3 270M file sets it to false anyway."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

        architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
        backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except Exception as exc:
        raise TokenizerError(f"{path}: transformers could not convert the GGUF tokenizer ({exc})") from exc
    return backend


def _gguf_specials(backend: tokenizers.Tokenizer, fields: dict[str, Any], path: Path) -> SpecialTokens:
    def scalar_id(key: str) -> int | None:
        value = fields.get(f"tokenizer.ggml.{key}")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    eos_id = scalar_id("eos_token_id")
    extra = [scalar_id(key.removeprefix("tokenizer.ggml.")) for key in _GGUF_EXTRA_STOP_KEYS]
    end_of_turn = [backend.token_to_id(piece) for piece in _END_OF_TURN]
    size = backend.get_vocab_size(with_added_tokens=True)

    def in_vocab(token_id: int | None) -> int | None:
        return token_id if token_id is not None and 0 <= token_id < size else None

    return SpecialTokens(
        bos_id=in_vocab(scalar_id("bos_token_id")),
        eos_id=in_vocab(eos_id),
        pad_id=in_vocab(scalar_id("padding_token_id")),
        unk_id=in_vocab(scalar_id("unknown_token_id")),
        stop_ids=_stop_tuple(backend, [eos_id, *extra, *end_of_turn], path),
    )


# --- cache --------------------------------------------------------------------------------


def _load_cache_entry(entry: Path, gguf_path: Path) -> tuple[tokenizers.Tokenizer, SpecialTokens] | None:
    tok_file, specials_file = entry / _TOKENIZER_JSON, entry / _SPECIALS_JSON
    if not (tok_file.is_file() and specials_file.is_file()):
        return None
    try:
        specials = SpecialTokens.from_json(json.loads(specials_file.read_text(encoding="utf-8")))
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as exc:  # a damaged entry is rebuilt, never fatal
        log.warning("ignoring unreadable tokenizer cache %s for %s (%s)", entry, gguf_path, exc)
        return None
    return backend, specials


def _write_cache_entry(entry: Path, backend: tokenizers.Tokenizer, specials: SpecialTokens) -> None:
    """Write both files into a temporary sibling directory and rename it into place, so a
    reader sees either a complete entry or none, even with concurrent writers."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    except OSError as exc:
        log.warning("cannot cache the tokenizer in %s (%s); it will be converted again next time", entry, exc)
        return
    try:
        backend.save(str(tmp / _TOKENIZER_JSON), pretty=False)
        (tmp / _SPECIALS_JSON).write_text(json.dumps(specials.to_json()), encoding="utf-8")
        if entry.exists():  # a damaged entry we could not load: replace it
            shutil.rmtree(entry, ignore_errors=True)
        os.rename(tmp, entry)
    except OSError as exc:
        # Most likely another process renamed its identical entry in first.
        log.debug("tokenizer cache entry %s not written (%s)", entry, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
