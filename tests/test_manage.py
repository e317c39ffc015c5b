"""`minerva show`, `rm` and `ps`: what a model file says of itself (checked against the gguf
package's reading of the same file), removing a pulled model, and a running server's status
read from its own endpoints."""

from __future__ import annotations

import hashlib
import json

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from minerva import LLM, manage, store
from minerva.errors import MinervaError
from tests.helpers.cli import assert_clean_error, run
from tests.helpers.server import running_server
from tests.helpers.tiny_gguf import write_tiny_llama
from tests.helpers.tiny_hf import save

def test_show_a_real_model(smollm2_gguf):
    info = manage.model_info(str(smollm2_gguf))
    reader = gguf.GGUFReader(smollm2_gguf)
    assert info.parameters == sum(int(np.prod(t.shape)) for t in reader.tensors)
    kinds = {}
    for t in reader.tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    assert {k: n for k, (n, _) in info.tensor_types.items()} == kinds
    assert info.architecture == "llama" and info.layers == 30 and info.heads == "9 (3 KV)"
    assert info.context_length == int(reader.fields["llama.context_length"].contents())
    assert info.chat_template == reader.fields["tokenizer.chat_template"].contents()
    assert info.sha256 == hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()
    text = manage.show_text(info)
    assert "instruct" in text and "134.5M" in text and info.sha256 in text and "Q4_1" in text


def test_show_and_rm_in_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MINERVA_HOME", str(tmp_path / "home"))
    d = tmp_path / "home" / "models" / "tiny-one"
    d.mkdir(parents=True)
    write_tiny_llama(d / "tiny.gguf", chat_template=None)
    (d / "manifest.json").write_text(json.dumps({"name": "tiny-one", "file": "tiny.gguf", "sha256": "ab" * 32,
                                                 "size": (d / "tiny.gguf").stat().st_size}))
    shown = run("show", "tiny-one", env_home=tmp_path / "home")
    assert shown.returncode == 0, shown.stderr
    assert "base (no chat template" in shown.stdout and "ab" * 32 in shown.stdout  # the recorded sha256
    assert "tiny-one" in run("list", env_home=tmp_path / "home").stdout
    removed = run("rm", "tiny-one", env_home=tmp_path / "home")
    assert removed.returncode == 0 and "removed tiny-one" in removed.stdout and not d.exists()
    assert_clean_error(run("rm", "tiny-one", env_home=tmp_path / "home"), "'tiny-one' is not a pulled model")
    assert_clean_error(run("rm", "smollm2-135m", env_home=tmp_path / "home"), "a known model that is not pulled")
    assert_clean_error(run("show", str(tmp_path / "missing.gguf")), "does not exist")


def test_rm_stays_inside_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MINERVA_HOME", str(tmp_path / "home"))
    with pytest.raises(MinervaError, match="not a pulled model"):
        manage.remove("../../etc")
    d = tmp_path / "home" / "models" / "evil"
    d.mkdir(parents=True)  # a manifest whose file points out of its folder: not a model of the store
    (d / "manifest.json").write_text(json.dumps({"name": "evil", "file": "../../models", "sha256": "x"}))
    assert store.list_models() == []
    with pytest.raises(MinervaError, match="not a pulled model"):
        manage.remove("evil")
    assert (tmp_path / "home" / "models").is_dir()


def test_ps_reads_a_running_server(tiny):
    llm = LLM(str(tiny), device="cpu", dtype="float32", kv_cache_memory=4e6, max_num_seqs=2)
    with running_server(llm, served_model_name="tiny", aliases=("tiny-chat",)) as (url, _):
        rows = manage.server_status(url)
        assert [r["name"] for r in rows] == ["tiny", "tiny-chat"]
        assert rows[0]["root"] == str(tiny) and rows[0]["max_model_len"] == llm.engine.max_model_len
        assert rows[0]["running"] == 0 and rows[0]["waiting"] == 0 and rows[0]["kv_usage"] == 0
        text = manage.ps_text(rows, url)
        assert text.splitlines()[0].split() == ["NAME", "LOADED", "CONTEXT", "RUNNING", "WAITING", "KV", "USED",
                                                "MODEL"]
    with pytest.raises(MinervaError, match="no Minerva server answers"):
        manage.server_status(url, timeout=2)
    with running_server(llm, served_model_name="tiny", api_key="sk-local") as (url, _):
        assert [r["name"] for r in manage.server_status(url, api_key="sk-local")] == ["tiny"]  # /metrics too
        with pytest.raises(MinervaError, match="wants an API key: give --api-key"):
            manage.server_status(url)
        with pytest.raises(MinervaError, match="refuses the API key given"):
            manage.server_status(url, api_key="sk-other")


def test_hf_directory_is_shown(tmp_path):
    path = save(tmp_path, "llama-untied", dtype=torch.bfloat16)
    info = manage.model_info(str(path))
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        numel = sum(f.get_tensor(k).numel() for k in f.keys())
    assert info.parameters == numel and info.quantization == "BF16" and info.architecture == "llama"
    assert info.sha256.startswith("model.safetensors ") and len(info.sha256.split()[1]) == 64


def test_ps_finds_the_servers_running_here_on_any_port(tiny, tmp_path, monkeypatch, capsys):
    """Each server records itself under MINERVA_HOME while it runs (`minerva serve` does it
    around its loop); `ps` without --host/--port reads them all, a record whose process is
    gone is dropped, and `bench serve` takes the one server there is."""
    import json
    import os
    import types

    from minerva.serve import registry

    monkeypatch.setenv("MINERVA_HOME", str(tmp_path))
    assert registry.running() == [] and registry.urls(None, None) == [registry.DEFAULT_URL]
    assert registry.urls("::1", 9000) == ["http://[::1]:9000"]
    assert registry.local_url("0.0.0.0", 8001) == "http://127.0.0.1:8001" and registry.local_url("::", 5) == "http://[::1]:5"
    llm = LLM(str(tiny), device="cpu", dtype="float32", kv_cache_memory=4e6, max_num_seqs=2)
    with running_server(llm, served_model_name="tiny") as (url, _), registry.registered(url, "tiny"):
        (registry.servers_dir() / "garbage.json").write_text("{not json")  # a damaged record: skipped
        dead = registry.servers_dir() / "999999999.json"
        dead.write_text(json.dumps({"url": "http://127.0.0.1:1", "model": "gone", "pid": 999999999, "started": 0}))
        assert [r["url"] for r in registry.running()] == [url] and not dead.exists()
        assert registry.urls(None, None) == [url]
        manage.cmd_ps(types.SimpleNamespace(host=None, port=None, api_key=None))
        assert capsys.readouterr().out.splitlines()[1].split()[0] == "tiny"
        assert registry.running()[0]["pid"] == os.getpid()
        reused = registry.servers_dir() / "reused.json"  # this process's number, another start: not ours
        reused.write_text(json.dumps({"url": "http://127.0.0.1:2", "pid": os.getpid(), "process_start": "1"}))
        assert [r["url"] for r in registry.running()] == [url] and not reused.exists()
    assert registry.running() == []  # removed when the server stops


@pytest.mark.parametrize("port", ["-1", "0", "99999"])
def test_ps_refuses_a_port_no_server_can_have(port):
    assert_clean_error(run("ps", "--port", port), f"--port must be in [1, 65535], got {port}")
