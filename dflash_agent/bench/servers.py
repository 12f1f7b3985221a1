"""Servers a benchmark compares, each a process of its own: ours (`dflash-agent serve`) and llama-server."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx

from ..api.background import free_port
from ..errors import UserError

log = logging.getLogger(__name__)

READY_S = 600  # a server that loads for longer is taken as broken


@contextmanager
def server_process(name: str, command: list[str], port: int) -> Iterator[str]:
    """A server process; yields its URL once /health answers 200."""
    log.info("starting %s: %s", name, " ".join(command))
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_S
        while True:
            if proc.poll() is not None:
                raise UserError(f"{name} exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise UserError(f"{name} did not become ready in {READY_S} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def running_servers(servers: list[tuple[str, list[str]]]) -> Iterator[list[tuple[str, str]]]:
    """Each (name, command) started, `{port}` in its command replaced by a free port; yields (name, URL) once all
    are ready, and stops them all after."""
    with ExitStack() as stack:
        urls = []
        for name, command in servers:
            port = free_port()
            command = [c.format(port=port) for c in command]
            urls.append((name, stack.enter_context(server_process(name, command, port))))
        yield urls
