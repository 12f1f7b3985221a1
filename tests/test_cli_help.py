"""`dflash-agent --help` answers at once: it lists the commands from cli.LazyGroup's one-line help without importing
them (each imports torch, a web server or the MCP SDK), and that help is each command's own."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from importlib import metadata

import click
import pytest

from dflash_agent.cli import LazyGroup

HEAVY = ("torch", "transformers", "litestar", "uvicorn", "mcp", "openai", "xgrammar", "numpy")

LISTINGS = """
import json, sys
from click.testing import CliRunner
from dflash_agent.cli import main
lazy = CliRunner().invoke(main, ["--help"]).output
version = CliRunner().invoke(main, ["--version"]).output
heavy = sorted(name for name in sys.modules if name.split(".")[0] in {heavy})
for name in main.list_commands(None):
    main.get_command(None, name)
print(json.dumps(dict(lazy=lazy, version=version, heavy=heavy, eager=CliRunner().invoke(main, ["--help"]).output)))
"""


def test_help_imports_no_command_and_lists_what_the_commands_say():
    done = subprocess.run([sys.executable, "-c", LISTINGS.format(heavy=set(HEAVY))], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["heavy"] == []
    assert out["lazy"] == out["eager"] and "serve " in out["lazy"] and "train-drafter " in out["lazy"]
    assert out["version"].strip().endswith(f"version {metadata.version('dflash-agent')}")


@pytest.mark.parametrize("name", sorted(LazyGroup.lazy))
def test_each_lazy_help_is_the_commands_own(name):
    module, attr = LazyGroup.lazy[name][0].split(":")
    command = getattr(importlib.import_module(module), attr)
    kept = click.Command(name, help=LazyGroup.lazy[name][1])
    for limit in (40, 80, 1000):  # whatever the terminal's width
        assert kept.get_short_help_str(limit) == command.get_short_help_str(limit)


def test_a_model_command_says_what_it_loads_before_torch_is_imported(monkeypatch, capsys, caplog):
    """On a terminal the first line comes before torch's import (seconds) and the load (minutes for a big file)."""
    import logging

    from dflash_agent import options

    caplog.set_level(logging.WARNING, logger="dflash_agent.options")  # a command's default: INFO goes nowhere
    from dflash_agent.engine import Engine

    said = []
    monkeypatch.setattr(Engine, "from_config", classmethod(lambda cls, config: said.append(capsys.readouterr().err)))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    options.load_engine("embedded", "cpu", "auto", None, "some-drafter", None, None, False)
    assert said == ["loading the embedded model with the drafter some-drafter...\n"]
    options.load_engine("embedded", "cpu", "auto", None, None, None, None, False, progress=False)
    assert said[1] == ""
