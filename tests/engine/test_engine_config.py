"""EngineConfig: Engine.load's options in one frozen, validated place, checked before any weight loads."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_agent import options
from dflash_agent.engine import EMBEDDED, EngineConfig, OptionError, SpecConfig

PACKAGE = Path(options.__file__).parent

# What Engine.load's signature took before EngineConfig held its options: the defaults must not move.
LOAD_DEFAULTS = {
    "model": EMBEDDED, "draft": None, "device": "auto", "dtype": "auto", "ctx_size": None, "progress": True,
    "spec": None, "draft_quant": None, "prefix_cache": True, "kv_dtype": "auto", "weights": "auto", "threads": None,
    "sampling_defaults": "model", "parallel": 1, "prefill": "auto", "draft_ctx": None,
}

BAD_OPTIONS = [
    ({"kv_dtype": "int4"}, r"unknown KV cache type 'int4' \(auto, model, q8\)"),
    ({"parallel": 0}, r"parallel must be >= 1 slot, got 0"),
    ({"weights": "fast"}, r"unknown weights mode 'fast' \(auto, exact, packed\)"),
    ({"prefill": "fp16"}, r"unknown prefill dtype 'fp16' \(auto, float32, bfloat16, int8\)"),
    ({"sampling_defaults": "vllm"}, r"unknown sampling defaults 'vllm' \(model, none\)"),
    ({"draft_ctx": 0}, r"draft_ctx must be >= 1 token, got 0"),
    ({"draft_ctx": 4096, "spec": SpecConfig(enabled=False)}, r"draft_ctx bounds the drafter's context, but speculation"),
]


def test_the_defaults_are_engine_loads():
    assert {f.name: f.default for f in dataclasses.fields(EngineConfig)} == LOAD_DEFAULTS
    assert EMBEDDED == "embedded"
    assert EngineConfig() == EngineConfig(**LOAD_DEFAULTS)


def test_the_docstring_describes_the_options():
    doc = inspect.getdoc(EngineConfig)
    for name in ("draft", "prefix_cache", "kv_dtype", "weights", "threads", "sampling_defaults", "parallel",
                 "prefill", "draft_ctx"):
        assert f"\n{name}: " in doc, name


def test_it_is_frozen():
    config = EngineConfig(ctx_size=256)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.ctx_size = 512
    assert dataclasses.replace(config, ctx_size=512).ctx_size == 512 and config.ctx_size == 256


@pytest.mark.parametrize(("bad", "message"), BAD_OPTIONS)
def test_each_bad_option_is_refused_by_the_config(bad, message):
    with pytest.raises(OptionError, match=message):
        EngineConfig(**bad)
    with pytest.raises(OptionError, match=message):  # replace re-checks
        dataclasses.replace(EngineConfig(), **bad)


@pytest.mark.parametrize(("bad", "message"), BAD_OPTIONS)
def test_engine_load_refuses_before_anything_loads(monkeypatch, bad, message):
    from dflash_agent.engine import engine as engine_module

    def loaded(*args, **kwargs):
        raise AssertionError("the engine started loading")

    monkeypatch.setattr(engine_module.Engine, "from_config", classmethod(loaded))
    with pytest.raises(OptionError, match=message):
        engine_module.Engine.load(**bad)


def test_engine_load_takes_the_configs_options_and_nothing_else(monkeypatch):
    from dflash_agent.engine import engine as engine_module

    seen = []
    monkeypatch.setattr(engine_module.Engine, "from_config", classmethod(lambda cls, config: seen.append(config)))
    engine_module.Engine.load("other.gguf", ctx_size=64, parallel=None)
    assert seen == [EngineConfig(model="other.gguf", ctx_size=64, parallel=None)]
    with pytest.raises(TypeError, match="n_ctx"):
        engine_module.Engine.load(n_ctx=64)


def _load_engine_keywords() -> set[str]:
    """The keywords the commands pass to load_engine beyond its own parameters (its `engine_options`)."""
    named = set(inspect.signature(options.load_engine).parameters) - {"engine_options"}
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "load_engine":
                found |= {keyword.arg for keyword in node.keywords if keyword.arg is not None}
    assert found, "no load_engine call found"
    return found - named


def test_the_fields_are_what_the_cli_passes():
    named = set(inspect.signature(options.load_engine).parameters) - {"engine_options", "no_spec", "spec_block"}
    assert {f.name for f in dataclasses.fields(EngineConfig)} == named | {"spec"} | _load_engine_keywords()


def test_load_engine_builds_the_config(monkeypatch):
    from dflash_agent.engine import engine as engine_module

    seen = []
    monkeypatch.setattr(engine_module.Engine, "from_config", classmethod(lambda cls, config: seen.append(config)))
    options.load_engine("m.gguf", "cpu", "float32", 128, "d", "int8", 5, False, "packed", 3, progress=False,
                        prefix_cache=False, kv_dtype="q8", sampling_defaults="none", parallel=2, prefill="int8")
    assert seen == [EngineConfig(model="m.gguf", draft="d", device="cpu", dtype="float32", ctx_size=128,
                                 progress=False, spec=SpecConfig(enabled=True, block=5), draft_quant="int8",
                                 prefix_cache=False, kv_dtype="q8", weights="packed", threads=3,
                                 sampling_defaults="none", parallel=2, prefill="int8")]


def test_the_config_is_torch_free_and_checked_before_torch_loads():
    code = (
        "import sys\n"
        "from dflash_agent.engine import EngineConfig, OptionError\n"
        "from dflash_agent.options import load_engine\n"
        "try:\n"
        "    load_engine('embedded', 'auto', 'auto', None, None, None, None, False, weights='fast')\n"
        "except OptionError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('no OptionError')\n"
        "assert 'torch' not in sys.modules, 'torch loaded'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
