"""Several models behind one server (`minerva serve A B`): a request's `model` picks one, a
model loads on its first request and unloads when idle or when another needs its place."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from minerva import LLM, SamplingParams
from minerva.models.loader import read_config
from minerva.serve.router import Router, build_router_app
from minerva.serve.serving import ServerConfig
from minerva.store import resolve
from tests.helpers.cli import assert_clean_error, run
from tests.helpers.server import metric, running_app, wait_for

OPTIONS = dict(dtype="float32", activations="float", kv_cache_memory=20e6)


@pytest.fixture
def serve_models(smollm2_gguf, tiny, tmp_path):
    """Start a router server over SmolLM2, the tiny model and a broken file; yields its URL
    and the router; `loads` counts the LLMs made per model argument."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 100)
    started = []

    def start(**kw):
        loads = []

        def load(model):
            loads.append(model)
            return LLM(model, **OPTIONS), None

        config = ServerConfig("smollm2")
        router = Router([("smollm2", str(smollm2_gguf)), ("tiny", str(tiny)), ("broken", str(broken))], load,
                        config, check=lambda m: read_config(resolve(m)), **kw)
        router.made = loads
        cm = running_app(build_router_app(router, config), config)
        url, _ = cm.__enter__()
        started.append(cm)
        return url, router

    yield start
    for cm in started:
        cm.__exit__(None, None, None)


def complete(url, model, prompt="The capital of France is", n=6, **kw):
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n,
                                                     "temperature": 0, **kw}, timeout=120)


def greedy(path, prompt="The capital of France is", n=6) -> str:
    llm = LLM(str(path), **OPTIONS)
    return llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0), use_tqdm=False)[0].outputs[0].text


def loaded(url) -> dict:
    return {m["id"]: m["loaded"] for m in httpx.get(f"{url}/v1/models").json()["data"]}


def test_each_model_answers_by_name_and_loads_on_demand(serve_models, smollm2_gguf, tiny):
    url, router = serve_models(keep_alive=None, max_loaded=3)
    assert loaded(url) == {"smollm2": False, "tiny": False, "broken": False}
    assert router.made == []  # nothing loads before it is asked for
    r = complete(url, "tiny", "ab")
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    assert r.json()["choices"][0]["text"] == greedy(tiny, "ab")
    r = complete(url, "smollm2")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy(smollm2_gguf)
    assert loaded(url) == {"smollm2": True, "tiny": True, "broken": False}
    card = httpx.get(f"{url}/v1/models/smollm2").json()
    assert card["loaded"] and card["max_model_len"] > 0 and card["root"] == str(smollm2_gguf)
    for _ in range(2):  # loaded models stay loaded
        assert complete(url, "tiny", "ab").status_code == 200
    assert router.made == [str(tiny), str(smollm2_gguf)]
    # metrics per model, under the model_name label of one registry
    assert metric(url, "minerva:generation_tokens_total", 'model_name="tiny"') == 18
    assert metric(url, "minerva:generation_tokens_total", 'model_name="smollm2"') == 6
    assert metric(url, "minerva:model_loads_total", 'model_name="smollm2"') == 1
    assert metric(url, "minerva:model_load_seconds", 'model_name="smollm2"') > 0
    r = complete(url, "nope")
    assert r.status_code == 404 and "'nope' does not exist; this server serves 'smollm2', 'tiny'" in \
        r.json()["error"]["message"]
    # a request without a model goes to the first one
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "smollm2"


def test_a_model_that_fails_to_load_leaves_the_others_serving(serve_models):
    url, _ = serve_models(keep_alive=None, max_loaded=3)
    assert complete(url, "tiny", "ab").status_code == 200
    r = complete(url, "broken")
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["type"] == "model_load_error" and "the model 'broken' could not be loaded" in error["message"]
    assert complete(url, "tiny", "ab").status_code == 200
    assert loaded(url) == {"smollm2": False, "tiny": True, "broken": False}


def test_least_recently_used_idle_model_makes_room(serve_models):
    url, router = serve_models(keep_alive=None, max_loaded=1)
    for model in ("tiny", "smollm2", "tiny", "tiny"):
        assert complete(url, model, "ab", 3).status_code == 200
        assert [m for m, on in loaded(url).items() if on] == [model]
    assert metric(url, "minerva:model_unloads_total", 'model_name="tiny",reason="room"') == 1
    assert metric(url, "minerva:model_unloads_total", 'model_name="smollm2",reason="room"') == 1
    assert len(router.made) == 3


def test_idle_models_unload_after_keep_alive(serve_models):
    url, _ = serve_models(keep_alive=0.5, max_loaded=3)
    assert complete(url, "tiny", "ab").status_code == 200
    assert loaded(url)["tiny"]
    wait_for(lambda: not loaded(url)["tiny"], timeout=10, what="the idle model to unload")
    assert metric(url, "minerva:model_unloads_total", 'model_name="tiny",reason="idle"') == 1
    assert complete(url, "tiny", "ab").status_code == 200  # and loads again on the next request


def test_a_model_with_requests_running_is_never_unloaded(serve_models):
    """With room for one model, a request for the other waits until the running stream ends."""
    url, _ = serve_models(keep_alive=0.2, max_loaded=1)
    assert complete(url, "smollm2", "Hi", 1).status_code == 200
    events, done = [], threading.Event()

    def stream():
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                          json={"model": "smollm2", "prompt": "Tell a long story.", "max_tokens": 48,
                                "stream": True, "ignore_eos": True,
                                "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append((time.monotonic(), json.loads(line[6:])))
        done.set()

    threading.Thread(target=stream, daemon=True).start()
    wait_for(lambda: len(events) >= 2, timeout=60, what="the stream to start")
    r = complete(url, "tiny", "ab", 2)  # waits for smollm2's stream, then loads in its place
    answered = time.monotonic()
    assert r.status_code == 200
    assert done.wait(60)
    finishes = [e["choices"][0]["finish_reason"] for _, e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finishes == ["length"]  # the stream ran to its end
    assert events[-1][1]["usage"]["completion_tokens"] == 48
    assert answered >= events[-1][0]


def test_serve_several_models_command_line(tmp_path, tiny):
    assert_clean_error(run("serve", str(tiny), "smollm2-135m", "--served-model-name", "x"),
                       "--served-model-name names one model")
    assert_clean_error(run("serve", str(tiny), "smollm2-135m", "--keep-alive", "soon"), "--keep-alive")
    assert_clean_error(run("serve", str(tiny), "smollm2-135m", "--max-loaded-models", "0"), "--max-loaded-models")
    assert_clean_error(run("serve", str(tiny), str(tiny)), f"the model '{tiny}' is given twice")
    upper = tmp_path / "tiny.GGUF"
    upper.write_bytes(tiny.read_bytes())
    assert_clean_error(run("serve", str(tiny), str(upper)), f"the models '{tiny}' and '{upper}' would both be "
                       "served as 'tiny' (a file by its stem); serve one of them, or rename one")
    assert_clean_error(run("serve", str(tiny), str(tmp_path / "nope.gguf")), "is neither a file or folder here")
    assert_clean_error(run("serve", str(tiny), "--keep-alive", "soon"), "--keep-alive")  # one model too


def test_models_of_one_server_share_the_default_kv_pool(monkeypatch, tiny, smollm2_gguf):
    """Each model that may be loaded at once gets its part of the fit, so they fit together."""
    from minerva import cli
    from minerva.engine.engine import FIT
    from minerva.serve import several
    seen = []
    monkeypatch.setattr(several, "serve_models", lambda router, *a, **kw: seen.append(cli_args[0].kv_cache_memory))
    monkeypatch.setattr(several, "bind", lambda host, port: None)
    cli_args = []
    real = several.serve_several
    monkeypatch.setattr(several, "serve_several", lambda args, load: cli_args.append(args) or real(args, load))
    for flags, share in (([], FIT / 2), (["--max-loaded-models", "1"], FIT), (["--kv-cache-memory", "4e6"], 4e6)):
        cli_args.clear()
        assert cli.main(["serve", str(tiny), str(smollm2_gguf), *flags]) == 0
        assert seen[-1] == share


@pytest.mark.parametrize("text, seconds", [("90", 90.0), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0),
                                           ("0", 0.0), ("-1", None), ("-5m", None)])
def test_parse_duration(text, seconds):
    from minerva.serve.several import parse_duration
    assert parse_duration(text, "--keep-alive") == seconds


def test_ps_shows_which_models_are_loaded(serve_models, tiny):
    from minerva import manage
    url, _ = serve_models(keep_alive=None, max_loaded=3)
    assert complete(url, "tiny", "ab").status_code == 200
    rows = {r["name"]: r for r in manage.server_status(url)}
    assert rows["tiny"]["loaded"] and rows["tiny"]["running"] == 0 and rows["tiny"]["root"] == str(tiny)
    assert not rows["smollm2"]["loaded"] and rows["smollm2"]["max_model_len"] is None
    lines = manage.ps_text(list(rows.values()), url).splitlines()
    assert lines[1].split()[:2] == ["smollm2", "no"] and lines[2].split()[:2] == ["tiny", "yes"]


def test_models_dir(tmp_path, tiny, capsys, monkeypatch):
    from minerva.serve.several import models_in, served_name
    from tests.helpers import tiny_hf
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "a.gguf").write_bytes(tiny.read_bytes())
    for i in (1, 2):
        (folder / f"big-0000{i}-of-00002.gguf").write_bytes(b"part")  # a split model's parts, but junk
    (folder / "cut.gguf").write_bytes(tiny.read_bytes()[:3000])
    (folder / "dir.gguf").mkdir()
    (folder / "gone.gguf").symlink_to(folder / "nowhere.gguf")
    (folder / "notes.txt").write_text("not a model")
    tiny_hf.save(folder, "llama-tied")
    (folder / "empty").mkdir()
    (folder / os.fsdecode(b"bad\xffname.gguf")).write_bytes(tiny.read_bytes())  # clients could not name it
    found = models_in(str(folder))
    assert [served_name(m) for m in found] == ["a", "llama-tied"]
    skipped = [line for line in capsys.readouterr().err.splitlines() if "skipping" in line]
    assert len(skipped) == 5, skipped
    assert "'dir.gguf'" in skipped[0] and "is a directory, not a file" in skipped[0]
    assert "'gone.gguf'" in skipped[1] and "a symbolic link to nothing" in skipped[1]
    assert "not valid UTF-8" in skipped[2]
    assert "'big-00001-of-00002.gguf'" in skipped[3] and "not a readable GGUF" in skipped[3]
    assert "'cut.gguf'" in skipped[4] and "re-download the file" in skipped[4]
    monkeypatch.chdir(tmp_path)  # a relative folder: its models by their whole paths (/v1/models' root)
    assert models_in("models") == found == [str(folder / "a.gguf"), str(folder / "llama-tied")]
    assert_clean_error(run("serve", "--models-dir", str(folder / "empty")), "holds no .gguf file")
    assert_clean_error(run("serve", "--models-dir", str(folder / "nothing")), "is not a folder")


def test_concurrent_first_requests_respect_max_loaded(serve_models):
    url, router = serve_models(keep_alive=None, max_loaded=1)
    results = {}

    def ask(model):
        results[model] = complete(url, model, "ab", 3).status_code

    threads = [threading.Thread(target=ask, args=(m,)) for m in ("tiny", "smollm2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {"tiny": 200, "smollm2": 200}
    assert sum(loaded(url).values()) == 1  # one at a time, never both


def test_a_failed_load_neither_evicts_nor_retries_at_once(serve_models):
    url, router = serve_models(keep_alive=None, max_loaded=1)
    assert complete(url, "tiny", "ab").status_code == 200
    for _ in range(2):
        r = complete(url, "broken")
        assert r.status_code == 503 and "could not be loaded" in r.json()["error"]["message"]
    assert router.made == [router.models["tiny"].model]  # the header check failed before any load
    assert r.headers["Retry-After"] == "30"  # the second answered from the first failure
    assert loaded(url)["tiny"]  # nothing was unloaded for a model that cannot load
