"""`minerva serve` on a tiny random model: the API key, the waiting-queue bound, SIGTERM, and a
property-based fuzzer (schemathesis) against the OpenAPI schema the server publishes.

The tiny model generates in about a millisecond a token, so the fuzzer's requests stay short."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from minerva import LLM
from tests.helpers.cli import assert_clean_error, run
from tests.helpers.server import free_port, is_up, metric, running_server, wait_for

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tiny):
    llm = LLM(str(tiny), device="cpu", dtype="float32", kv_cache_memory=4e6, max_num_seqs=2)
    with running_server(llm, api_key=KEY, max_waiting=2, max_body_bytes=1 << 16) as (url, app):
        yield url, app


def test_api_key(served):
    url = served[0]
    body = {"prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH).status_code == 200
    for header in (f"bearer {KEY}", f"BEARER {KEY}"):  # the scheme is case-insensitive (RFC 7235)
        assert httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": header}).status_code == 200
    for header in (KEY, f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", f"Bearer{KEY}"):
        assert httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": header}).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200  # only health (and the page) stay open
    for route in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models", "/healthz", "/ui"):
        r = httpx.get(f"{url}{route}")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", route
    for route in ("/metrics", "/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{url}{route}", headers=AUTH).status_code == 200, route
    twice = httpx.Headers([("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer other")])
    for headers in (twice, httpx.Headers([("Authorization", f"Bearer {KEY}")] * 2)):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 400 and "more than one Authorization header" in r.json()["error"]["message"]


def test_body_limit(served):
    url = served[0]
    r = httpx.post(f"{url}/v1/completions", content=b"{" + b" " * (1 << 17) + b"}", headers=AUTH)
    assert r.status_code == 413

    def chunked():  # no Content-Length: the limit holds on the bytes actually sent
        for _ in range(40):
            yield b" " * 4096

    r = httpx.post(f"{url}/v1/completions", content=chunked(), headers=AUTH)
    assert r.status_code == 413
    # the rest of the body goes unread: the connection closes after the answer (it stayed open,
    # and the unread bytes then drew a stray 408 on it)
    assert r.headers["connection"] == "close"


def test_queue_full_is_503_with_retry_after(served):
    """Two running (max_num_seqs), two waiting (--max-waiting): the rest are turned away at once."""
    url = served[0]
    body = {"prompt": "abc", "max_tokens": 60, "ignore_eos": True}
    results = []

    def one():
        r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
        results.append((r.status_code, r.headers.get("retry-after"), r.json()))

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(code for code, _, _ in results)
    assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
    for code, retry, body in results:
        if code == 503:
            assert retry and "max-waiting" in body["error"]["message"]
        else:
            assert body["usage"]["completion_tokens"] == 60
    wait_for(lambda: metric(url, "minerva:kv_cache_used_blocks", headers=AUTH) == 0, what="KV blocks freed")


@pytest.fixture(scope="module")
def api_schema(served):
    url = served[0]
    schema = schemathesis.openapi.from_dict(httpx.get(f"{url}/openapi.json", headers=AUTH).json())
    schema.config.update(base_url=url)
    return schema


def operations(schema) -> list:
    ops = [result.ok() for result in schema.get_all_operations()]
    assert ops, "the published schema has no operations"
    return ops


# Each operation is driven by its own hypothesis strategy (not schemathesis' pytest plugin,
# which depends on pytest internals that change between releases).
# /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models, /v1/models/{id}, /health, /tokenize,
# /detokenize, /metrics, /v1/messages, /v1/messages/count_tokens, POST /v1/responses, GET and DELETE
# /v1/responses/{id}, Ollama's /api/chat, generate, embed, embeddings, show, pull, tags, ps, version
NUM_OPERATIONS = 23


@pytest.mark.parametrize("index", range(NUM_OPERATIONS))
def test_fuzz_no_server_error(api_schema, index):
    """Random valid and invalid bodies: never a 5xx other than 503 (busy), never a hang."""
    ops = operations(api_schema)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=ops[index].as_strategy())
    def check(case):
        response = case.call(headers=AUTH, timeout=20)
        assert response.status_code < 500 or response.status_code == 503, (response.status_code, response.text)
        if response.status_code >= 400:  # each API's own error shape
            error = response.json()["error"]
            assert error if case.path.startswith("/api/") else error["message"]

    check()


def test_every_operation_is_fuzzed(api_schema):
    ops = operations(api_schema)
    assert len(ops) == NUM_OPERATIONS, f"the schema has {len(ops)} operations: update NUM_OPERATIONS"


def test_still_healthy_after_fuzzing(served):
    url = served[0]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    wait_for(lambda: metric(url, "minerva:num_requests_running", headers=AUTH) == 0
             and metric(url, "minerva:kv_cache_used_blocks", headers=AUTH) == 0, what="an idle engine")


def test_cli_serve_sigterm(tiny):
    """`minerva serve` logs what it serves, answers, and on SIGTERM finishes in-flight work and exits."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minerva", "serve", str(tiny), "--port", str(port),
                             "--kv-cache-memory", "4e6", "--shutdown-timeout", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: is_up(url), timeout=120, what="minerva serve to start")
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out  # a shutdown asked for is a clean exit
    assert "Application shutdown complete" in out
    assert "serving tiny.gguf as 'tiny'" in out and "KV cache" in out and f"{url}/v1" in out, out
    assert "Traceback" not in out


def test_engine_failure_fails_requests_not_server(served, monkeypatch):
    """An exception inside an engine step fails the requests in flight; the next ones are served."""
    url, app = served
    engine = app.state.llm.engine
    real, calls = engine.step, []

    def broken():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real()

    # the fuzzing before may have ended requests with errors of their own (constraints that cannot be followed)
    before = metric(url, "minerva:request_success_total", 'finished_reason="error"', headers=AUTH)
    monkeypatch.setattr(engine, "step", broken)
    body = {"prompt": "abc", "max_tokens": 4}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    wait_for(lambda: metric(url, "minerva:kv_cache_used_blocks", headers=AUTH) == 0, what="KV blocks freed")
    assert metric(url, "minerva:request_success_total", 'finished_reason="error"', headers=AUTH) == before + 1


@pytest.mark.parametrize("flag,value", [("--max-waiting", "0"), ("--port", "70000"), ("--shutdown-timeout", "-1")])
def test_cli_serve_bad_flags(tiny, flag, value):
    assert_clean_error(run("serve", str(tiny), flag, value), flag)
