"""The command line as a user runs it: `python -m dflash_agent` as a subprocess, and what its errors look like."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash_agent", *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert fragment in lines[0]
    assert "Traceback" not in proc.stderr


def serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash_agent", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_ready(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 600
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                return
        except (httpx.ConnectError, httpx.TimeoutException):  # not listening yet; a busy machine
            pass
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.2)
