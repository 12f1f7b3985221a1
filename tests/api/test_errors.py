"""Every error case answers with its documented status, in the shape of the API that was called."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from dflash_agent.api.anthropic_schema import CountTokensRequest, MessagesRequest
from dflash_agent.api.background import live_server
from dflash_agent.api.openai_schema import ChatCompletionRequest, CompletionRequest
from dflash_agent.api.responses_schema import ResponsesRequest
from dflash_agent.api.service import ServerSettings
from dflash_agent.engine.engine import Engine

from .conftest import API_KEY

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
USER = [{"role": "user", "content": "hi"}]


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error) and error["message"]
    return error


def anthropic_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["message"] and body["error"]["type"]
    return body["error"]


@pytest.fixture(scope="module")
def strict(strict_url):
    return httpx.Client(base_url=strict_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def test_api_key_required_everywhere_but_health(strict_url):
    assert httpx.get(f"{strict_url}/health").status_code == 200
    error = openai_error(httpx.post(f"{strict_url}{CHAT}", json={"messages": USER}), 401)
    assert error["type"] == "authentication_error"
    openai_error(httpx.get(f"{strict_url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    openai_error(httpx.get(f"{strict_url}/metrics"), 401)
    assert anthropic_error(httpx.post(f"{strict_url}{MESSAGES}", json={}), 401)["type"] == "authentication_error"
    assert httpx.get(f"{strict_url}/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.get(f"{strict_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_malformed_json(strict):
    headers = {"content-type": "application/json"}
    assert "malformed" in openai_error(strict.post(CHAT, content=b"{nope", headers=headers), 400)["message"].lower()
    anthropic_error(strict.post(MESSAGES, content=b"{nope", headers=headers), 400)


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": "hi"}, "messages"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "logprobs": True}, "logprobs"),
    ({"messages": USER, "stop": [""]}, "stop"),
    ({"messages": [{"role": "tool", "tool_call_id": "x", "content": "r"}]}, "messages[0]"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_openai_bad_requests_name_the_field(strict, body, param):
    error = openai_error(strict.post(CHAT, json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(param), error


@pytest.mark.parametrize("body, words", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]},
     "tool_use"),
    ({"max_tokens": 5, "messages": USER, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
])
def test_anthropic_bad_requests(strict, body, words):
    error = anthropic_error(strict.post(MESSAGES, json=body), 400)
    assert error["type"] == "invalid_request_error" and words in error["message"]


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("body, param", [
    ({"prompt": [True], "max_tokens": 1}, "prompt"),
    ({"prompt": [1, False], "max_tokens": 1}, "prompt"),
    ({"prompt": "hi", "max_tokens": 1, "seed": 2**64}, "seed"),
    ({"prompt": "hi", "max_tokens": 1, "seed": -2**63 - 1}, "seed"),
])
def test_booleans_and_huge_seeds_are_400s(strict, body, param):
    assert openai_error(strict.post("/v1/completions", json=body), 400)["param"] == param


@pytest.mark.parametrize("body, words", [
    (b"[" * 10_000 + b"]" * 10_000, "nested"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "UTF-8"),
], ids=["nested-10000-deep", "not-utf8"])
@pytest.mark.parametrize("path", [CHAT, "/v1/completions", MESSAGES, "/tokenize"])
def test_unparseable_bodies_are_400s(strict, body, words, path):
    r = strict.post(path, content=body, headers=JSON)
    error = anthropic_error(r, 400) if path == MESSAGES else openai_error(r, 400)
    assert words in error["message"], error


def test_context_overflow_reports_sizes(strict):
    long = [{"role": "user", "content": "word " * 400}]
    error = openai_error(strict.post(CHAT, json={"messages": long}), 400)
    assert error["code"] == "context_length_exceeded" and error["n_ctx"] == 256 and error["n_prompt_tokens"] > 256
    error = anthropic_error(strict.post(MESSAGES, json={"max_tokens": 5, "messages": long}), 400)
    assert error["n_ctx"] == 256 and error["n_prompt_tokens"] > 256
    error = openai_error(strict.post("/v1/completions", json={"prompt": [2] * 300}), 400)
    assert error["n_prompt_tokens"] == 300


def test_oversized_body(strict):
    big = [{"role": "user", "content": "x" * 70_000}]
    assert "larger" in openai_error(strict.post(CHAT, json={"messages": big}), 413)["message"]
    assert anthropic_error(strict.post(MESSAGES, json={"max_tokens": 5, "messages": big}), 413)["type"] == \
        "request_too_large"


def test_full_queue_gets_503_with_retry_after(strict):
    """One slot and max_queue=0: while one request runs, the next is refused at once, in each API's shape."""
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 200, "temperature": 0, "stream": True}
    with strict.stream("POST", "/v1/completions", json=body) as running:
        assert running.status_code == 200  # admitted: the status line is sent after admission
        r = strict.post(CHAT, json={"messages": USER, "max_tokens": 2})
        error = openai_error(r, 503)
        assert error["code"] == "server_busy" and "slots are in use" in error["message"]
        assert int(r.headers["retry-after"]) >= 1
        r = strict.post(MESSAGES, json={"messages": USER, "max_tokens": 2})
        assert anthropic_error(r, 503)["type"] == "overloaded_error" and "retry-after" in r.headers


def test_unknown_path_and_method(strict):
    openai_error(strict.get("/v1/nope"), 404)
    assert strict.get(CHAT).status_code == 405


def test_health_is_503_while_loading_then_200(embedded_engine):
    release = threading.Event()
    engine: list[Engine] = []

    def slow_load() -> Engine:
        release.wait(120)
        engine.append(embedded_engine(64))
        return engine[0]

    with live_server(slow_load, ServerSettings(), wait_ready=False) as url:
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["error"] == {
            "message": "Loading model", "type": "unavailable_error", "param": None, "code": 503}
        openai_error(httpx.post(f"{url}{CHAT}", json={"messages": USER}), 503)
        assert anthropic_error(httpx.post(f"{url}{MESSAGES}", json={"max_tokens": 2, "messages": USER}), 503)[
            "type"] == "overloaded_error"
        release.set()
        for _ in range(600):
            if httpx.get(f"{url}/health").status_code == 200:
                break
            threading.Event().wait(0.1)
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_failed_load_is_reported():
    def broken() -> Engine:
        raise ValueError("no such model: nope.gguf")

    with live_server(broken, ServerSettings(), wait_ready=False) as url:
        for _ in range(100):
            r = httpx.get(f"{url}/health")
            if r.status_code != 503:
                break
            threading.Event().wait(0.05)
        assert "nope.gguf" in openai_error(r, 500)["message"]


def test_vanishing_temperature_or_top_p_is_greedy_not_a_500(strict):
    """temperature 1e-320 and top_p 5e-324 were 500s (inf / nan in the sampler): both mean "the best token"."""
    body = {"messages": USER, "max_tokens": 4, "seed": 1}
    greedy = strict.post(CHAT, json=body | {"temperature": 0})
    assert greedy.status_code == 200, greedy.text
    for extreme in ({"temperature": 1e-320}, {"temperature": 1.0, "top_p": 5e-324}):
        r = strict.post(CHAT, json=body | extreme)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]


@pytest.mark.parametrize("path, body, param", [
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "inf"}', "temperature"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "nan"}', "temperature"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 101}', "temperature"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "min_p": "-inf"}', "min_p"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 1.5}', "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "top_k": -3}', "top_k"),
    ("/v1/responses", b'{"input": "hi", "top_p": 0}', "top_p"),
    ("/v1/responses", b'{"input": "hi", "temperature": "inf"}', "temperature"),
    ("/v1/responses", b'{"input": "hi", "text": {"format": "json"}}', "text.format"),
    ("/v1/responses", b'{"input": "hi", "text": {"format": {"type": "yaml"}}}', "text.format.type"),
    ("/v1/responses", b'{"input": "hi", "text": {"format": {"type": "json_schema"}}}', "text.format"),
    ("/v1/responses", b'{"input": "hi", "text": {"format": {"type": "json_schema", "schema": 5}}}',
     "text.format.schema"),
    (CHAT, json.dumps({"messages": USER, "stop": ["x"] * 65}).encode(), "stop"),
    (CHAT, json.dumps({"messages": USER, "stop": "x" * 5000}).encode(), "stop"),
])
def test_out_of_range_sampling_and_bad_formats_name_the_field(strict, path, body, param):
    error = openai_error(strict.post(path, content=body, headers=JSON), 400)
    assert error["param"] == param, error


@pytest.mark.parametrize("body", [
    b'{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
    b'{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}',
    json.dumps({"max_tokens": 5, "messages": USER, "stop_sequences": ["s" * 4097]}).encode(),
])
def test_anthropic_out_of_range_fields_are_400s(strict, body):
    error = anthropic_error(strict.post(MESSAGES, content=body, headers=JSON), 400)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("fmt", [{"type": "text"}, {"type": "json_object"},
                                 {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}])
def test_responses_accepts_the_documented_text_formats(strict, fmt):
    r = strict.post("/v1/responses", json={"input": "Say {}.", "max_output_tokens": 2, "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    assert r.json()["text"]["format"]["type"] == fmt["type"]


WRONG_TYPES = ["x", {"type": [1], "format": "x", "name": 5, "effort": {}, "schema": 3}, [{}], -1, 1e300]


@pytest.mark.parametrize("path, schema, base", [
    (CHAT, ChatCompletionRequest, {"messages": USER, "max_tokens": 1}),
    ("/v1/completions", CompletionRequest, {"prompt": "hi", "max_tokens": 1}),
    (MESSAGES, MessagesRequest, {"messages": USER, "max_tokens": 1}),
    ("/v1/messages/count_tokens", CountTokensRequest, {"messages": USER}),
    ("/v1/responses", ResponsesRequest, {"input": "hi", "max_output_tokens": 1}),
])
def test_no_field_of_any_wrong_type_is_a_500(strict, path, schema, base):
    """Every field of each request schema, given values of the wrong type: a 4xx or an answer, never a 5xx."""
    for field in schema.__struct_fields__:
        for value in WRONG_TYPES:
            r = strict.post(path, json=base | {field: value})
            assert r.status_code < 500, (field, value, r.text)
