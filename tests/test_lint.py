"""`ruff check` over the repository, with the rules in pyproject.toml's [tool.ruff], as part of the test run."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_ruff_check_is_clean():
    proc = ruff(".")
    assert proc.returncode == 0, f"ruff check found problems (pip install -e '.[dev]' for ruff):\n{proc.stdout}{proc.stderr}"


def test_ruff_reads_the_project_rules():
    # A planted unused import and an over-long line in a package module: the check above is not vacuous.
    planted = "import os\n\nX = '" + "x" * 130 + "'\n"
    proc = ruff("--stdin-filename", "dflash_agent/planted.py", "-", stdin=planted)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "F401" in proc.stdout and "E501" in proc.stdout
