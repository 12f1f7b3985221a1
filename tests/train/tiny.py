"""A tiny random Gemma 3 target saved as a real checkpoint directory with a word-level tokenizer,
and a small corpus of "source files" in its words (tests import this; it is not a test module)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.helpers.references import VOCAB, save_reference

MASK_ID = 4
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]


def save_target(path: Path, kind: str = "gemma3"):
    """The transformers reference model; its directory also holds tokenizer.json."""
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    reference = save_reference(kind, path)
    vocab = {piece: i for i, piece in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), VOCAB)}
    backend = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    return reference


def write_corpus(path: Path, files: int = 30, words: int = 80, seed: int = 0) -> Path:
    """Files of words the tokenizer knows, with repeated phrases, as code has."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    phrases = [[f"w{rng.randrange(len(SPECIAL), VOCAB)}" for _ in range(rng.randint(2, 6))] for _ in range(12)]
    for i in range(files):
        text: list[str] = []
        while len(text) < words:
            text += rng.choice(phrases) if rng.random() < 0.6 else [f"w{rng.randrange(len(SPECIAL), VOCAB)}"]
        (path / f"m{i}.py").write_text(" ".join(text) + "\n")
    return path
