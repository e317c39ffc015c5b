"""What clients that work with other servers send: fields that cannot change a completion
accepted and named in a header, fields that would change it still a 400, bodies without a
JSON Content-Type read as JSON, and CORS for browser front-ends on other origins."""

from __future__ import annotations

import httpx
import openai
import pytest

from minerva import LLM
from minerva.serve import lenient
from tests.helpers.server import running_server

HEADER = "x-minerva-ignored-fields"


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    return LLM(str(tiny), device="cpu", dtype="float32", kv_cache_memory=4e6, max_num_seqs=2)


@pytest.fixture(scope="module")
def served(tiny_llm):
    with running_server(tiny_llm, served_model_name="tiny", api_key="k") as (url, _):
        yield url


def test_fields_that_cannot_change_the_output_are_accepted_and_named(served):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="k", max_retries=0)
    asked = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**asked)
    raw = client.chat.completions.with_raw_response.create(
        **asked, store=False, metadata={"run": "7"}, service_tier="auto", modalities=["text"],
        prompt_cache_key="conv-1", extra_body={"cache_prompt": True, "id_slot": 0, "priority": 3})
    assert raw.headers[HEADER] == ("store, metadata, service_tier, prompt_cache_key, modalities, cache_prompt, "
                                   "id_slot, priority")
    assert raw.parse().choices[0].message.content == plain.choices[0].message.content  # greedy: the same answer
    r = httpx.post(f"{served}/v1/completions", headers={"Authorization": "Bearer k"},
                   json={"prompt": "hi", "max_tokens": 2, "store": True, "keep_alive": "5m"})
    assert r.status_code == 200 and r.headers[HEADER] == "store, keep_alive"
    r = httpx.post(f"{served}/v1/completions", headers={"Authorization": "Bearer k"},
                   json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and HEADER not in r.headers


@pytest.mark.parametrize("field, value", [("audio", {"voice": "alloy", "format": "wav"}),
                                          ("modalities", ["text", "audio"]), ("web_search_options", {}),
                                          ("n_keep", 4)])
def test_fields_that_would_change_the_output_stay_refused(served, field, value):
    r = httpx.post(f"{served}/v1/chat/completions", headers={"Authorization": "Bearer k"},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field and "does not implement it" in r.json()["error"]["message"]


def test_a_json_body_under_another_content_type_is_read_as_json(served):
    body = b'{"prompt": "hi", "max_tokens": 2, "store": false}'
    for kind in ("application/x-www-form-urlencoded", "text/plain", None):  # curl -d, and others
        headers = {"Authorization": "Bearer k"} | ({"Content-Type": kind} if kind else {})
        r = httpx.post(f"{served}/v1/completions", content=body, headers=headers)
        assert r.status_code == 200, (kind, r.text)
        assert r.json()["usage"]["completion_tokens"] == 2 and r.headers[HEADER] == "store"
    r = httpx.post(f"{served}/v1/completions", content=b"prompt=hi", headers={
        "Authorization": "Bearer k", "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"  # not JSON: still refused
    assert r.json()["error"]["message"].startswith("the body is not valid JSON (")  # said as for a JSON type
    broken = b'{"messages": [{"role": "user", "content": "Hi"}],}'  # curl -d with a trailing comma
    for kind in ("application/x-www-form-urlencoded", "application/json"):
        r = httpx.post(f"{served}/v1/chat/completions", content=broken,
                       headers={"Authorization": "Bearer k", "Content-Type": kind})
        assert r.status_code == 400 and "the body is not valid JSON" in r.json()["error"]["message"], (kind, r.text)
    for kind in ("application/json", None):
        headers = {"Authorization": "Bearer k"} | ({"Content-Type": kind} if kind else {})
        r = httpx.post(f"{served}/v1/chat/completions", content=b"", headers=headers)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request body is empty"), r.text


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(f"{url}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_allows_this_machines_pages_by_default(served):
    r = preflight(served, "http://localhost:3000")  # no API key on a preflight: it is answered anyway
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert preflight(served, "http://127.0.0.1:8080").status_code == 200
    r = preflight(served, "https://evil.example")
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.post(f"{served}/v1/completions", json={"prompt": "hi", "max_tokens": 1, "store": False},
                   headers={"Origin": "http://localhost:3000", "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert HEADER in r.headers["access-control-expose-headers"]
    r = httpx.get(f"{served}/v1/models", headers={"Origin": "http://localhost:3000"})  # no key: 401 a page can read
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_allowed_origins_flag(tiny_llm):
    with running_server(tiny_llm, allowed_origins=("*",)) as (url, _):
        r = preflight(url, "https://chat.example.com")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    with running_server(tiny_llm, allowed_origins=("https://chat.example.com",)) as (url, _):
        assert preflight(url, "https://chat.example.com").status_code == 200
        assert preflight(url, "http://localhost:3000").status_code == 400  # only the origins given


def test_parse_origins():
    assert lenient.parse_origins("*") == ("*",)
    assert lenient.parse_origins('["*"]') == ("*",)  # vLLM's spelling
    assert lenient.parse_origins("http://localhost:3000, https://a.example") == ("http://localhost:3000",
                                                                                "https://a.example")
    for bad in ("", "localhost:3000", "http://a.example/", "[1]", "[]"):
        with pytest.raises(ValueError):
            lenient.parse_origins(bad)


def test_anthropic_style_api_key_header(served):
    assert httpx.get(f"{served}/v1/models", headers={"x-api-key": "k"}).status_code == 200
    r = httpx.get(f"{served}/v1/models", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and "x-api-key" in r.json()["error"]["message"]
