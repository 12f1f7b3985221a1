"""The HTTP server in a background thread of this process, on 127.0.0.1 and a free port: for tests,
benchmarks and tools that want a real server next to their own code."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import httpx
import uvicorn
from litestar.plugins import InitPluginProtocol

from ..engine import Engine
from .app import DEFAULT_MAX_BODY_BYTES, create_app
from .service import ServerSettings, ServerState


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(load: Callable[[], Engine], settings: ServerSettings | None = None,
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, wait_ready: bool = True,
                plugins: Callable[[ServerState], Sequence[InitPluginProtocol]] = lambda server: ()) -> Iterator[str]:
    """Yields the base URL once the port accepts connections (and the model is ready, if asked)."""
    app = create_app(settings or ServerSettings(), load, max_body_bytes=max_body_bytes, plugins=plugins)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # a busy machine can take minutes to load even the embedded model
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    if wait_ready:
        while (health := httpx.get(f"{url}/health")).status_code != 200:
            if health.status_code == 500:  # the load failed: waiting longer changes nothing
                raise RuntimeError(f"the server's model did not load: {health.text}")
            if time.monotonic() > deadline:
                raise RuntimeError("the server's model did not load")
            time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
