"""Ollama's /api/pull with the official `ollama` SDK: a server of several started with
--allow-pull fetches a Hugging Face repo from a hub on 127.0.0.1 (`HF_ENDPOINT`), streams
the progress and serves the model; bad names, missing repos, servers that do not pull."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import ollama
import pytest

from minerva import LLM
from minerva.models.loader import read_config
from minerva.serve.router import Router, build_router_app
from minerva.serve.serving import ServerConfig
from minerva.store import pull, resolve
from tests.helpers.hubserver import Hub
from tests.helpers.server import running_app, running_server, wait_for

REPO = "hf.co/test/tiny-GGUF:Q8_0"


@pytest.fixture(scope="module")
def hub_server(tiny):
    with Hub() as server:
        server.add("test/tiny-GGUF", {"tiny-Q8_0.gguf": tiny})
        yield server


@pytest.fixture
def hf_env(hub_server, tmp_path, monkeypatch):
    """A fresh Hugging Face cache and model store, the test hub as the endpoint, online."""
    monkeypatch.setenv("MINERVA_HOME", str(tmp_path / "home"))
    return hub_server.use(monkeypatch, tmp_path / "hf-cache")


@pytest.fixture
def router_server(tiny):
    """start(models, allow_pull) -> the URL of a server of several over `models` (name, model)."""
    started = []

    def start(models, allow_pull=True):
        config = ServerConfig(models[0][0])
        router = Router(models, lambda m: (LLM(m, dtype="float32", activations="float", kv_cache_memory=4e6), None),
                        config, check=lambda m: read_config(resolve(m)), fetch=lambda m: pull(m, progress=False),
                        allow_pull=allow_pull)
        cm = running_app(build_router_app(router, config), config)
        url, _ = cm.__enter__()
        started.append(cm)
        return url

    yield start
    for cm in started:
        cm.__exit__(None, None, None)


def test_a_pulled_repo_is_streamed_then_served(hf_env, router_server, tiny):
    url = router_server([("tiny", str(tiny))])
    client = ollama.Client(host=url, timeout=60)
    assert [m.model for m in client.list().models] == ["tiny:latest"]
    parts = list(client.pull(REPO, stream=True))
    assert parts[0].status == "pulling manifest" and parts[-1].status == "success"
    written = [p.completed for p in parts if p.status == "downloading"]
    assert written and written == sorted(written) and written[-1] >= tiny.stat().st_size  # (and the cache's refs)
    assert [m.model for m in client.list().models] == ["tiny:latest", f"{REPO}:latest"]
    r = httpx.post(f"{url}/v1/completions", json={"model": REPO, "prompt": "ab", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    same = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 3,
                                                     "temperature": 0})
    assert r.json()["choices"][0]["text"] == same.json()["choices"][0]["text"]  # the file the hub served
    assert client.pull(REPO, stream=False).status == "success"  # pulled again: cached, not downloaded again
    assert client.pull(f"{REPO}:latest", stream=False).status == "success"
    assert hf_env.downloads("tiny-Q8_0.gguf") == [None]


def test_clients_pulling_one_model_at_once_download_it_once(hf_env, router_server, tiny):
    url = router_server([("tiny", str(tiny))])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: httpx.post(f"{url}/api/pull", json={"model": REPO, "stream": False},
                                                     timeout=60), range(4)))
    assert [(a.status_code, a.json()) for a in answers] == [(200, {"status": "success"})] * 4
    assert hf_env.downloads("tiny-Q8_0.gguf") == [None]
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny", REPO]


def test_what_cannot_be_pulled_is_said(hf_env, router_server, tiny):
    url = router_server([("tiny", str(tiny))])
    client = ollama.Client(host=url, timeout=60)
    for name, said in (("llama3.2", "'llama3.2' is neither a built-in model"),
                       (str(tiny), "is a path on the server"),
                       ("hf.co/test", "does not name a Hugging Face repo")):
        with pytest.raises(ollama.ResponseError) as err:
            client.pull(name, stream=False)
        assert err.value.status_code == 400 and said in err.value.error
    with pytest.raises(ollama.ResponseError) as err:  # a repo the hub lacks: the stream's last line
        list(client.pull("hf.co/test/nope-GGUF", stream=True))
    assert "'hf.co/test/nope-GGUF' could not be pulled: no model repo 'test/nope-GGUF'" in err.value.error
    r = httpx.post(f"{url}/api/pull", json={"model": "hf.co/test/nope-GGUF", "stream": False})
    assert r.status_code == 400 and "could not be pulled" in r.json()["error"]
    r = httpx.post(f"{url}/api/pull", json={"stream": False})
    assert r.status_code == 400 and r.json()["error"].startswith("model is required")
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny"]


def test_without_allow_pull_only_the_listed_models_are_fetched(hf_env, router_server, tiny):
    url = router_server([("tiny", str(tiny)), (REPO, REPO)], allow_pull=False)
    client = ollama.Client(host=url, timeout=60)
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("hf.co/test/other-GGUF", stream=False)
    assert err.value.status_code == 403 and "start it with --allow-pull" in err.value.error
    assert client.pull("tiny", stream=False).status == "success"  # a file: nothing to fetch
    assert hf_env.downloads("tiny-Q8_0.gguf") == []
    assert list(client.pull(REPO, stream=True))[-1].status == "success"  # listed: fetched before its first request
    assert hf_env.downloads("tiny-Q8_0.gguf") == [None]
    r = httpx.post(f"{url}/v1/completions", json={"model": REPO, "prompt": "ab", "max_tokens": 2})
    assert r.status_code == 200 and hf_env.downloads("tiny-Q8_0.gguf") == [None]


def test_a_server_of_one_model_pulls_nothing(tiny):
    llm = LLM(str(tiny), dtype="float32", activations="float", kv_cache_memory=4e6)
    with running_server(llm, served_model_name="tiny") as (url, _):
        client = ollama.Client(host=url, timeout=60)
        assert client.pull("tiny:latest", stream=False).status == "success"
        with pytest.raises(ollama.ResponseError) as err:
            client.pull(REPO, stream=False)
        assert err.value.status_code == 403 and "serves one model, 'tiny'" in err.value.error
        assert "minerva serve --allow-pull" in err.value.error


def test_allow_pull_serves_the_pulled_models(hf_env, monkeypatch):
    """`minerva serve --allow-pull`: the default model, then what `minerva list` shows, each model
    that may be loaded at once with its share of the KV memory (more may be pulled)."""
    from minerva import cli
    from minerva.engine.engine import FIT
    from minerva.serve import several
    resolve(REPO)  # in the Hugging Face cache
    seen = []
    monkeypatch.setattr(several, "serve_models", lambda router, *a, **kw: seen.append(router))
    monkeypatch.setattr(several, "bind", lambda host, port: None)
    assert cli.main(["serve", "--allow-pull", "--kv-cache-memory", "4e6"]) == 0
    assert list(seen[-1].models) == ["smollm2-135m", "test/tiny-GGUF:Q8_0"] and seen[-1].allow_pull
    assert cli.main(["serve", "test/tiny-GGUF:Q8_0", "--allow-pull", "--max-loaded-models", "2"]) == 0
    assert list(seen[-1].models) == ["test/tiny-GGUF:Q8_0"]
    kv = []
    monkeypatch.setattr(several, "serve_models", lambda router, *a, **kw: kv.append(router.config))
    real = several.serve_several
    monkeypatch.setattr(several, "serve_several", lambda args, load: kv.append(args) or real(args, load))
    assert cli.main(["serve", "--allow-pull", "--max-loaded-models", "2"]) == 0
    assert kv[0].kv_cache_memory == FIT / 2


def held_fetch():
    """A router's fetch that notes each model asked for and waits for `release` before pulling it."""
    release, asked = threading.Event(), []

    def fetch(model):
        asked.append(model)
        release.wait(30)
        return pull(model, progress=False)

    return fetch, release, asked


def test_pulls_at_once_are_bounded(hf_env, tiny):
    """A fifth model pulled while four download is a 503 with Retry-After, and the server answers
    meanwhile; once they are done it is pulled."""
    from minerva.serve.router import PULLS_AT_ONCE
    fetch, release, started = held_fetch()
    config = ServerConfig("tiny")
    router = Router([("tiny", str(tiny))], lambda m: None, config, fetch=fetch, allow_pull=True)
    with running_app(build_router_app(router, config), config) as (url, _):
        names = [f"hf.co/test/m{i}-GGUF" for i in range(PULLS_AT_ONCE + 1)]
        with concurrent.futures.ThreadPoolExecutor(PULLS_AT_ONCE) as pool:
            first = [pool.submit(httpx.post, f"{url}/api/pull", json={"model": n, "stream": False}, timeout=60)
                     for n in names[:PULLS_AT_ONCE]]
            wait_for(lambda: len(started) == PULLS_AT_ONCE, timeout=30, what="the pulls to start")
            r = httpx.post(f"{url}/api/pull", json={"model": REPO, "stream": False})
            assert r.status_code == 503 and r.headers["retry-after"] == "10"
            assert f"{PULLS_AT_ONCE} models are being pulled" in r.json()["error"]
            assert httpx.get(f"{url}/health").status_code == 200
            release.set()
            assert all(f.result().status_code == 400 for f in first)  # (repos the hub lacks)
        r = httpx.post(f"{url}/api/pull", json={"model": REPO, "stream": False}, timeout=60)
        assert r.status_code == 200 and [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny", REPO]


def test_a_model_pulled_before_a_restart_answers_by_the_name_pulled(hf_env, router_server, tiny):
    """`minerva list`, which a server with --allow-pull starts from, names hf.co/OWNER/REPO:QUANT as
    OWNER/REPO:QUANT: either name is that model, on every route; OWNER/REPO pulled without a
    quantization is served under that name too once asked for (a model only fetchable is not)."""
    resolve(REPO)
    url = router_server([("tiny", str(tiny)), ("test/tiny-GGUF:Q8_0", "test/tiny-GGUF:Q8_0")])
    for name in (REPO, "hf.co/test/tiny-GGUF:q8_0", "huggingface.co//test/tiny-GGUF:Q8_0"):
        r = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "ab", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert httpx.post(f"{url}/api/show", json={"model": name}).json()["details"]["family"] == "llama"
        assert httpx.get(f"{url}/v1/models/{name}").json()["id"] == "test/tiny-GGUF:Q8_0"
        assert httpx.post(f"{url}/api/generate", json={"model": name}).json()["done_reason"] == "load"
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny", "test/tiny-GGUF:Q8_0"]
    r = httpx.post(f"{url}/v1/completions", json={"model": "hf.co/test/tiny-GGUF", "prompt": "ab", "max_tokens": 2})
    assert r.status_code == 200
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny", "test/tiny-GGUF:Q8_0",
                                                                              "hf.co/test/tiny-GGUF"]
    r = httpx.post(f"{url}/v1/completions", json={"model": "hf.co/test/other-GGUF", "prompt": "ab", "max_tokens": 2})
    assert r.status_code == 404 and hf_env.downloads("tiny-Q8_0.gguf") == [None]
    url = router_server([("tiny", str(tiny))], allow_pull=False)
    assert httpx.post(f"{url}/v1/completions", json={"model": REPO, "prompt": "ab"}).status_code == 404


def test_one_download_per_model_however_it_is_spelled(hf_env, tiny):
    """Clients pulling one model at once, under any of its spellings, wait on one download; a
    request for it meanwhile is a 503 with Retry-After (not a load of a file half there); then the
    model is served once, under the first name pulled."""
    fetch, release, fetched = held_fetch()
    config = ServerConfig("tiny")
    router = Router([("tiny", str(tiny))], lambda m: (LLM(m, dtype="float32", activations="float",
                                                          kv_cache_memory=4e6), None),
                    config, check=lambda m: read_config(resolve(m)), fetch=fetch, allow_pull=True)
    spellings = [REPO, "hf.co//test/tiny-GGUF:Q8_0", "HF.CO/test/tiny-GGUF:q8_0", "huggingface.co/test/tiny-GGUF:Q8_0",
                 "test/tiny-GGUF:Q8_0:latest"]
    with running_app(build_router_app(router, config), config) as (url, _):
        with concurrent.futures.ThreadPoolExecutor(len(spellings)) as pool:
            first = pool.submit(httpx.post, f"{url}/api/pull", json={"model": REPO, "stream": False}, timeout=60)
            wait_for(lambda: fetched, timeout=30, what="the pull to start")
            rest = [pool.submit(httpx.post, f"{url}/api/pull", json={"model": n, "stream": False}, timeout=60)
                    for n in spellings[1:]]
            r = httpx.post(f"{url}/v1/completions", json={"model": "test/tiny-GGUF:Q8_0", "prompt": "ab"})
            assert r.status_code == 503 and r.headers["retry-after"] == "10" and "is being pulled" in r.text
            release.set()
            assert [f.result().json() for f in [first, *rest]] == [{"status": "success"}] * len(spellings)
        assert fetched == [REPO] and hf_env.downloads("tiny-Q8_0.gguf") == [None]
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny", REPO]
        r = httpx.post(f"{url}/v1/completions", json={"model": "test/tiny-GGUF:Q8_0", "prompt": "ab", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == REPO


@pytest.mark.parametrize("name", ["~nosuchuser", "x" * 5000, "hf.co/" + "a/" * 3000, "a\0b"])
def test_names_no_path_can_have_are_400s(hf_env, router_server, tiny, name):
    url = router_server([("tiny", str(tiny))])
    r = httpx.post(f"{url}/api/pull", json={"model": name, "stream": False})
    assert r.status_code == 400 and len(r.json()["error"]) < 600
    r = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "ab"})
    assert r.status_code == 404


def test_a_quiet_pull_still_sends_lines(hf_env, tiny, monkeypatch):
    """While nothing is written (a checksum taken, a slow Hub) the stream still says something,
    for clients that time out reads."""
    from minerva.serve import ollama_pull
    monkeypatch.setattr(ollama_pull, "PROGRESS_EVERY", 0.05)
    monkeypatch.setattr(ollama_pull, "QUIET_AT_MOST", 0.2)
    release = threading.Event()
    config = ServerConfig("tiny")
    router = Router([("tiny", str(tiny))], lambda m: None, config,
                    fetch=lambda m: release.wait(30) and pull(m, progress=False), allow_pull=True)
    with running_app(build_router_app(router, config), config) as (url, _):
        lines = []
        with httpx.stream("POST", f"{url}/api/pull", json={"model": REPO}, timeout=30) as r:
            for line in r.iter_lines():
                lines.append(json.loads(line))
                if len(lines) == 4:
                    release.set()
    assert lines[0] == {"status": "pulling manifest"}
    assert lines[1:4] == [{"status": "downloading", "completed": 0}] * 3 and lines[-1] == {"status": "success"}
