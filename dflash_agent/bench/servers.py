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


def wait_until_ready(name: str, proc: subprocess.Popen, url: str, poll_s: float = 0.2) -> None:
    """Return once the server `proc` answers /health at url with 200; a UserError if it exits or takes READY_S."""
    deadline = time.monotonic() + READY_S
    while True:
        if proc.poll() is not None:
            raise UserError(f"{name} exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise UserError(f"{name} did not become ready in {READY_S} s")
        time.sleep(poll_s)


@contextmanager
def server_process(name: str, command: list[str], port: int) -> Iterator[str]:
    """A server process; yields its URL once /health answers 200."""
    log.info("starting %s: %s", name, " ".join(command))
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(name, proc, url)
        yield url
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM, then SIGKILL after grace_s; returns once the process is gone."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
