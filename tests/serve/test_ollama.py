"""Ollama's API with the official `ollama` SDK against a live server (SmolLM2): chat and generate,
whole and streamed (NDJSON), equal to the OpenAI routes' answers; options; format (JSON and a
schema); a tool call and its result; embeddings; tags, show, ps, version; timing fields;
errors in Ollama's shape; per-request keep_alive on a server of several models."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import jsonschema
import ollama
import openai
import pytest

from minerva import LLM
from minerva.models.loader import read_config
from minerva.serve.router import Router, build_router_app
from minerva.serve.serving import ServerConfig
from minerva.store import resolve
from tests.helpers.server import running_app, running_server, wait_for

ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]
GREEDY = {"temperature": 0, "num_predict": 24}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    llm = LLM(str(smollm2_gguf), device="cpu", dtype="float32", activations="float", kv_cache_memory=64e6)
    with running_server(llm, served_model_name="smollm2") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(served):
    return ollama.Client(host=served, timeout=120)


def openai_chat(served, messages, max_tokens, **extra):
    oai = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    return oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0,
                                       **extra)


def test_chat_whole_and_streamed(served, client):
    want = openai_chat(served, ASK, 24)
    r = client.chat(model="smollm2:latest", messages=ASK, options=GREEDY, stream=False)
    assert r.message.role == "assistant" and r.message.content == want.choices[0].message.content
    assert r.done and r.done_reason == {"length": "length", "stop": "stop"}[want.choices[0].finish_reason]
    assert r.prompt_eval_count == want.usage.prompt_tokens and r.eval_count == want.usage.completion_tokens
    assert 0 < r.prompt_eval_duration < r.total_duration and 0 < r.eval_duration < r.total_duration
    parts = list(client.chat(model="smollm2", messages=ASK, options=GREEDY, stream=True))
    raw = httpx.post(f"{served}/api/chat", json={"model": "smollm2", "messages": ASK, "options": GREEDY})
    lines = raw.text.splitlines()  # the API streams by default (the SDK asks for stream: false by default)
    assert raw.headers["content-type"] == "application/x-ndjson" and len(lines) > 2  # as many as the steps gave
    assert "".join(json.loads(x)["message"]["content"] for x in lines) == r.message.content
    assert [json.loads(x)["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert "".join(p.message.content for p in parts) == r.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 2
    assert parts[-1].eval_count == r.eval_count and parts[-1].done_reason == r.done_reason


def test_generate_through_the_template_and_raw(served, client):
    want = openai_chat(served, [{"role": "system", "content": "Be brief."}, *ASK], 24)
    r = client.generate(model="smollm2", prompt=ASK[0]["content"], system="Be brief.", options=GREEDY)
    assert r.response == want.choices[0].message.content and r.done
    oai = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    raw = oai.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = list(client.generate(model="smollm2", prompt="The capital of France is", raw=True, stream=True,
                                    options={"temperature": 0, "num_predict": 8}))
    assert "".join(p.response for p in streamed) == raw.choices[0].text
    assert client.generate(model="smollm2", prompt="").done_reason == "load"  # Ollama's way to load a model


def test_options_and_format(client):
    long = client.chat(model="smollm2", messages=ASK, options={"temperature": 0, "num_predict": 5, "stop": ["\n"],
                                                               "num_ctx": 4096, "top_k": 40, "repeat_penalty": 1.1})
    assert long.eval_count <= 5 and "\n" not in long.message.content
    seeded = [client.chat(model="smollm2", messages=ASK, options={"seed": 7, "num_predict": 12}).message.content
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    as_json = client.chat(model="smollm2", messages=ASK, format="json", options={"temperature": 0, "num_predict": 48})
    json.loads(as_json.message.content)
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"],
              "additionalProperties": False}
    held = client.chat(model="smollm2", messages=ASK, format=schema, options={"temperature": 0, "num_predict": 48})
    jsonschema.validate(json.loads(held.message.content), schema)


def test_tool_call_and_its_result(served, client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    shot = [{"role": "user", "content": "What is the weather in London?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                              "arguments": {"city": "London"}}}]},
            {"role": "tool", "content": json.dumps({"temp": 12}), "tool_name": "get_weather"},
            {"role": "assistant", "content": "It is 12 degrees in London."}]
    r = client.chat(model="smollm2", messages=shot + ask, tools=[WEATHER], options={"temperature": 0, "num_predict": 64})
    calls = r.message.tool_calls or []
    want = openai_chat(served, [*shot[:1], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "London"}'}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": json.dumps({"temp": 12})}, shot[3], *ask], 64,
        tools=[WEATHER])
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in want.choices[0].message.tool_calls or []]
    streamed = list(client.chat(model="smollm2", messages=shot + ask, tools=[WEATHER], stream=True,
                                options={"temperature": 0, "num_predict": 64}))
    s_calls = [c for p in streamed for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in s_calls] == [
        (c.function.name, dict(c.function.arguments)) for c in calls]


def test_embed(served, client):
    oai = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    want = oai.embeddings.create(model="smollm2", input=["hello", "world"])
    r = client.embed(model="smollm2", input=["hello", "world"])
    assert len(r.embeddings) == 2 and r.embeddings[0] == pytest.approx(want.data[0].embedding, abs=1e-6)
    assert r.prompt_eval_count == want.usage.prompt_tokens
    old = client.embeddings(model="smollm2", prompt="hello")
    assert old.embedding == pytest.approx(want.data[0].embedding, abs=1e-6)
    assert client.embed(model="smollm2", input=[]).embeddings == []  # nothing to embed: no vectors, as Ollama
    with pytest.raises(ollama.ResponseError, match="not found"):
        client.embed(model="nothing", input=[])


def test_embed_truncates_the_end_of_a_long_input(tiny):
    """truncate (default true) keeps an over-long input's first tokens, as Ollama does; false
    is a 400. /v1/embeddings' truncate_prompt_tokens -1 keeps the last ones instead."""
    llm = LLM(str(tiny), dtype="float32", activations="float", kv_cache_memory=20e6)
    text = "the cat sat on the mat. " * 20  # 480 bytes: past the 256-token context
    ids = llm.encode_prompt(text)
    most = llm.engine.max_model_len - 1
    assert len(ids) > most
    with running_server(llm, served_model_name="tiny") as (url, _):
        client = ollama.Client(host=url, timeout=120)
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = client.embed(model="tiny", input=text)
        assert r.prompt_eval_count == most
        first = oai.embeddings.create(model="tiny", input=[ids[:most]]).data[0].embedding
        assert r.embeddings[0] == pytest.approx(first, abs=1e-6)
        with pytest.raises(ollama.ResponseError, match="shorten it"):
            client.embed(model="tiny", input=text, truncate=False)
        end = oai.embeddings.create(model="tiny", input=text, extra_body={"truncate_prompt_tokens": -1})
        assert end.usage.prompt_tokens == most
        last = oai.embeddings.create(model="tiny", input=[ids[-most:]]).data[0].embedding
        assert end.data[0].embedding == pytest.approx(last, abs=1e-6)
        assert end.data[0].embedding != pytest.approx(first, abs=1e-3)


def test_tags_show_ps_version(served, client, smollm2_gguf):
    tags = client.list()
    assert [m.model for m in tags.models] == ["smollm2:latest"]
    m = tags.models[0]
    assert m.size == smollm2_gguf.stat().st_size and m.details.family == "llama" and m.details.format == "gguf"
    assert m.details.parameter_size == "135M" and m.details.quantization_level == "Q4_1"
    shown = client.show("smollm2")
    assert shown.details.family == "llama" and "completion" in shown.capabilities
    context = httpx.get(f"{served}/v1/models").json()["data"][0]["max_model_len"]
    assert shown.modelinfo["llama.context_length"] == context > 0  # the key by family, as Ollama's
    assert [p.model for p in client.ps().models] == ["smollm2:latest"]
    assert httpx.get(f"{served}/api/version").json()["version"]


@pytest.mark.parametrize("path, body, status, words", [
    ("/api/chat", {"model": "nothing", "messages": ASK}, 404, "does not exist"),
    ("/api/chat", {"model": "smollm2", "messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]}, 400,
     "text-only"),
    ("/api/chat", {"model": "smollm2", "messages": ASK, "options": {"mirostat": 2}}, 400, "mirostat"),
    ("/api/chat", {"model": "smollm2", "messages": ASK, "options": {"warp": 1}}, 400, "unknown option 'warp'"),
    ("/api/generate", {"model": "smollm2", "prompt": "hi", "context": [1, 2]}, 400, "'context'"),
    ("/api/chat", {"model": "smollm2", "messages": ASK, "keep_alive": "soon"}, 400, "keep_alive"),
    ("/api/show", {"model": "nothing"}, 404, "not found"),
    ("/api/chat", {"messages": ASK}, 400, "model"),
    # a num_predict that is neither a count nor -1 / -2 is refused, not dropped (it ran to the context)
    *[("/api/chat", {"model": "smollm2", "messages": ASK, "options": {"num_predict": n}}, 400, "options.num_predict")
      for n in ("5", 3.5, 0, -7, True)],
    *[("/api/chat", {"model": "smollm2", "messages": ASK, "keep_alive": v}, 400, "keep_alive must be a finite")
      for v in ("nan", "inf", "-Infinity")],
    ("/api/show", {}, 400, "model is required"),
    ("/api/chat", {"model": "smollm2", "messages": ASK, "options": {"seed": "7"}}, 400, "options.seed"),
    ("/api/chat", {"model": "smollm2", "messages": ASK, "options": {"stop": [""]}}, 400,
     "options.stop.0: String should have at least 1 character"),
    ("/api/embed", {"model": "smollm2", "input": "hi", "options": {"warp": 1}}, 400, "unknown option 'warp'"),
    ("/api/embed", {"model": "smollm2", "input": "hi", "dimensions": 0}, 400, "dimensions must be at least 1"),
    # the chat route's check of the constraint, naming Ollama's field (it said response_format)
    ("/api/chat", {"model": "smollm2", "messages": ASK, "format": {"type": "bogus"}}, 400, "invalid field 'format'"),
    ("/api/generate", {"model": "nothing", "prompt": ""}, 404, "the model 'nothing' does not exist"),
])
def test_errors_in_ollamas_shape(served, path, body, status, words):
    r = httpx.post(f"{served}{path}", json={**({} if path == "/api/embed" else {"stream": False}), **body}, timeout=60)
    assert r.status_code == status and list(r.json()) == ["error"] and words in r.json()["error"], r.text


def test_generate_without_a_prompt_loads_the_model(served):
    r = httpx.post(f"{served}/api/generate", json={"model": "smollm2:latest"}, timeout=60)
    assert r.status_code == 200 and r.json()["done_reason"] == "load", r.text


def test_load_unload_and_show_on_a_server_of_several(tiny, tmp_path):
    """Ollama's preload (/api/generate without a prompt) loads the model as its requests do, and
    a model that cannot load gets their 503; keep_alive 0 unloads without loading; /api/show of
    a model whose file does not read is that 503 too, not details made of nothing."""
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    loads = []

    def load(model: str):
        loads.append(model)
        return LLM(model, dtype="float32", activations="float", kv_cache_memory=4e6), None

    config = ServerConfig("tiny")
    router = Router([("tiny", str(tiny)), ("empty", str(empty))], load, config, keep_alive=None,
                    check=lambda m: read_config(resolve(m)))
    with running_app(build_router_app(router, config), config) as (url, _):
        def ollama_post(route, body):
            return httpx.post(f"{url}{route}", json=body, timeout=120)

        r = ollama_post("/api/generate", {"model": "tiny", "keep_alive": 0})
        assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
        assert loads == [] and router.models["tiny"].routes is None  # not loaded to be unloaded
        info = ollama_post("/api/show", {"model": "tiny"}).json()["model_info"]  # not loaded: the trained context
        assert info["llama.context_length"] == info["context_length"] == read_config(tiny).max_position > 0, info
        assert loads == []  # (showing it did not load it)
        r = ollama_post("/api/generate", {"model": "tiny:latest"})
        assert r.status_code == 200 and r.json()["done_reason"] == "load", r.text
        assert loads == [str(tiny)] and router.models["tiny"].routes is not None
        shown = ollama_post("/api/show", {"model": "tiny"}).json()
        assert shown["model_info"]["llama.context_length"] == shown["model_info"]["context_length"] > 0, shown
        for route, body in (("/api/generate", {"model": "empty"}), ("/api/show", {"model": "empty"}),
                            ("/api/generate", {"model": "empty", "prompt": "hi", "stream": False})):
            r = ollama_post(route, body)
            assert r.status_code == 503 and list(r.json()) == ["error"], (route, r.text)
            assert r.json()["error"].startswith("the model 'empty' could not be loaded: "), r.text
        r = httpx.post(f"{url}/v1/completions", json={"model": "empty", "prompt": "hi"}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "model_load_error", r.text
        assert loads == [str(tiny)]  # its header did not read: no load was tried
        r = ollama_post("/api/generate", {"model": "tiny", "keep_alive": 0})
        assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
        wait_for(lambda: router.models["tiny"].routes is None, timeout=10, what="tiny unloaded")


def test_a_pulled_name_not_yet_loaded_is_shown_from_its_file(smollm2_gguf):
    """A server of several, a model named as pulled (not a path) and not loaded: /v1/models gives
    its file as its root, and /api/tags and /api/show its family, quantization and context,
    read from that file without loading it."""
    loads = []
    config = ServerConfig("smollm2-135m")
    router = Router([("smollm2-135m", "smollm2-135m")], lambda model: loads.append(model), config, keep_alive=None,
                    check=lambda m: read_config(resolve(m)))
    with running_app(build_router_app(router, config), config) as (url, _):
        card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        assert card["root"] == str(smollm2_gguf) and card["loaded"] is False, card
        tags = httpx.get(f"{url}/api/tags", timeout=30).json()["models"][0]["details"]
        assert (tags["family"], tags["quantization_level"]) == ("llama", "Q4_1"), tags
        info = httpx.post(f"{url}/api/show", json={"model": "smollm2-135m"}, timeout=30).json()["model_info"]
        assert info["llama.context_length"] == info["context_length"] == read_config(smollm2_gguf).max_position, info
    assert loads == []


def test_reading_headers_holds_up_no_other_request(tiny, monkeypatch):
    """/api/tags, /api/ps and /api/show read the models' headers (a second or more for a large
    vocabulary) on a worker thread: the server answers other requests meanwhile."""
    from minerva.serve import ollama_models
    released, reading, read = threading.Event(), threading.Event(), ollama_models.header

    def slow_header(root):
        reading.set()
        assert released.wait(30), "not released"
        return read(root)

    monkeypatch.setattr(ollama_models, "header", slow_header)
    config = ServerConfig("tiny")
    router = Router([("tiny", str(tiny))], lambda model: None, config, keep_alive=None)
    with running_app(build_router_app(router, config), config) as (url, _):
        for route, send in (("/api/tags", httpx.get), ("/api/show", httpx.post)):
            ollama_models._DETAILS.clear()
            reading.clear(), released.clear()
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(send, f"{url}{route}", **({"json": {"model": "tiny"}} if send is httpx.post else {}),
                                     timeout=60)
                assert reading.wait(30), route
                assert httpx.get(f"{url}/health", timeout=5).status_code == 200, route  # while the header is read
                released.set()
                assert answer.result().status_code == 200, route


def test_keep_alive_per_request_unloads(smollm2_gguf, tiny):
    """A server of several: keep_alive 0 unloads the model once its request ends; another
    request without one brings back the server's keep-alive (never, here)."""
    def load(model: str):
        return LLM(model, dtype="float32", activations="float", kv_cache_memory=20e6), None

    router = Router([("smol", str(smollm2_gguf)), ("tiny", str(tiny))], load, ServerConfig("smol"), keep_alive=None)
    with running_app(build_router_app(router, ServerConfig("smol")), ServerConfig("smol")) as (url, _):
        client = ollama.Client(host=url, timeout=120)
        client.chat(model="smol", messages=ASK, options={"num_predict": 2}, keep_alive=0)
        wait_for(lambda: router.models["smol"].routes is None, timeout=10, what="smol unloaded")
        client.chat(model="smol", messages=ASK, options={"num_predict": 2})
        time.sleep(1)
        assert router.models["smol"].routes is not None
        # a request refused for another reason leaves its keep_alive untaken
        with pytest.raises(ollama.ResponseError, match="unknown option"):
            client.chat(model="smol", messages=ASK, options={"bogus": 1}, keep_alive=0)
        time.sleep(1)
        assert router.models["smol"].routes is not None
        assert [m.model for m in client.ps().models] == ["smol:latest"]


def test_num_predict_past_the_context_stops_at_the_context(tiny):
    """As Ollama does: a num_predict the context cannot hold generates up to the context (the
    OpenAI routes' 400 is theirs alone)."""
    llm = LLM(str(tiny), dtype="float32", activations="float", kv_cache_memory=20e6)
    room = llm.engine.max_model_len - len(llm.encode_prompt("hello"))
    with running_server(llm, served_model_name="tiny") as (url, _):
        r = ollama.Client(host=url, timeout=120).generate(model="tiny", prompt="hello", raw=True,
                                                          options={"num_predict": 1000, "temperature": 0})
        assert r.done_reason in ("length", "stop") and 0 < r.eval_count <= room, r
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="max_tokens asks for 1000"):
            oai.completions.create(model="tiny", prompt="hello", max_tokens=1000)
