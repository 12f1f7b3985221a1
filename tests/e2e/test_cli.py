"""`dflash-agent generate` as a user runs it: a subprocess, stdout/stderr and the exit code."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.cli import assert_one_line_error, cli
from tests.helpers.references import randomize


def test_generate_json_embedded():
    proc = cli("generate", "def fibonacci(n):", "--max-tokens", "12", "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"text", "token_ids", "finish_reason", "timings", "stats"}
    assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"
    for key in ("cache_n", "prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                "predicted_per_second", "draft_n", "draft_n_accepted"):
        assert key in out["timings"]
    assert out["timings"]["predicted_n"] == 12


@pytest.fixture(scope="module")
def multimodal_dir(tmp_path_factory, embedded_gguf):
    """A tiny random Gemma 4 saved the way Google ships it: config with text_config, model.language_model.*."""
    import transformers

    from dflash_agent.engine.load.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("gemma4-mm")
    text = dict(
        vocab_size=262144, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=4, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], max_position_embeddings=512,
    )
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    torch.manual_seed(3)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    randomize(model)
    model.save_pretrained(path)
    Tokenizer.from_gguf(embedded_gguf).backend.save(str(path / "tokenizer.json"))
    return path, model


def test_multimodal_checkpoint_generates_like_transformers(multimodal_dir):
    path, model = multimodal_dir
    proc = cli("generate", "def main():", "--model", str(path), "--max-tokens", "10", "--device", "cpu",
               "--dtype", "float32", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    from dflash_agent.engine.load.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(path).encode("def main():")
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, top_k=None, top_p=None)
    expected = ref[0, len(ids):].tolist()
    assert out["token_ids"] == expected[: len(out["token_ids"])]
    assert len(out["token_ids"]) == 10 or out["finish_reason"] == "stop"


def test_missing_model_file(tmp_path):
    assert_one_line_error(cli("generate", "x", "--model", str(tmp_path / "nope.gguf")), "not found")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 10)
    assert_one_line_error(cli("generate", "x", "--model", str(bad)), "bad.gguf")


def _write_gguf(path: Path, arch: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "llama.gguf"
    _write_gguf(path, "llama")
    assert_one_line_error(cli("generate", "x", "--model", str(path)), "unsupported GGUF architecture 'llama'")


def test_unsupported_tensor_type(embedded_gguf, tmp_path):
    import gguf

    from dflash_agent.engine.formats.gguf import read_gguf
    from dflash_agent.engine.load.weights import ModelLoadError, open_checkpoint

    # A real gemma3 header whose embedding is stored in a type we do not read.
    src = read_gguf(embedded_gguf)
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in src.fields.items():
        if key.startswith("gemma3.") and not isinstance(value, (list, np.ndarray)):
            writer.add_key_value(key, value, gguf.GGUFValueType.FLOAT32 if isinstance(value, float)
                                 else gguf.GGUFValueType.UINT32)
    iq2 = gguf.GGMLQuantizationType.IQ2_XXS
    raw = np.zeros((640, gguf.GGML_QUANT_SIZES[iq2][1]), np.uint8)  # one 256-wide block per row
    writer.add_tensor("token_embd.weight", raw, raw_dtype=iq2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="IQ2_XXS is not supported"):
        open_checkpoint(path)
    assert_one_line_error(cli("generate", "x", "--model", str(path)), "IQ2_XXS is not supported")


def test_prompt_longer_than_context():
    proc = cli("generate", "word " * 200, "--ctx-size", "64", "--device", "cpu")
    assert_one_line_error(proc, "context holds 64")


def test_hub_id_offline_is_a_clear_error():
    proc = cli("generate", "x", "--model", "google/gemma-4-31B-it", env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(proc, "could not download 'google/gemma-4-31B-it'")


def test_verbose_shows_traceback(tmp_path):
    proc = cli("--verbose", "generate", "x", "--model", str(tmp_path / "nope.gguf"))
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_generate_with_a_drafter_speculates_and_matches_plain(tmp_path):
    from dflash_agent.engine.model.drafter import init_drafter_checkpoint

    # The embedded Gemma 3 270M: 640 wide, 18 layers; <mask> is id 4 in Gemma vocabularies.
    draft = init_drafter_checkpoint(tmp_path / "draft", 640, 18, 4, num_layers=1, block_size=4)
    args = ("generate", "def add(a, b):", "--max-tokens", "24", "--json")
    spec = cli(*args, "--draft", str(draft), "--spec-block", "4")
    plain = cli(*args, "--no-spec")
    assert spec.returncode == 0, spec.stderr
    assert plain.returncode == 0, plain.stderr
    spec_out, plain_out = json.loads(spec.stdout), json.loads(plain.stdout)
    assert spec_out["token_ids"] == plain_out["token_ids"]
    assert spec_out["timings"]["draft_n"] > 0 and plain_out["timings"]["draft_n"] == 0
    assert spec_out["stats"]["draft_model"] is True
    assert spec_out["stats"]["acceptance_length_mean"] >= 1.0


def test_bad_drafter(tmp_path):
    assert_one_line_error(cli("generate", "x", "--draft", str(tmp_path)), "config.json")


def test_generate_with_an_8bit_kv_cache():
    plain = json.loads(cli("generate", "def f(x):", "-n", "8", "--json").stdout)
    q8 = json.loads(cli("generate", "def f(x):", "-n", "8", "--json", "--kv-cache", "q8").stdout)
    assert q8["token_ids"] == plain["token_ids"]  # a short greedy run far from any near-tie
    assert cli("generate", "x", "--kv-cache", "q4").returncode == 2
