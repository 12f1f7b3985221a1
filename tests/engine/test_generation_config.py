"""A checkpoint's recommended sampling, read from files written by transformers and gguf-py, and the one rule that
merges it with a request."""

import json
import logging

import gguf
import numpy as np
import pytest
import transformers

from dflash_agent.engine import ModelLoadError, OptionError, RequestError, SamplingDefaults, SamplingParams
from dflash_agent.engine.formats.gguf import read_gguf
from dflash_agent.engine.load.generation_config import read_sampling_defaults

# What google/gemma-3-*-it ships as generation_config.json: sampling on, no temperature.
GEMMA3_IT = {"bos_token_id": 2, "cache_implementation": "hybrid", "do_sample": True, "eos_token_id": [1, 106],
             "pad_token_id": 0, "top_k": 64, "top_p": 0.95, "transformers_version": "4.50.0.dev0"}


def test_hf_generation_config_written_by_transformers(tmp_path, caplog):
    transformers.GenerationConfig(do_sample=True, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                                  repetition_penalty=1.1).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        got = read_sampling_defaults(tmp_path)
    assert got.fields() == {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05}
    assert got.source == str(tmp_path / "generation_config.json")
    assert "repetition_penalty 1.1 is not supported" in caplog.text


def test_a_model_saved_by_transformers_recommends_nothing(tmp_path):
    config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    transformers.Gemma3ForCausalLM(config).save_pretrained(tmp_path)
    assert (tmp_path / "generation_config.json").is_file()
    assert read_sampling_defaults(tmp_path) == SamplingDefaults()
    assert read_sampling_defaults(tmp_path / "elsewhere") == SamplingDefaults()


@pytest.mark.parametrize(("config", "expected"), [
    (GEMMA3_IT, {"temperature": 1.0, "top_k": 64, "top_p": 0.95}),  # do_sample: transformers' temperature 1
    ({"do_sample": False, "temperature": 0.7, "top_k": 64}, {"temperature": 0.0, "top_k": 64}),  # greedy wins
    ({"temperature": 0.7, "top_p": 0.8}, {"temperature": 0.7, "top_p": 0.8}),  # no do_sample: field by field
    ({"top_k": 20}, {"top_k": 20}),
    ({"top_k": None, "temperature": None}, {}),
])
def test_do_sample_rule(tmp_path, config, expected):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert read_sampling_defaults(tmp_path).fields() == expected


def test_values_out_of_range_are_left_out_with_a_warning(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": -1, "top_p": 0.0, "top_k": 1.5, "min_p": True}))
    with caplog.at_level(logging.WARNING):
        assert read_sampling_defaults(tmp_path) == SamplingDefaults()
    for said in ("temperature must be a finite number >= 0", "top_p must be in (0, 1]", "ignoring top_k 1.5 (not an integer)",
                 "ignoring min_p True (not a number)"):
        assert said in caplog.text


def test_unreadable_generation_config_is_a_load_error(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="generation_config.json is not valid JSON"):
        read_sampling_defaults(tmp_path)


def _gguf_with(path, **sampling):
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for name, value in sampling.items():
        getattr(writer, f"add_sampling_{name}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_gguf(path).fields


def test_gguf_general_sampling_keys(tmp_path, caplog):
    fields = _gguf_with(tmp_path / "m.gguf", temp=0.6, top_k=64, top_p=0.95, min_p=0.05, penalty_repeat=1.05,
                        xtc_probability=0.0)
    assert fields["general.sampling.top_p"] != 0.95  # float32 in the file
    with caplog.at_level(logging.WARNING):
        got = read_sampling_defaults(tmp_path / "m.gguf", fields)
    assert got.fields() == {"temperature": 0.6, "top_k": 64, "top_p": 0.95, "min_p": 0.05}
    assert got.source == "general.sampling.* of m.gguf"
    assert "general.sampling.penalty_repeat 1.05 is not supported" in caplog.text


def test_gguf_llama_cpp_conventions(tmp_path):
    # llama.cpp: top_k <= 0 is the whole vocabulary, temp <= 0 greedy.
    fields = _gguf_with(tmp_path / "m.gguf", temp=-1.0, top_k=-1)
    assert read_sampling_defaults(tmp_path / "m.gguf", fields).fields() == {"temperature": 0.0, "top_k": 0}
    assert read_sampling_defaults(tmp_path / "n.gguf", _gguf_with(tmp_path / "n.gguf")) == SamplingDefaults()


GEMMA = SamplingDefaults(temperature=0.6, top_k=64, top_p=0.95, source="test")
API = SamplingParams(temperature=1.0)


def test_omitted_fields_take_the_checkpoint_default_then_the_interface_default():
    assert GEMMA.resolve(API) == SamplingParams(temperature=0.6, top_k=64, top_p=0.95, min_p=0.0)
    assert SamplingDefaults().resolve(API) == API
    assert SamplingDefaults(top_k=64).resolve(SamplingParams()) == SamplingParams(temperature=0.0, top_k=64)


@pytest.mark.parametrize("given", [
    {"temperature": 0.0}, {"temperature": 1.0}, {"top_k": 0}, {"top_p": 1.0}, {"min_p": 0.0},
    {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.2, "seed": 7},
])
def test_an_explicit_value_always_wins(given):
    got = GEMMA.resolve(API, **given)
    for name in ("temperature", "top_k", "top_p", "min_p", "seed"):
        expected = given.get(name, getattr(GEMMA, name, None))
        assert getattr(got, name) == (expected if expected is not None else getattr(API, name))


def test_a_bad_request_value_is_still_refused():
    with pytest.raises(RequestError, match="top_p must be in"):
        GEMMA.resolve(API, top_p=0.0)


def test_describe_names_the_values_and_their_source():
    assert GEMMA.describe(API) == "temperature 0.6, top_k 64, top_p 0.95, min_p 0.0 (temperature, top_k, top_p from test)"
    assert SamplingDefaults().describe(API) == "temperature 1.0, top_k 0, top_p 1.0, min_p 0.0 (none from the model)"


def test_of_reads_what_fields_listed():
    assert SamplingDefaults.of(GEMMA.fields(), "x") == SamplingDefaults(0.6, 64, 0.95, None, "x")
    assert SamplingDefaults.of({"top_k": "64", "temperature": True, "other": 1}, "x").fields() == {}
    assert SamplingDefaults.of(None, "x").fields() == {}


def test_engine_load_refuses_an_unknown_mode():
    from dflash_agent.engine import Engine

    with pytest.raises(OptionError, match="unknown sampling defaults 'vllm' \\(model, none\\)"):
        Engine.load("embedded", sampling_defaults="vllm")
