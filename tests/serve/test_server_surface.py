"""The server's surface around the completions: unknown routes and methods in OpenAI's error
shape, `GET /v1/models/{id}`, several served names, the access log line, a port in use refused
before the model loads, and `minerva --version`."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from minerva import LLM, __version__
from minerva.serve.app import ServerConfig
from minerva.serve.server import describe
from tests.helpers.server import running_server


@pytest.fixture(scope="module")
def served(tiny):
    llm = LLM(str(tiny), device="cpu", dtype="float32", kv_cache_memory=8e6, max_num_seqs=4)
    with running_server(llm, served_model_name="tiny", aliases=("org/tiny-chat", "tiny")) as (url, app):
        yield url, app


def test_unknown_routes_and_methods(served):
    url = served[0]
    r = httpx.get(f"{url}/v1/nothing-here")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == ("Invalid URL (GET /v1/nothing-here): no such route; the routes are "
                                            "listed at /docs")
    r = httpx.get(f"{url}/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"] == (
        "Invalid method (GET /v1/chat/completions): this route takes POST")
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{url}/v1/responses/resp_x")  # two routes of one path: both methods
    assert r.status_code == 405 and r.json()["error"]["message"].endswith("this route takes DELETE, GET"), r.text
    assert r.headers["allow"] == "DELETE, GET"


def test_head_is_a_get_without_its_body(served):
    """HEAD of a GET route: the GET's status and headers, no body (Ollama's CLI checks a server by
    HEAD /); of a route that takes POST alone, its 405."""
    url = served[0]
    for path in ("/", "/health", "/v1/models", "/api/tags", "/api/version", "/ui/chat.js"):
        get, head = httpx.get(f"{url}{path}"), httpx.head(f"{url}{path}")
        assert head.status_code == get.status_code == 200 and head.content == b"", (path, head.status_code)
        assert head.headers["content-type"] == get.headers["content-type"], path
    assert httpx.head(f"{url}/v1/chat/completions").status_code == 405
    assert httpx.head(f"{url}/v1/nothing-here").status_code == 404


@pytest.mark.parametrize("method, path, body, bare_status", [
    ("GET", "/v1/responses/", None, 405), ("POST", "/v1/completions/", {"prompt": "hi", "max_tokens": 2}, 200),
    ("GET", "/health/", None, 200), ("GET", "/v1/models/", None, 200)])
def test_a_trailing_slash_is_a_404_naming_the_route(served, method, path, body, bare_status):
    """No redirect (an empty 307 that a client follows to a route of another method, or not at
    all): a 404 with the error body, naming the route without the '/'; the route itself answers."""
    url = served[0]
    r = httpx.request(method, f"{url}{path}", json=body, timeout=30)
    assert r.status_code == 404, (r.status_code, r.text)
    bare = path.rstrip("/")
    assert r.json()["error"]["message"] == (f"Invalid URL ({method} {path}): no such route; did you mean {bare}, "
                                            "without the '/'?")
    assert httpx.request(method, f"{url}{bare}", json=body, timeout=30).status_code == bare_status


def test_an_error_echoes_at_most_200_characters_of_what_it_names(served):
    url = served[0]
    path = "/v1/" + "x" * 60_000  # (httpx sends at most 64 KiB of URL)
    r = httpx.get(f"{url}{path}", timeout=30)
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and message.startswith(f"Invalid URL (GET {path[:200]}...): no such route"), message
    assert len(message) < 300
    r = httpx.get(f"{url}/v1/models/{'m' * 60_000}", timeout=30)
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and f"the model '{'m' * 200}...' does not exist" in message and len(message) < 400


def test_models_retrieve_and_names(served):
    url = served[0]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny", "org/tiny-chat"]  # each name once, the first first
    assert client.models.retrieve("org/tiny-chat").id == "org/tiny-chat"
    with pytest.raises(openai.NotFoundError, match="'tiny' or 'org/tiny-chat'"):
        client.models.retrieve("other")
    r = client.completions.create(model="org/tiny-chat", prompt="hi", max_tokens=2)
    assert r.model == "org/tiny-chat"  # answered under the name it was asked by
    assert client.completions.create(prompt="hi", max_tokens=2, model="tiny").model == "tiny"


def test_access_log_line(served, caplog):
    url = served[0]
    with caplog.at_level(logging.INFO, logger="minerva.access"):
        httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True},
                   timeout=30)
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True, "stream": True}) as r:
            r.read()
        httpx.get(f"{url}/v1/missing")
        deadline = time.monotonic() + 10
        while len([r for r in caplog.records if r.name == "minerva.access"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name == "minerva.access"]
    pattern = r'127\.0\.0\.1:\d+ "POST /v1/completions" 200 prompt=\d+ completion={} ttft=\d+\.\d+s \d+\.\d+s'
    assert re.fullmatch(pattern.format(3), lines[0]), lines
    assert re.fullmatch(pattern.format(4), lines[1]), lines
    assert re.fullmatch(r'127\.0\.0\.1:\d+ "GET /v1/missing" 404 \d+\.\d+s', lines[2]), lines


def test_port_in_use_is_refused_before_loading(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        missing = tmp_path / "never-read.gguf"  # the error must come before the model is even looked for
        r = subprocess.run([sys.executable, "-m", "minerva", "serve", str(missing), "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"minerva: error: port {port} on 127.0.0.1 is already in use (another server?); "
                                f"stop it or pick another with --port")


def test_version():
    r = subprocess.run([sys.executable, "-m", "minerva", "--version"], capture_output=True, text=True, timeout=60)
    first, *backends = r.stdout.splitlines()
    assert r.returncode == 0 and first == f"minerva {__version__}" and re.match(r"\d+\.\d+", __version__)
    assert [b.split(":")[0] for b in backends] == ["  kernels reference", "  kernels cpu", "  kernels triton"]


def test_the_chat_page_is_served_without_the_api_key(tiny):
    """The page and its files are public (they hold nothing); the API behind them keeps its key."""
    llm = LLM(str(tiny), device="cpu", dtype="float32", kv_cache_memory=4e6, max_num_seqs=2)
    with running_server(llm, api_key="sekret") as (url, _):
        page = httpx.get(f"{url}/")
        assert page.status_code == 200 and '<script src="/ui/chat.js">' in page.text
        for name, kind in (("chat.js", "javascript"), ("markdown.js", "javascript"), ("chat.css", "text/css")):
            r = httpx.get(f"{url}/ui/{name}")
            assert r.status_code == 200 and kind in r.headers["content-type"], name
        assert httpx.get(f"{url}/ui/nothing.js").status_code == 404
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.head(f"{url}/v1/models").status_code == 401 and httpx.head(f"{url}/").status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_the_start_line_names_the_kv_formats_in_use(tiny):
    """`minerva serve`'s start line gives the KV cache's precision, "auto" resolved to the dtype."""
    llm = LLM(str(tiny), device="cpu", dtype="float32", kv_cache_memory=4e6, kv_cache_dtype_v="int8")
    line = describe(llm, ServerConfig(served_model_name="tiny"), "http://127.0.0.1:8000")
    assert "k=float32 v=int8)" in line, line
