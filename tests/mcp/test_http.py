"""The MCP server with the embedded model: through the official `mcp` client over streamable HTTP at
/mcp of a live server, with the model reached through a server's OpenAI API, and a run_task
cancelled while the engine generates."""

from __future__ import annotations

import json
import time
from contextlib import aclosing

import anyio
import httpx
import openai
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from dflash_agent.api.background import free_port
from dflash_agent.chat.chat_format import LoadedModel
from dflash_agent.engine import FinalEvent
from dflash_agent.engine import engine as engine_module
from dflash_agent.mcp.model import LocalModel, RemoteModel
from dflash_agent.mcp.server import STATUS_URI, workspace_server
from tests.mcp.conftest import API_KEY

PROMPT = "def fibonacci(n):"


def http_client(url: str, key: str | None = API_KEY) -> Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return Client(streamable_http_client(f"{url}/mcp", http_client=httpx.AsyncClient(headers=headers, timeout=300)))


def openai_completion(url: str, max_tokens: int) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    return client.completions.create(model="any", prompt=PROMPT, max_tokens=max_tokens, temperature=0).choices[0].text


def test_a_prompt_past_the_context_by_its_length_is_refused_before_it_is_tokenized(mcp_http_url):
    """A few megabytes of prompt to `complete` or `chat` are a tool error from their length alone: tokenized on the
    server's event loop first, they held every other client for seconds (3 s for 4 MB)."""
    huge = "x " * 2_000_000

    async def scenario():
        async with http_client(mcp_http_url) as client:
            complete = await client.call_tool("complete", {"prompt": huge, "max_tokens": 4})
            chat = await client.call_tool("chat", {"messages": [{"role": "user", "content": huge}]})
            after = await client.call_tool("complete", {"prompt": PROMPT, "max_tokens": 2})
            return complete, chat, after

    complete, chat, after = anyio.run(scenario)
    for result in (complete, chat):
        assert result.is_error and "prompt is too long: at least" in result.content[0].text
    assert not after.is_error and after.structured_content["completion_tokens"] == 2


def test_a_client_that_disconnects_mid_call_cancels_it(mcp_http_url):
    """A client killed (or its connection dropped) during a `complete` leaves no generation behind: with no event
    store the result cannot be resumed, so the server cancels the call as the client's cancel would, and the slot is
    free at once rather than after the last of its tokens."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Accept": "application/json, text/event-stream"}
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    with httpx.Client(base_url=mcp_http_url, headers=headers, timeout=60) as http:
        session = http.post("/mcp", json=init).headers["mcp-session-id"]
        headers = {"mcp-session-id": session, "mcp-protocol-version": "2025-06-18"}
        http.post("/mcp", headers=headers, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": "complete", "arguments": {"prompt": PROMPT, "max_tokens": 900, "temperature": 0}}}
        with http.stream("POST", "/mcp", headers=headers, json=call):
            deadline = time.monotonic() + 60
            while not any(s["state"] == "decoding" for s in http.get("/slots").json()):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            # admitted as the HTTP API's requests are (one queue, --max-queue)
            assert "dflash_requests_processing 1.0" in http.get("/metrics").text
        # the response closed unread: the connection is gone
        left = time.monotonic()
        while any(s["state"] != "idle" for s in http.get("/slots").json()):
            assert time.monotonic() - left < 5, "the generation went on without its client"
            time.sleep(0.05)
        after = http.post("/mcp", headers=headers, json={
            "jsonrpc": "2.0", "id": 3, "method": "tools/call",
            "params": {"name": "complete", "arguments": {"prompt": PROMPT, "max_tokens": 2}}})
        assert "dflash_requests_processing 0.0" in http.get("/metrics").text
    assert after.status_code == 200 and '"completion_tokens":2' in after.text.replace(" ", "")


def test_http_mcp_lists_tools_completes_and_runs_workspace_tools(mcp_http_url):
    async def scenario():
        async with http_client(mcp_http_url) as client:
            tools = [t.name for t in (await client.list_tools()).tools]
            complete = await client.call_tool("complete", {"prompt": PROMPT, "max_tokens": 6})
            read = await client.call_tool("read_file", {"path": "pkg/mod.py"})
            listed = await client.call_tool("list_dir", {"path": "."})
            outside = await client.call_tool("read_file", {"path": "/etc/hostname"})
            status = json.loads((await client.read_resource(STATUS_URI)).contents[0].text)
            return tools, complete, read, listed, outside, status

    tools, complete, read, listed, outside, status = anyio.run(scenario)
    assert tools[:3] == ["run_task", "complete", "chat"] and {"bash", "read_file", "list_dir"} <= set(tools)
    assert not complete.is_error
    assert complete.structured_content["completion_tokens"] == 6
    assert complete.structured_content["finish_reason"] == "length"
    # The same greedy continuation the server's OpenAI endpoint gives, through the openai SDK.
    assert complete.content[0].text == openai_completion(mcp_http_url, 6)
    assert not read.is_error and "VALUE = 42" in read.content[0].text
    assert not listed.is_error and "pkg/" in listed.content[0].text and "README.md" in listed.content[0].text
    assert outside.is_error and "outside the workspace" in outside.content[0].text
    assert status["state"] == "ready" and status["n_ctx"] == 1024 and status["family"] == "gemma3"
    assert status["last_request"]["generated_tokens"] == 6 and status["prefix_cache"]["requests"] >= 1


def test_http_mcp_needs_the_api_key_and_a_local_host_header(mcp_http_url):
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                  "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                             "clientInfo": {"name": "t", "version": "0"}}}
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{mcp_http_url}/mcp", json=initialize).status_code == 401
    assert httpx.post(f"{mcp_http_url}/mcp", json=initialize, headers={**headers, "Host": "evil.example"}
                      ).status_code in (403, 421)
    assert httpx.post(f"{mcp_http_url}/mcp", json=initialize, headers=headers).status_code == 200

    async def scenario():
        async with http_client(mcp_http_url, key="wrong") as client:
            await client.list_tools()

    with pytest.raises(Exception):  # noqa: B017 - the SDK surfaces the 401 as whatever its transport raises
        anyio.run(scenario)


def test_the_model_of_a_running_server_through_its_openai_api(mcp_http_url, mcp_repo):
    model = RemoteModel(mcp_http_url, api_key=API_KEY)

    async def scenario():
        async with Client(workspace_server(model, mcp_repo), mode="legacy") as client:
            complete = await client.call_tool("complete", {"prompt": PROMPT, "max_tokens": 5})
            chat = await client.call_tool("chat", {"messages": [{"role": "user", "content": "Say hi."}],
                                                   "max_tokens": 4})
            status = json.loads((await client.read_resource(STATUS_URI)).contents[0].text)
        await model.aclose()
        return complete, chat, status

    complete, chat, status = anyio.run(scenario)
    assert not complete.is_error and complete.content[0].text == openai_completion(mcp_http_url, 5)
    assert not chat.is_error and chat.structured_content["completion_tokens"] <= 4
    assert status["model"] == "gemma-3-270m-q4_k_m.gguf" and status["n_ctx"] == 1024 and status["requests"] == 2
    assert status["last_request"]["generated_tokens"] == chat.structured_content["completion_tokens"]
    assert status["server_metrics"]["prefix_cache_hits"] >= 1  # the chat shared its BOS with earlier prompts


def test_an_unreachable_server_is_a_tool_error(mcp_repo):
    model = RemoteModel(f"http://127.0.0.1:{free_port()}/v1")

    async def scenario():
        async with Client(workspace_server(model, mcp_repo), mode="legacy") as client:
            result = await client.call_tool("complete", {"prompt": "x"})
            status = json.loads((await client.read_resource(STATUS_URI)).contents[0].text)
        await model.aclose()
        return result, status

    result, status = anyio.run(scenario)
    assert result.is_error and "cannot reach the server" in result.content[0].text
    assert status["state"] == "unreachable"


def test_cancelling_run_task_cancels_the_engine_request(mcp_engine, mcp_repo, monkeypatch):
    last: dict[str, object] = {}  # the last event the engine emitted for each request, by id
    left_early: list[str] = []  # requests whose consumer stopped before the final event
    started = anyio.Event()
    generate, make_job = mcp_engine.generate, engine_module.Job

    def spy_job(request, emit):
        def recording(event):
            last[request.request_id] = event
            emit(event)

        return make_job(request, recording)

    async def spy_generate(request):
        started.set()
        finished = False
        try:
            async with aclosing(generate(request)) as events:
                async for event in events:
                    finished = isinstance(event, FinalEvent)
                    yield event
        finally:
            if not finished:
                left_early.append(request.request_id)

    monkeypatch.setattr(engine_module, "Job", spy_job)
    monkeypatch.setattr(mcp_engine, "generate", spy_generate)
    loaded = LoadedModel.of(mcp_engine)
    model = LocalModel(lambda: loaded, loaded.name)

    async def scenario():
        async with Client(workspace_server(model, mcp_repo, read_only=True), mode="legacy") as client:
            with anyio.fail_after(120):
                async with anyio.create_task_group() as tasks:
                    async def cancel_while_generating():
                        await started.wait()
                        await anyio.sleep(0.5)
                        tasks.cancel_scope.cancel()  # the client sends notifications/cancelled

                    tasks.start_soon(cancel_while_generating)
                    await client.call_tool("run_task", {"task": "Describe this repository."})
                # The engine is free for the next request at once.
                return await client.call_tool("complete", {"prompt": PROMPT, "max_tokens": 2})

    after = anyio.run(scenario)
    assert [request_id.split("-")[0] for request_id in left_early] == ["agent"]
    # The engine stopped it for the cancel (the next request ran after it on the one worker, so it has ended).
    assert last[left_early[0]].finish_reason == "cancelled"
    assert not after.is_error and after.structured_content["completion_tokens"] == 2
