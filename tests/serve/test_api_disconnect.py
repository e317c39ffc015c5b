"""The Anthropic, Responses and Ollama routes share the chat route's guards: the API key on each,
and a client that hangs up mid-stream aborts its request and frees its KV blocks."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server import metric, wait_for

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
COUNT = [{"role": "user", "content": "Count from 1 to 500, separated by commas."}]  # a long greedy answer
STREAMS = {
    "anthropic": ("/v1/messages", {"model": "smollm2", "max_tokens": 1000, "temperature": 0, "stream": True,
                                   "messages": COUNT}),
    "responses": ("/v1/responses", {"model": "smollm2", "max_output_tokens": 1000, "temperature": 0, "stream": True,
                                    "input": COUNT}),
    "ollama": ("/api/chat", {"model": "smollm2", "messages": COUNT, "options": {"temperature": 0,
                                                                              "num_predict": 1000}}),
}


@pytest.mark.parametrize("api", list(STREAMS))
def test_disconnect_mid_stream_aborts_and_frees_blocks(served, api):
    path, body = STREAMS[api]
    aborted = metric(served, "minerva:request_success_total", 'finished_reason="abort"', headers=AUTH)
    with httpx.stream("POST", f"{served}{path}", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(12):  # a few events, then hang up
            next(lines)
    wait_for(lambda: metric(served, "minerva:num_requests_running", headers=AUTH) == 0
             and metric(served, "minerva:kv_cache_used_blocks", headers=AUTH) == 0, what="the blocks freed")
    assert metric(served, "minerva:request_success_total", 'finished_reason="abort"', headers=AUTH) == aborted + 1


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"model": "smollm2", "max_tokens": 2, "messages": COUNT}),
    ("/v1/messages/count_tokens", {"model": "smollm2", "messages": COUNT}),
    ("/v1/responses", {"model": "smollm2", "input": "Hi", "max_output_tokens": 2}),
    ("/api/chat", {"model": "smollm2", "messages": COUNT, "stream": False, "options": {"num_predict": 2}}),
    ("/api/generate", {"model": "smollm2", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}),
    ("/api/embed", {"model": "smollm2", "input": "Hi"}),
    ("/api/show", {"model": "smollm2"}),
])
def test_the_api_key_on_every_new_route(served, path, body):
    assert httpx.post(f"{served}{path}", json=body, timeout=60).status_code == 401
    assert httpx.post(f"{served}{path}", json=body, headers=AUTH, timeout=60).status_code == 200
    if path.startswith("/api/"):
        assert list(httpx.post(f"{served}{path}", json=body, timeout=60).json()) == ["error"]  # Ollama's shape
    for route in ("/api/tags", "/api/ps", "/api/version", "/v1/responses/resp_x"):
        assert httpx.get(f"{served}{route}").status_code == 401


def requests_by_route(url: str) -> dict[tuple, float]:
    """minerva:http_requests_total by (route, method, status), read with prometheus_client's parser
    (a route template's braces are inside the label values)."""
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "minerva:http_requests")
    return {(s.labels["route"], s.labels["method"], s.labels["status"]): s.value
            for s in family.samples if s.name.endswith("_total")}


def test_each_route_counts_in_the_metrics(served):
    httpx.get(f"{served}/health")
    before = requests_by_route(served)
    httpx.post(f"{served}/v1/messages", json=STREAMS["anthropic"][1] | {"stream": False, "max_tokens": 2},
               headers=AUTH, timeout=60)
    httpx.post(f"{served}/v1/responses", json={"model": "smollm2", "input": "Hi", "max_output_tokens": 2},
               headers=AUTH, timeout=60)
    httpx.post(f"{served}/api/chat", json={"model": "smollm2", "messages": COUNT, "stream": False,
                                           "options": {"num_predict": 2}}, headers=AUTH, timeout=60)
    httpx.get(f"{served}/v1/responses/resp_missing", headers=AUTH)
    httpx.get(f"{served}/v1/nothing", headers=AUTH)
    after = requests_by_route(served)
    for key in (("/v1/messages", "POST", "200"), ("/v1/responses", "POST", "200"), ("/api/chat", "POST", "200"),
                ("/v1/responses/{response_id}", "GET", "404"), ("other", "GET", "404")):
        assert after.get(key, 0) == before.get(key, 0) + 1, key
