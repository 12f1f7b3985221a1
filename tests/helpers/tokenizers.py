"""Tokenizers for tests: a word-level one over a tiny model's ids, and the embedded Gemma 3 tokenizer rewritten with
Gemma 4's special tokens."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_agent.engine.load.tokenizer import SpecialTokens, Tokenizer

EMBEDDED_VOCAB = 262144  # the embedded Gemma 3's ids, and Gemma 4's
# Gemma 4 renamed some of Gemma 3's unused tokens (gemma4.md section 5).
GEMMA4_SPECIALS = {
    46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>",
    51: "<tool_response|>", 52: '<|"|>', 98: "<|think|>", 100: "<|channel>", 101: "<channel|>",
    105: "<|turn>", 106: "<turn|>",
}


def word_tokenizer(vocab: int, stop_ids: tuple[int, ...] = (1,)) -> Tokenizer:
    """"w0" ... "w{vocab-1}", one id a word."""
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    backend = tokenizers.Tokenizer(WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w3"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, SpecialTokens(bos_id=2, eos_id=1, pad_id=0, unk_id=3, stop_ids=stop_ids), "test")


def with_gemma4_specials(gemma3: Tokenizer, path: Path) -> Tokenizer:
    """The embedded tokenizer with Gemma 4's special tokens in place of Gemma 3's unused ones (written to `path`);
    the ids are Gemma 4's, and so is the stop set."""
    data = json.loads(gemma3.backend.to_str())
    for entry in data["added_tokens"]:
        if entry["id"] in GEMMA4_SPECIALS:
            entry["content"] = GEMMA4_SPECIALS[entry["id"]]
    vocab = data["model"]["vocab"]
    by_id = {token_id: piece for piece, token_id in vocab.items() if token_id in GEMMA4_SPECIALS}
    for token_id, piece in GEMMA4_SPECIALS.items():
        del vocab[by_id[token_id]]
        vocab[piece] = token_id
    (path / "tokenizer.json").write_text(json.dumps(data))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 50]}))
    return Tokenizer.from_dir(path)
