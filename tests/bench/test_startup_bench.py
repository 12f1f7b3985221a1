"""bench --startup on the embedded model: our server started and timed to ready and to a first token, its peak RSS
and speeds read (and llama-server's beside it where a build is at hand: $LLAMA_CPP_BIN)."""

from __future__ import annotations

import json

import pytest

from dflash_agent.bench.cpu import llama_cpp_binary
from dflash_agent.bench.startup import report, run_startup_bench
from dflash_agent.engine.load.weights import EMBEDDED, resolve_model_path

pytestmark = pytest.mark.slow  # starts servers


def test_startup_bench_times_both_servers(tmp_path):
    llama_server = llama_cpp_binary(None, "llama-server")
    result = run_startup_bench(str(resolve_model_path(EMBEDDED)), llama_server, rounds=1, ctx_size=512,
                               decode_tokens=4)
    names = {"ours"} | ({"llama.cpp"} if llama_server else set())
    assert set(result.first) == set(result.second) == names
    for start in [*result.first.values(), *result.second.values()]:
        assert 0 < start.ready_s <= start.first_token_s < 600
        assert start.peak_rss_bytes > result.file_bytes  # the weights are in memory once the model answers
        assert start.prefill_tok_s > 0 and start.decode_tok_s > 0
    report(result, tmp_path / "startup.json")
    assert json.loads((tmp_path / "startup.json").read_text())["model"] == result.model
