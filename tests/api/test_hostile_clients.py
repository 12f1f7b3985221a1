"""Clients that walk away, send what is not JSON, or send far more than the context holds (issue 23): each
gets a 4xx in its API's shape or has its work cancelled, and the server stays responsive meanwhile."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from litestar import get

from dflash_agent.api.app import create_app
from dflash_agent.api.background import free_port
from dflash_agent.api.connections import AcceptErrorLimiter, ConnectionLimits, protocol_class
from dflash_agent.api.service import ServerSettings, answered_hosts, host_name

COUNT = "1, 2, 3, 4, 5, 6, 7, 8,"
USER = [{"role": "user", "content": COUNT}]

log = logging.getLogger(__name__)


def _metric(url: str, prefix: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(prefix + " "):
            return float(line.split()[1])
    return 0.0


def _cancelled(url: str, endpoint: str) -> float:
    return _metric(url, f'dflash_requests_total{{endpoint="{endpoint}",outcome="cancelled"}}')


def _wait_for(condition, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _post_raw(url: str, path: str, body: dict) -> socket.socket:
    """A request sent on a bare socket, so the test decides when the client goes away."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _long_count(label: str) -> str:
    """About 1,700 tokens, seconds of prefill: a request still in the engine when its client leaves a moment after
    it was admitted. A label of its own keeps one request's prompt out of the next one's prefix cache."""
    return f"{label}: " + ", ".join(str(i) for i in range(1, 400)) + ","


@pytest.mark.parametrize("path, endpoint", [
    ("/v1/completions", "completions"), ("/v1/chat/completions", "chat"), ("/v1/messages", "messages"),
])
def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(server_url, path, endpoint):
    """The client leaves while its request is in the engine: the request is counted cancelled, its admission
    released, and the engine drops its work, so the next request is served at once instead of after the 8000
    tokens it asked for. (A short prompt would race the model: a chat turn can end before the client leaves.)"""
    text = _long_count(endpoint)
    body = ({"prompt": text} if endpoint == "completions" else {"messages": [{"role": "user", "content": text}]}) | {
        "max_tokens": 8000, "temperature": 0}
    before = _cancelled(server_url, endpoint)
    sock = _post_raw(server_url, path, body)
    _wait_for(lambda: _metric(server_url, "dflash_requests_processing") == 1, "the request did not start")
    sock.close()
    _wait_for(lambda: _cancelled(server_url, endpoint) == before + 1, "the abandoned request was not cancelled", 30)
    _wait_for(lambda: _metric(server_url, "dflash_requests_processing") == 0, "the request was not released", 30)
    # Queued behind the abandoned request: served once its prefill ends, not minutes later.
    started = time.monotonic()
    r = httpx.post(f"{server_url}/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text
    assert time.monotonic() - started < 60


def _slowest_health_until_done(url: str, thread: threading.Thread) -> float:
    """Poll /health (each a 200) until `thread` ends, then join it: the slowest answer's seconds."""
    slowest = 0.0
    with httpx.Client(timeout=60) as poller:  # one client: its TLS setup is not the server's time
        while thread.is_alive():
            t = time.monotonic()
            assert poller.get(f"{url}/health").status_code == 200
            slowest = max(slowest, time.monotonic() - t)
            time.sleep(0.05)
    thread.join()
    return slowest


def test_a_prompt_far_beyond_the_context_is_refused_early_and_health_stays_live(server_url):
    """10 MB of prompt: a 400 naming the limit, without tokenizing it on the event loop."""
    answers: list[httpx.Response] = []
    big = {"prompt": "Write a long story. " * 500_000, "max_tokens": 1}
    thread = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{server_url}/v1/completions", json=big, timeout=300)))
    started = time.monotonic()
    thread.start()
    slowest = _slowest_health_until_done(server_url, thread)
    r = answers[0]
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"], error
    assert slowest < 1.0 and time.monotonic() - started < 30


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 300_000, "max_tokens": 1}),
    ("/v1/messages", {"model": "m", "max_tokens": 1,
                      "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 150_000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tools": [
        {"type": "function", "function": {"name": f"t{i}", "description": "d", "parameters": {
            "type": "object", "properties": {"a": {"type": "string"}}}}} for i in range(100_000)]}),
], ids=["300k-messages", "300k-anthropic-turns", "100k-tools"])
def test_many_small_parts_are_converted_off_the_event_loop(server_url, path, body):
    """Megabytes of tiny messages or tools: their conversion (seconds of Python on the event loop before) runs in a
    thread, so /health answers meanwhile; the request ends in its answer (empty messages render to nothing) or a
    400 for its size. What still runs on the loop is the body's decoding (C, a few hundred ms for 10 MB)."""
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(httpx.post(f"{server_url}{path}", json=body, timeout=300)))
    thread.start()
    slowest = _slowest_health_until_done(server_url, thread)
    assert answers[0].status_code in (200, 400), answers[0].text
    log.info("slowest /health beside %s: %.3f s", path, slowest)
    # the goal is 0.5 s; what is left is the body's decoding, which holds the GIL: a 2-core Zen 3 took 0.6-0.9 s
    # alone and 1.1 s inside the suite. The bound leaves it room, and still fails a conversion put back on the loop
    # (3.4 s each on a faster machine)
    assert slowest < 1.5, slowest


def test_tokenizing_runs_off_the_event_loop(server_url):
    """A long prompt that does fit is tokenized in a thread that releases the GIL: /health answers meanwhile."""
    text = "Write a long story. " * 12_000  # 240 K characters, under the 8192-token bound; ~60 K tokens
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{server_url}/tokenize", json={"content": text}, timeout=300)))
    started = time.monotonic()
    thread.start()
    gaps = []
    while thread.is_alive():
        t = time.monotonic()
        httpx.get(f"{server_url}/health", timeout=60)
        gaps.append(time.monotonic() - t)
        time.sleep(0.01)
    thread.join()
    elapsed = time.monotonic() - started
    assert answers[0].status_code == 200 and len(answers[0].json()["tokens"]) > 50_000
    # Tokenizing on the loop (or holding the GIL) would hold one /health for nearly the whole request.
    assert len(gaps) >= 2 and max(gaps) < 0.6 * elapsed, (gaps, elapsed)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/tokenize"])
def test_post_bodies_must_be_json(server_url, path, content_type):
    """A web page may POST text/plain or form bodies cross-origin without a preflight: refused (CSRF)."""
    body = json.dumps({"prompt": "hi", "messages": USER, "max_tokens": 1, "content": "hi"}).encode()
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(f"{server_url}{path}", content=body, headers=headers)
    assert r.status_code == 415, r.text
    message = r.json()["error"]["message"]
    assert "application/json" in message
    if path == "/v1/messages":
        assert r.json()["type"] == "error"
    ok = httpx.post(f"{server_url}{path}", content=body,
                    headers={"content-type": "application/json; charset=utf-8"}, timeout=120)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", ["/slots?prompt=true", "/v1/chat/completions", "/v1/messages", "/detokenize",
                                  "/health", "/props"])
def test_a_host_this_server_does_not_answer_to_gets_421(server_url, path):
    """DNS rebinding: a page on attacker.example, resolved to 127.0.0.1, is same-origin with the server; every route
    refuses its Host (in the API's own error shape) and this machine's names are answered."""
    port = httpx.URL(server_url).port
    body = {"messages": USER, "max_tokens": 1, "model": "m", "tokens": [1, 2]}
    send = httpx.get if path in ("/slots?prompt=true", "/health", "/props") else httpx.post
    kwargs = {} if send is httpx.get else {"json": body}
    refused = send(f"{server_url}{path}", headers={"host": f"attacker.example:{port}"}, timeout=120, **kwargs)
    assert refused.status_code == 421, refused.text
    assert "attacker.example" in refused.json()["error"]["message"]
    if path == "/v1/messages":
        assert refused.json()["type"] == "error"
    for name in ("localhost", "127.0.0.1", "LOCALHOST"):
        ok = send(f"{server_url}{path}", headers={"host": f"{name}:{port}"}, timeout=120, **kwargs)
        assert ok.status_code == 200, ok.text


def test_which_hosts_a_bound_server_answers_to():
    assert answered_hosts("127.0.0.1") == ("127.0.0.1", "::1", "localhost")
    assert answered_hosts("10.0.0.5", ("box.lan",)) == ("10.0.0.5", "127.0.0.1", "::1", "box.lan", "localhost")
    assert answered_hosts("0.0.0.0") is None and answered_hosts("127.0.0.1", ("*",)) is None
    assert "box.lan" in answered_hosts("::", ("box.lan",))
    assert [host_name(h) for h in ("[::1]:8080", "Example.COM:80", "localhost", "::1")] == [
        "::1", "example.com", "localhost", "::1"]


def test_anthropic_stream_usage_counts_cached_tokens_once(server_url):
    """message_start and message_delta split input like Anthropic: input_tokens excludes cache reads."""
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 3, "temperature": 0,
            "stream": True}
    for _ in range(2):  # the second run reads the prompt from the prefix cache
        starts, deltas = [], []
        with httpx.stream("POST", f"{server_url}/v1/messages", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event["type"] == "message_start":
                        starts.append(event["message"]["usage"])
                    elif event["type"] == "message_delta":
                        deltas.append(event["usage"])
    start, delta = starts[0], deltas[0]
    assert delta["cache_read_input_tokens"] > 0
    assert start["input_tokens"] == delta["input_tokens"]
    assert start["cache_read_input_tokens"] == delta["cache_read_input_tokens"]


def test_every_request_leaves_an_access_log_line(server_url, caplog):
    caplog.set_level(logging.INFO, logger="dflash_agent.api.access")
    httpx.get(f"{server_url}/nope")
    httpx.post(f"{server_url}/v1/completions", json={"prompt": ""})
    sock = _post_raw(server_url, "/v1/completions", {"prompt": COUNT, "max_tokens": 2000, "temperature": 0})
    _wait_for(lambda: _metric(server_url, "dflash_requests_processing") == 1, "the request did not start")
    sock.close()
    _wait_for(lambda: any("disconnected" in r.getMessage() for r in caplog.records), "no line for the cancel", 30)
    lines = [r.getMessage() for r in caplog.records]
    assert any('"GET /nope HTTP/1.1" 404 ' in m for m in lines), lines
    assert any('"POST /v1/completions HTTP/1.1" 400 ' in m for m in lines), lines
    assert any('"POST /v1/completions HTTP/1.1" 499 client disconnected' in m for m in lines), lines


def test_a_generation_logs_its_tokens_and_speed(server_url, caplog):
    caplog.set_level(logging.INFO, logger="dflash_agent.api.access")
    httpx.post(f"{server_url}/v1/completions", json={"prompt": COUNT, "max_tokens": 3, "temperature": 0},
               timeout=120).raise_for_status()
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash_agent.api.access.generation"]
    assert any(m.startswith("completions: prompt ") and "3 generated" in m and "finish length" in m
               for m in lines), lines


def test_log_requests_shows_what_a_client_sent_with_its_secrets_redacted(server_url, caplog):
    caplog.set_level(logging.INFO, logger="dflash_agent.api.requests")
    body = {"prompt": "a marker 7f3a", "max_tokens": 1}
    httpx.post(f"{server_url}/v1/completions", json=body, timeout=120,
               headers={"Authorization": "Bearer s3cret", "User-Agent": "probe/1.0"})
    [line] = [r.getMessage() for r in caplog.records if r.name == "dflash_agent.api.requests"]
    assert line.startswith("POST /v1/completions headers=")
    assert "probe/1.0" in line and "s3cret" not in line and "<redacted>" in line
    assert json.loads(line.split(" body=", 1)[1]) == body


# --- connections that send part of a request (issue 32) ----------------------------------------------------------


class _SlowRoute:
    """A plugin adding GET /slow, a request answered after a while: a connection the limit must not close."""

    def on_app_init(self, app_config):
        @get("/slow", opt={"public": True})
        async def slow() -> dict:
            await asyncio.sleep(3)
            return {"done": True}

        app_config.route_handlers.append(slow)
        return app_config


@contextmanager
def _guarded_server(limits: ConnectionLimits):
    """The app with the connection guard `serve` uses, on a model that never loads (/health answers 503 at once):
    the connections, not the model, are under test."""
    release = threading.Event()

    def never_loads():
        release.wait(120)
        raise RuntimeError("the test is over")

    app = create_app(ServerSettings(), never_loads, plugins=lambda server: [_SlowRoute()])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           http=protocol_class(limits)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait_for(lambda: server.started, "the server did not start", 60)
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=30)


def _stalled_connections(port: int, n: int) -> list[socket.socket]:
    """Connections that send nothing, half a header, or whole headers and part of the body, then nothing."""
    partial = [b"", b"GET /health HTTP/1.1\r\nHost: x\r\n",
               b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: 100\r\n\r\n{\"prompt\": "]
    socks = []
    for i in range(n):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(partial[i % len(partial)])
        socks.append(sock)
    return socks


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass  # a 408 or the like before the close would be fine too
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_stalled_connections_are_dropped_and_health_answers_meanwhile():
    """120 connections that stall mid-request against a limit of 40: /health still answers well before the stalled
    ones time out (a new connection closes the longest-stalled one), and every stalled one is closed after the
    timeout."""
    timeout_s = 4.0  # the answer must beat it by a margin a loaded 2-core CI machine keeps
    with _guarded_server(ConnectionLimits(max_connections=40, header_timeout_s=timeout_s,
                                          body_timeout_s=timeout_s)) as (url, port):
        # built before the clock starts (its TLS setup is not the server's time); a new connection each request
        with httpx.Client(timeout=timeout_s / 2, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            socks = _stalled_connections(port, 120)
            try:
                for _ in range(5):
                    started = time.monotonic()
                    assert client.get(f"{url}/health").status_code == 503  # the model never loads
                    assert time.monotonic() - started < timeout_s / 2
                    time.sleep(0.1)
                assert all(_closed_by_server(s, 2 * timeout_s) for s in socks)
            finally:
                for sock in socks:
                    sock.close()


def test_a_slow_body_is_cut_but_a_slow_answer_is_not():
    """The body timeout is a pause between pieces; once a request is in, answering it takes as long as it takes."""
    with _guarded_server(ConnectionLimits(max_connections=40, header_timeout_s=1.0, body_timeout_s=1.0)) as (url, _):
        assert httpx.get(f"{url}/slow", timeout=10).json() == {"done": True}  # 3 s, three times the timeouts


def test_at_the_connection_limit_a_new_client_gets_a_503_only_when_all_are_answering():
    limits = ConnectionLimits(max_connections=3, header_timeout_s=30, body_timeout_s=30)
    with _guarded_server(limits) as (url, port):
        slow = [threading.Thread(target=lambda: httpx.get(f"{url}/slow", timeout=30)) for _ in range(3)]
        for thread in slow:
            thread.start()
        time.sleep(1.0)  # all three are being answered
        r = httpx.get(f"{url}/health", timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections", r.text
        assert int(r.headers["retry-after"]) >= 1
        for thread in slow:
            thread.join(30)
        socks = _stalled_connections(port, 3)  # waiting for their clients: closed for the next one
        try:
            assert httpx.get(f"{url}/health", timeout=5).json()["error"]["message"] == "Loading model"
        finally:
            for sock in socks:
                sock.close()


def _get_on(sock: socket.socket, path: str) -> bytes:
    """One kept-alive GET on an open connection: the response's status line (b"" when the server closed it)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            return b""
        head += chunk
    headers, body = head.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in headers.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return headers.split(b"\r\n")[0]


def test_idle_connections_outlast_the_clients_pools():
    """httpx and Node keep an idle connection about 5 s: the server must keep it longer, or a request sent as both
    time out goes into a closing connection. A shorter setting still closes idle ones."""
    for limits, idle_s, kept in ((ConnectionLimits(), 5.5, True), (ConnectionLimits(keep_alive_s=0.5), 1.5, False)):
        with _guarded_server(limits) as (_, port), socket.create_connection(("127.0.0.1", port)) as sock:
            sock.settimeout(10)
            assert _get_on(sock, "/health").startswith(b"HTTP/1.1 503")  # the model never loads
            time.sleep(idle_s)
            try:
                status = _get_on(sock, "/health")
            except ConnectionResetError:
                status = b""
            assert status.startswith(b"HTTP/1.1 503") if kept else status == b"", (limits, status)


def _all_received(sock: socket.socket, seconds: float = 3.0) -> bytes:
    """What the server sends until it closes the connection (or `seconds` pass)."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return data


def test_a_request_framed_two_ways_is_refused_and_its_connection_closed():
    """Content-Length with Transfer-Encoding (RFC 9112 section 6.1): a proxy in front may read the body by one, the
    server by the other, so a request hidden in the body would be served (smuggling). One 400, then the close."""
    with _guarded_server(ConnectionLimits()) as (_, port):
        hidden = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
        body = b"0\r\n\r\n" + hidden
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(body) + body)
            data = _all_received(sock)
        assert data.count(b"HTTP/1.1 ") == 1 and data.startswith(b"HTTP/1.1 400"), data
        head, _, payload = data.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower()
        assert "Content-Length with Transfer-Encoding" in json.loads(payload)["error"]["message"]
        with socket.create_connection(("127.0.0.1", port)) as sock:  # any unparsable request: the same shape
            sock.sendall(b"GET / HTTP/1.1\r\nHost localhost\r\n\r\n")
            data = _all_received(sock)
        assert data.startswith(b"HTTP/1.1 400") and json.loads(data.partition(b"\r\n\r\n")[2])["error"]


def test_accept_failures_are_logged_once_per_period():
    """Out of file descriptors, asyncio reports every failed accept (335 MB of log in 144 s): one gets through per
    period, then one saying how many were left out."""
    seen: list[dict] = []
    loop = asyncio.new_event_loop()
    try:
        limiter = AcceptErrorLimiter(lambda loop, context: seen.append(context), period_s=0.3)
        failure = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many")}
        for _ in range(1000):
            limiter(loop, failure)
        time.sleep(0.35)
        limiter(loop, failure)
        limiter(loop, {"message": "something else"})
    finally:
        loop.close()
    assert [c["message"] for c in seen] == [
        "socket.accept() out of system resource",
        "socket.accept() out of system resource (999 more such failures in the last 0.3 s not logged; see serve "
        "--max-connections)",
        "something else"]


def _refused_fast_while_health_answers(url: str, path: str, body: dict) -> httpx.Response:
    """POST `body` in a thread, polling /health meanwhile; the answer, after checking it came fast and /health
    never waited a second."""
    answers: list[httpx.Response] = []
    content = json.dumps(body).encode()  # here: encoding 9M ids in the thread would hold this process's GIL
    thread = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=300)))
    started = time.monotonic()
    thread.start()
    slowest = _slowest_health_until_done(url, thread)
    assert slowest < 1.0 and time.monotonic() - started < 6, (slowest, time.monotonic() - started)
    return answers[0]


BIG = "Describe the tool at length. " * 350_000  # 10 MB
ANTHROPIC_TOOL = {"name": "f", "description": BIG, "input_schema": {"type": "object"}}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "tools": [
        {"type": "function", "function": {"name": "f", "description": BIG}}]}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "string", "description": BIG}}}}}]}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "description": BIG}}}}),
    ("/v1/messages", {"messages": USER, "max_tokens": 1, "tools": [ANTHROPIC_TOOL]}),
    ("/v1/messages/count_tokens", {"messages": USER, "tools": [ANTHROPIC_TOOL]}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1, "tools": [
        {"type": "function", "name": "f", "description": BIG}]}),
    ("/apply-template", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f",
                                                                                       "description": BIG}}]}),
], ids=["tool-description", "tool-schema", "response-format", "anthropic-tool", "count-tokens", "responses-tool",
        "apply-template"])
def test_text_outside_the_messages_is_size_checked_before_any_work(server_url, path, body):
    """10 MB in a tool's description or schema was refused only after 8-24 s of rendering and tokenizing."""
    r = _refused_fast_while_health_answers(server_url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error.get("code", error.get("type")) in ("context_length_exceeded", "invalid_request_error"), error
    assert "characters" in error["message"], error


@pytest.mark.parametrize("tokens, status", [([1] * 9_000_000, 413), ([1] * 2_000_000, 400)],
                         ids=["body-beyond-the-context", "ids-beyond-the-context"])
def test_detokenizing_millions_of_ids_is_refused_and_health_stays_live(server_url, tokens, status):
    """9M ids held /health for 3-6 s: now a body the context rules out is refused before it is read, and a list
    longer than /tokenize could return before it is decoded."""
    r = _refused_fast_while_health_answers(server_url, "/detokenize", {"tokens": tokens})
    error = r.json()["error"]
    assert r.status_code == status and "at most" in error["message"], error
