"""`dflash-agent mcp` as an editor spawns it: a process on stdio driven by the official `mcp` client,
the embedded model loading in it; its one-line errors; no server guessed and keys sent only to the one
named; a client that leaves before the model has loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import anyio
import httpx
from click.testing import CliRunner
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from dflash_agent.api.background import free_port
from dflash_agent.cli import main
from dflash_agent.mcp.server import STATUS_URI
from tests.agent.fake_openai import Reply, fake_server

# `dflash-agent mcp` whose model takes a minute to load (the time a client can leave in) and which appends every
# connection it opens to the file named by argv[1]; the other arguments are mcp's.
SLOW_LOAD_MCP = """
import socket, sys, time
import dflash_agent.mcp.commands as commands

spy = open(sys.argv[1], "a")
connect = socket.socket.connect

def spying(self, address):
    spy.write(repr(address) + "\\n")
    spy.flush()
    return connect(self, address)

socket.socket.connect = spying
commands.load_engine = lambda **options: time.sleep(60)
from dflash_agent.cli import main
main(["mcp", *sys.argv[2:]], prog_name="dflash-agent")
"""
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}}}
KEYS = {"DFLASH_AGENT_API_KEY": "key-for-dflash", "OPENAI_API_KEY": "key-for-openai"}


def mcp_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash_agent", "mcp", *args]


def test_stdio_server_with_the_embedded_model(tmp_path):
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "main.py").write_text("print('hi from main')\n")
    command = mcp_command("--repo", str(repo), "--expose-tools", "--ctx-size", "512")
    params = StdioServerParameters(command=command[0], args=command[1:], cwd=tmp_path)
    stderr = (tmp_path / "stderr.txt").open("w+")

    async def scenario():
        # Any stray byte on the server's stdout would break the client's JSON-RPC stream.
        async with Client(stdio_client(params, errlog=stderr), read_timeout_seconds=300) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            complete = await client.call_tool("complete", {"prompt": "The capital of France is", "max_tokens": 4})
            read = await client.call_tool("read_file", {"path": "src/main.py"})
            listed = await client.call_tool("list_dir", {"path": "."})
            bad = await client.call_tool("complete", {"prompt": "x", "max_tokens": "many"})
            status = json.loads((await client.read_resource(STATUS_URI)).contents[0].text)
            return tools, complete, read, listed, bad, status

    tools, complete, read, listed, bad, status = anyio.run(scenario)
    assert list(tools)[:3] == ["run_task", "complete", "chat"]
    assert tools["write_file"].annotations.destructive_hint and tools["grep"].annotations.read_only_hint
    assert not complete.is_error and complete.structured_content["completion_tokens"] == 4
    assert complete.content[0].text == complete.structured_content["text"] != ""
    assert not read.is_error and "print('hi from main')" in read.content[0].text
    assert not listed.is_error and "src/" in listed.content[0].text
    assert bad.is_error and "invalid arguments for complete" in bad.content[0].text
    assert status["state"] == "ready" and status["n_ctx"] == 512 and status["last_request"]["generated_tokens"] == 4
    stderr.seek(0)
    log = stderr.read()
    assert "dflash-agent mcp: serving MCP on stdio" in log and "model ready" in log and "Traceback" not in log


def test_serve_mounts_mcp_at_slash_mcp(tmp_path):
    (tmp_path / "notes.txt").write_text("served over HTTP\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_agent", "serve", "--port", str(port), "--mcp-repo",
                             str(tmp_path), "--mcp-expose-tools", "--mcp-read-only"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    async def scenario():
        url = f"http://127.0.0.1:{port}"
        with anyio.fail_after(180):
            async with httpx.AsyncClient() as http:
                while True:  # the port opens at once; the model may still be loading (the tools do not need it)
                    try:
                        await http.get(f"{url}/health")
                        break
                    except httpx.ConnectError:
                        assert proc.poll() is None, proc.stderr.read()
                        await anyio.sleep(0.2)
            async with Client(f"{url}/mcp") as client:
                tools = [t.name for t in (await client.list_tools()).tools]
                read = await client.call_tool("read_file", {"path": "notes.txt"})
        return tools, read

    try:
        tools, read = anyio.run(scenario)
    finally:
        proc.kill()  # its shutdown is test_serve_cli's business; here it would wait for the model's load
        proc.communicate(timeout=60)
    assert tools == ["run_task", "complete", "chat", "read_file", "list_dir", "glob", "grep"]
    assert not read.is_error and "served over HTTP" in read.content[0].text


def test_a_model_that_cannot_load_ends_the_server_with_one_line(tmp_path):
    # stdin stays open, as an editor keeps it: the failed load must end the process by itself.
    proc = subprocess.Popen(mcp_command("--repo", str(tmp_path), "--model", str(tmp_path / "missing.gguf")),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "missing.gguf" in errors[0] and "Traceback" not in err


def test_bad_options_are_one_line_errors(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(main, ["mcp", "--repo", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and missing.stdout == ""
    assert missing.stderr.splitlines() == [f"error: workspace {str(tmp_path / 'nope')!r} is not a directory"]
    clash = runner.invoke(main, ["mcp", "--server", "http://127.0.0.1:9", "--ctx-size", "64"])
    assert clash.exit_code == 2 and "--ctx-size configure the in-process model" in clash.stderr
    both = runner.invoke(main, ["mcp", "--server", "http://127.0.0.1:9", "--local"])
    assert both.exit_code == 2 and "--server and --local exclude each other" in both.stderr
    no_repo = runner.invoke(main, ["serve", "--port", "1", "--mcp-expose-tools"])
    assert no_repo.exit_code == 2 and "--mcp-expose-tools needs --mcp-repo" in no_repo.stderr


def slow_load_mcp(tmp_path, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of SLOW_LOAD_MCP, with API keys in the environment to leak."""
    env = {**os.environ, **KEYS}
    env.pop("DFLASH_AGENT_SERVER", None)
    return [sys.executable, "-c", SLOW_LOAD_MCP, str(tmp_path / "connections.txt"), *args], env


def test_without_server_the_model_loads_here_and_no_server_is_contacted(tmp_path):
    # Whatever listens on a well-known port is not ours: it must get neither a probe nor the keys.
    command, env = slow_load_mcp(tmp_path, "--repo", str(tmp_path))
    params = StdioServerParameters(command=command[0], args=command[1:], env=env, cwd=tmp_path)

    async def scenario():
        with anyio.fail_after(120):
            async with Client(stdio_client(params, errlog=(tmp_path / "stderr.txt").open("w"))) as client:
                status = json.loads((await client.read_resource(STATUS_URI)).contents[0].text)
                waiting = None
                with anyio.move_on_after(1):  # a model tool waits for the load rather than asking elsewhere
                    waiting = await client.call_tool("complete", {"prompt": "x", "max_tokens": 1})
                return status, waiting

    status, waiting = anyio.run(scenario)
    assert status["backend"] == "in-process engine" and status["state"] == "loading"
    assert waiting is None
    assert (tmp_path / "connections.txt").read_text() == ""


def test_a_client_that_leaves_before_the_model_loads_ends_it_cleanly(tmp_path):
    command, env = slow_load_mcp(tmp_path, "--repo", str(tmp_path))
    proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(json.dumps(INITIALIZE) + "\n")
        proc.stdin.flush()
        answer = json.loads(proc.stdout.readline())
        left = time.monotonic()
        proc.stdin.close()  # the editor quits while the model is still loading
        proc.wait(timeout=30)
        stderr = proc.stderr.read()
    finally:
        proc.kill()
    assert answer["id"] == 1 and "serverInfo" in answer["result"]
    assert proc.returncode == 0, stderr
    assert time.monotonic() - left < 10  # the load (a minute) is not waited for
    assert "Traceback" not in stderr and "this is a bug" not in stderr and "Error" not in stderr
    lines = [line for line in stderr.splitlines() if "sandbox off" not in line]  # a machine without bwrap says so
    assert len(lines) == 1 and lines[0].startswith("dflash-agent mcp: serving MCP on stdio"), stderr


def test_the_key_goes_only_to_the_server_named(tmp_path):
    with fake_server([Reply("from the named server")]) as fake:
        params = StdioServerParameters(command=sys.executable, env={**os.environ, **KEYS}, cwd=tmp_path,
                                       args=["-m", "dflash_agent", "mcp", "--repo", str(tmp_path), "--server", fake.url])

        async def scenario():
            with anyio.fail_after(120):
                async with Client(stdio_client(params, errlog=(tmp_path / "stderr.txt").open("w"))) as client:
                    return await client.call_tool("chat", {"messages": [{"role": "user", "content": "hi"}]})

        answer = anyio.run(scenario)
    assert not answer.is_error and answer.structured_content["content"] == "from the named server"
    assert fake.authorization == ["Bearer key-for-dflash"]  # the dflash-agent key first, where both are set
