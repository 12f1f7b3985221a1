"""`dflash-agent mcp` over stdio answers every request, as JSON-RPC 2.0 §5.1 says, where the SDK's transport
gave none: lines that are not JSON, requests whose id is not a string or an integer, a request before initialize;
and the session goes on after each."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time

import pytest

INIT = {"jsonrpc": "2.0", "id": "init", "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}


class StdioSession:
    def __init__(self, repo):
        # a server URL that answers nothing: these calls never reach the model
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash_agent", "mcp", "--repo", str(repo), "--server",
                                      "http://127.0.0.1:9/v1", "--expose-tools", "--sandbox", "off"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def ask(self, line: str | dict, timeout: float = 60.0) -> dict:
        """Send one line and return the one reply it gets (a test failure where none comes)."""
        raw = line if isinstance(line, str) else json.dumps(line)
        self.proc.stdin.write(raw.encode() + b"\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no reply to {raw!r} within {timeout} s"
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture
def session(tmp_path):
    (tmp_path / "a.txt").write_text("a\n")
    session = StdioSession(tmp_path)
    yield session
    session.close()


def test_every_line_gets_its_answer_and_the_session_goes_on(session):
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "list_dir", "arguments": {}}}
    before = session.ask(call)
    assert before["id"] == 1 and before["error"]["code"] == -32600
    assert "before initialize" in before["error"]["message"]
    for bad_id in (1.5, True, None):
        reply = session.ask({"jsonrpc": "2.0", "id": bad_id, "method": "ping"})
        assert reply["id"] is None and reply["error"]["code"] == -32600
        assert "an id that is a string or an integer" in reply["error"]["message"]
    assert session.ask("{not json") == {"jsonrpc": "2.0", "id": None,
                                        "error": {"code": -32700, "message": "Parse error: the line is not JSON"}}
    no_method = session.ask({"jsonrpc": "2.0", "id": 5})
    assert no_method["id"] == 5 and no_method["error"]["code"] == -32600
    assert session.ask({"jsonrpc": "2.0", "id": 6, "method": "no/such"})["error"]["code"] == -32601
    assert "result" in session.ask(INIT)
    session.proc.stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
    after = session.ask({**call, "id": 7})
    assert after["id"] == 7 and not after["result"]["isError"] and "a.txt" in after["result"]["content"][0]["text"]
    started = time.monotonic()
    assert session.ask({"jsonrpc": "2.0", "id": 8, "method": "ping"}) == {"jsonrpc": "2.0", "id": 8, "result": {}}
    assert time.monotonic() - started < 30
