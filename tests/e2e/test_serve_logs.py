"""What `dflash-agent serve` says without -v: a ready line with the model, its context and the URL once the model
has loaded, an access-log line per request but none for health polls (a load balancer's poll every second buried
the real requests)."""

from __future__ import annotations

import signal

import httpx

from dflash_agent.api.background import free_port
from tests.helpers.cli import serve, wait_ready


def test_serve_says_when_it_is_ready_and_leaves_health_polls_out_of_the_log():
    port = free_port()
    proc = serve("--port", str(port), "--ctx-size", "512")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        for _ in range(3):
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{url}/v1/health", timeout=30).status_code == 200
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    ready = [line for line in err.splitlines() if " ready: " in line]
    assert len(ready) == 1, err
    assert f"ready: gemma-3-270m-q4_k_m.gguf, context 512 tokens x 4 slots, on http://127.0.0.1:{port} " in ready[0]
    assert '"GET /v1/models HTTP/1.1" 200' in err
    assert "GET /health" not in err and "GET /v1/health" not in err
