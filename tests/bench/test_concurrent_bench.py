"""bench --concurrent: its client against a real two-slot server (the streams overlap and every token is counted),
its report, and its option errors. The llama-server column is exercised where a build is found."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner

from dflash_agent.api.background import live_server
from dflash_agent.bench.commands import bench
from dflash_agent.bench.concurrent import (
    ArrivalResult,
    BesideResult,
    ConcurrencyRow,
    ConcurrentBenchResult,
    SharedStartResult,
    Target,
    _batch,
    _shared_start,
    longest_pause,
    rate_within,
    remote_target,
    report,
)
from dflash_agent.engine import SpecConfig


def test_a_batch_of_streams_counts_every_token(embedded_engine):
    with live_server(lambda: embedded_engine(256, parallel=2, spec=SpecConfig(enabled=False))) as url:
        target = Target("ours", url)
        aggregate, rates, ttfts = asyncio.run(_batch(target, 3, 12))  # three streams on two slots: one waits
        wall, later = asyncio.run(_shared_start(target, "Rules: keep diffs small. " * 20, cache=True))
        # --server URL: a running server, found by its /v1/models, with the model id and context it lists
        running = remote_target(f"{url}/v1")
        remote_aggregate, _, _ = asyncio.run(_batch(running, 2, 8))
    assert running.url == url and running.model and running.context == 256 and remote_aggregate > 0
    assert aggregate > 0 and len(rates) == len(ttfts) == 3
    assert all(r > 0 for r in rates) and max(ttfts) > min(ttfts)
    assert wall >= later > 0


def test_report_prints_ratios_against_llama_server(tmp_path, capsys):
    result = ConcurrentBenchResult("m", 2, 128, 3, [
        ConcurrencyRow("dflash-agent", 1, 40.0, 42.0, 0.2), ConcurrencyRow("llama-server", 1, 40.0, 41.0, 0.2),
        ConcurrencyRow("dflash-agent", 4, 80.0, 20.0, 0.6), ConcurrencyRow("llama-server", 4, 64.0, 16.0, 0.8)],
        [ArrivalResult("dflash-agent", 0.2, 0.5, 0.7, 0.4)], [SharedStartResult("dflash-agent", 3.0, 2.2, 5.4, 4.6)],
        [BesideResult("dflash-agent", 40.0, 12.0, 30.5)])
    report(result, tmp_path / "c.json")
    out = capsys.readouterr().out
    assert "8192-token prompt prefills (30.5 s): 12.0 tok/s against 40.0 alone (30% kept)" in out
    assert "2.00x" in out and "1.25x" in out and "(2.5x)" in out and "longest pause while it prefilled: 0.40 s" in out
    assert "both answered in 3.00 s with the prompt cache, 5.40 s without (1.80x)" in out
    assert json.loads((tmp_path / "c.json").read_text())["rows"][2]["aggregate_tok_s"] == 80.0


def test_bad_stream_counts_and_mixed_modes_are_usage_errors():
    for args, message in ((["--concurrent", "one"], "not a list of stream counts"),
                          (["--concurrent", "0,4"], "from 1 to 64"),
                          (["--concurrent", "1,4", "--spec"], "--concurrent takes only"),
                          (["--server", "http://127.0.0.1:9"], "--server needs --concurrent")):
        result = CliRunner().invoke(bench, args)
        assert result.exit_code == 2 and message in result.output, result.output


def test_the_longest_pause_counts_from_the_long_prompt_to_its_first_token():
    # a stream still running at the end pauses until then; one that ended, until its last token
    assert longest_pause([[0.5, 1.2, 1.3, 2.9], [1.1, 1.2]], [True, False], 1.0, 3.5) == pytest.approx(1.6)
    assert longest_pause([[1.5, 3.0], [1.05]], [True, True], 1.0, 3.2) == pytest.approx(2.15)
    assert longest_pause([[0.2]], [False], 1.0, 2.0) == 0.0


def test_a_rate_counts_the_pieces_inside_its_window_only():
    stamps = [0.5, 1.0, 1.2, 1.9, 2.0, 2.4]
    assert rate_within(stamps, 1.0, 2.0) == 3.0  # 1.2, 1.9 and 2.0: the start is the window before's
    assert rate_within(stamps, 2.5, 4.5) == 0.0 and rate_within(stamps, 2.0, 2.0) == 0.0
