"""A tiny OpenAI-compatible server on 127.0.0.1 that replays scripted replies as a chat-completions
stream (SSE chunks shaped as OpenAI's API sends them) and records the requests it gets. It stands in
for a model behind `--server`; the client side (the openai SDK) is the real one."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    text: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments as JSON text)
    reasoning: str = ""
    finish_reason: str | None = None
    usage: tuple[int, int, int] = (100, 10, 0)  # prompt, completion, cached


@dataclass
class Failure:
    status: int
    error: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)  # Retry-After, say


FAKE_CARD = {"id": "fake-model", "object": "model", "created": 0, "owned_by": "test"}


class FakeServer:
    def __init__(self, replies: list[Reply | Failure], card: dict[str, Any] | None = None,
                 metrics: str | None = None) -> None:
        self.card = card or FAKE_CARD  # what /v1/models lists: vLLM's and ours differ
        self.metrics = metrics  # Prometheus text at /metrics, if any
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        self.authorization: list[str | None] = []
        self.url = ""

    def chunks(self, reply: Reply) -> Iterator[dict[str, Any]]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "fake-model",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        yield chunk({"role": "assistant", "content": ""})
        if reply.reasoning:
            yield chunk({"reasoning_content": reply.reasoning})
        half = len(reply.text) // 2
        for piece in (reply.text[:half], reply.text[half:]):
            if piece:
                yield chunk({"content": piece})
        for index, (name, arguments) in enumerate(reply.calls):
            yield chunk({"tool_calls": [{"index": index, "id": f"call_{index}", "type": "function",
                                         "function": {"name": name, "arguments": ""}}]})
            cut = len(arguments) // 2
            for piece in (arguments[:cut], arguments[cut:]):
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        yield chunk({}, reply.finish_reason or ("tool_calls" if reply.calls else "stop"))
        prompt, completion, cached = reply.usage
        yield {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "fake-model",
               "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                        "total_tokens": prompt + completion,
                                        "prompt_tokens_details": {"cached_tokens": cached}}}


def _handler(fake: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [fake.card]})
            elif self.path == "/metrics" and fake.metrics is not None:
                data = fake.metrics.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self._json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            fake.requests.append(body)
            fake.authorization.append(self.headers.get("Authorization"))
            if not fake.replies:
                self._json(500, {"error": {"message": "the script ran out", "type": "server_error"}})
                return
            reply = fake.replies.pop(0)
            if isinstance(reply, Failure):
                self._json(reply.status, {"error": reply.error}, reply.headers)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in fake.chunks(reply):
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    return Handler


@contextmanager
def fake_server(replies: list[Reply | Failure], card: dict[str, Any] | None = None,
                metrics: str | None = None) -> Iterator[FakeServer]:
    fake = FakeServer(replies, card, metrics)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        httpd.shutdown()
        httpd.server_close()
