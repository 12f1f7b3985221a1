"""`dflash-agent serve` as a user runs it: a process, a port, an OpenAI client, Ctrl-C."""

from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import openai

from dflash_agent.api.background import free_port
from tests.helpers.cli import serve, wait_ready


def test_serve_answers_an_openai_client_and_stops_on_sigint():
    port = free_port()
    proc = serve("--port", str(port), "--alias", "local", "--api-key", "k", "--ctx-size", "512")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["local"]
        out = client.chat.completions.create(model="local", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=3, temperature=0)
        assert out.model == "local" and out.usage.completion_tokens <= 3
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0


def test_serve_with_a_missing_model_exits_1_with_one_line(tmp_path):
    proc = serve("--port", str(free_port()), "--model", str(tmp_path / "nope.gguf"))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "nope.gguf" in errors[0] and "Traceback" not in err


def test_sigterm_ends_a_live_stream_with_an_error_event_and_exits_cleanly():
    """A stream cut by shutdown tells its client why; the log has one line per request and no traceback."""
    port = free_port()
    proc = serve("--port", str(port), "--ctx-size", "4096")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        assert httpx.get(f"{url}/nope").status_code == 404
        body = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 2000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            next(lines), next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    errors = [json.loads(line[6:])["error"] for line in rest if '"error"' in line]
    assert errors and "shutting down" in errors[0]["message"], rest
    assert rest[-1] == "data: [DONE]"
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert '"GET /nope HTTP/1.1" 404' in err and '"POST /v1/completions HTTP/1.1" 200' in err, err


def test_serve_on_a_busy_port_fails_at_once_without_loading_the_model():
    """The port is bound before the model loads: a second server says so in one line and exits 1, in the time it
    takes to start Python (it once loaded the model first: 53 s and 1.4 GB for a real checkpoint)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        proc = serve("--port", str(port))
        try:
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1, err
    assert time.monotonic() - started < 30, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "--port" in errors[0], err
    assert "Traceback" not in err and "serving on" not in err, err
