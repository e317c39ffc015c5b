"""A model's own sampling defaults (generation_config.json, a GGUF's general.sampling.*): read as
transformers and the gguf package read them, and taken by every route and the command line for
what a request leaves out."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import httpx
import ollama as ollama_sdk
import pytest
from transformers import GenerationConfig

from minerva import LLM, MinervaError, SamplingParams
from minerva.formats.generation import FIELDS, from_hf_dir
from minerva.serve import ollama
from minerva.serve import protocol as P
from minerva.serve.convert import sampling_params
from tests.helpers.server import running_server
from tests.helpers.tiny_gguf import write_tiny_llama
from tests.helpers.tiny_hf import save

HF_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
             "bos_token_id": 0, "max_new_tokens": 100}
GGUF_KEYS = {"general.sampling.temp": 0.25, "general.sampling.top_k": 7, "general.sampling.top_p": 0.5,
             "general.sampling.min_p": 0.125}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = save(tmp_path_factory.mktemp("generation"), "llama-untied")
    (path / "generation_config.json").write_text(json.dumps(HF_CONFIG))
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("generation") / "sampling.gguf", metadata=GGUF_KEYS)


def test_hf_defaults_are_what_transformers_reads(hf_dir):
    llm = LLM(str(hf_dir), device="cpu", dtype="float32", kv_cache_memory=8 << 20)
    reference = GenerationConfig.from_pretrained(hf_dir).to_diff_dict()  # only the keys the file sets
    assert llm.sampling_defaults == {**{name: reference[name] for name in FIELDS if name in reference},
                                     "max_tokens": reference["max_new_tokens"]}
    assert llm.sampling_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.05,
                                     "max_tokens": 100}
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty,
            params.max_tokens) == (0.6, 20, 0.9, 0.0, 1.05, 100)
    off = LLM(str(hf_dir), device="cpu", dtype="float32", kv_cache_memory=8 << 20, generation_config="none")
    assert off.sampling_defaults == {} and off.get_default_sampling_params() == SamplingParams()


def test_gguf_defaults_are_what_the_gguf_reader_reads(gguf_file):
    fields = gguf.GGUFReader(gguf_file).fields
    read = {key: fields[key].contents() for key in GGUF_KEYS}
    llm = LLM(str(gguf_file), device="cpu", dtype="float32", kv_cache_memory=8 << 20)
    assert llm.sampling_defaults == {"temperature": read["general.sampling.temp"],
                                     "top_k": read["general.sampling.top_k"],
                                     "top_p": read["general.sampling.top_p"],
                                     "min_p": read["general.sampling.min_p"]}


def test_unusable_values_are_left_out_with_a_warning(tmp_path, caplog):
    path = write_tiny_llama(tmp_path / "odd.gguf", metadata={"general.sampling.temp": 9.0,
                                                            "general.sampling.top_p": "high",
                                                            "general.sampling.top_k": 3})
    with caplog.at_level("WARNING", logger="minerva"):
        llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=8 << 20)
    assert llm.sampling_defaults == {"top_k": 3}
    assert "general.sampling.temp = 9.0" in caplog.text and "general.sampling.top_p = 'high'" in caplog.text


def test_another_folder_and_bad_choices(tmp_path, gguf_file):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    llm = LLM(str(gguf_file), device="cpu", dtype="float32", kv_cache_memory=8 << 20, generation_config=tmp_path)
    assert llm.sampling_defaults == {"temperature": 0.3}
    for bad in ("vllm", str(tmp_path / "missing"), 3):
        with pytest.raises(MinervaError, match="generation_config .*must be 'auto'"):
            LLM(str(gguf_file), device="cpu", generation_config=bad)


def test_precedence_request_then_model_then_route():
    model = {"temperature": 0.25, "top_k": 7}
    body = P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = sampling_params(body, 4, None, defaults=model)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.25, 7, 1.0, 0.0, 1.0)
    body = P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=1.0, top_k=0)
    p = sampling_params(body, 4, None, defaults=model)
    assert (p.temperature, p.top_k) == (1.0, 0)  # what a request sets wins, the API's own values too
    asked = ollama.chat_request(ollama.ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}]))
    p = sampling_params(asked, 4, None, defaults={})
    assert (p.temperature, p.top_k, p.top_p) == (0.8, 40, 0.9)  # Ollama's own defaults
    p = sampling_params(asked, 4, None, defaults=model)
    assert (p.temperature, p.top_k, p.top_p) == (0.25, 7, 0.9)  # the model's over Ollama's
    asked = ollama.chat_request(ollama.ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                                   options={"temperature": 0.0}))
    assert sampling_params(asked, 4, None, defaults=model).temperature == 0.0
    # null, which OpenAI's API takes, is the field left out: the model's default, else the API's
    body = P.ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": "hi"}], "temperature": null, "top_p": null, "n": null, '
        '"presence_penalty": null, "stream": null, "logprobs": null}')
    p = sampling_params(body, 4, None, defaults=model)
    assert (p.temperature, p.top_k, p.top_p, p.n, p.presence_penalty, body.stream) == (0.25, 7, 1.0, 1, 0.0, False)
    asked = ollama.chat_request(ollama.ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                                   options={"temperature": None}))
    assert sampling_params(asked, 4, None, defaults=model).temperature == 0.25


def test_every_route_takes_the_models_defaults(gguf_file):
    llm = LLM(str(gguf_file), device="cpu", dtype="float32", kv_cache_memory=8 << 20)
    seen: list[SamplingParams] = []
    make = llm.make_requests
    llm.make_requests = lambda ids, params: (seen.append(params), make(ids, params))[1]
    chat = [{"role": "user", "content": "hi"}]
    calls = [("/v1/chat/completions", {"messages": chat}), ("/v1/completions", {"prompt": "hi"}),
             ("/v1/responses", {"input": "hi"}), ("/v1/messages", {"messages": chat}),
             ("/api/chat", {"messages": chat, "stream": False}), ("/api/generate", {"prompt": "hi", "stream": False})]
    with running_server(llm) as (url, _):
        for path, body in calls:
            for given in ({}, {"temperature": 0.0, "top_p": 0.75}):
                if path.startswith("/api/"):
                    fields = {**body, "options": given}
                else:
                    fields = {**body, **given, **({"max_tokens": 2} if path == "/v1/messages" else {})}
                seen.clear()
                r = httpx.post(url + path, json={"model": "test-model", **fields}, timeout=60)
                assert r.status_code == 200, (path, r.text)
                p = seen[0]
                if given:
                    assert (p.temperature, p.top_p, p.top_k) == (0.0, 0.75, 7), path
                else:
                    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.25, 0.5, 7, 0.125), path
        shown = ollama_sdk.Client(host=url).show("test-model").parameters  # as a Modelfile's PARAMETER lines
        assert [line.split() for line in shown.splitlines()] == [
            ["temperature", "0.25"], ["top_k", "7"], ["top_p", "0.5"], ["min_p", "0.125"]]


def test_a_models_reply_length_is_a_default_cut_at_the_context(hf_dir):
    """generation_config's max_new_tokens is the max_tokens of a request that leaves it out,
    cut to the room the context leaves (as vLLM's); a request's own max_tokens (or Ollama's
    num_predict -1) is not held to it."""
    llm = LLM(str(hf_dir), device="cpu", dtype="float32", kv_cache_memory=8 << 20, max_model_len=120)
    seen: list[SamplingParams] = []
    make = llm.make_requests
    llm.make_requests = lambda ids, params: (seen.append((len(ids), params.max_tokens)), make(ids, params))[1]
    calls = [("/v1/completions", {"prompt": "hi"}, None, 100),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 3}, None, 3),
             ("/v1/completions", {"prompt": "hi " * 10}, None, "room"),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 104}, None, 104),
             ("/api/generate", {"prompt": "hi", "raw": True, "stream": False}, {}, 100),
             ("/api/generate", {"prompt": "hi", "raw": True, "stream": False}, {"num_predict": -1}, "room")]
    with running_server(llm) as (url, _):
        for path, body, options, expected in calls:
            seen.clear()
            fields = {**body, **({"options": {**options, "temperature": 0.0}} if options is not None else {})}
            r = httpx.post(url + path, json={"model": "test-model", **fields}, timeout=120)
            assert r.status_code == 200, (path, r.text)
            prompt_len, max_tokens = seen[0]
            assert max_tokens == (120 - prompt_len if expected == "room" else expected), (path, body, options)
            assert expected != "room" or max_tokens != 100  # (the room is not the default by chance)
        r = httpx.post(url + "/v1/completions", json={"model": "test-model", "prompt": "hi " * 40}, timeout=60)
        assert r.status_code == 400 and "asks for" not in r.json()["error"]["message"]  # nothing was asked


def test_offline_the_models_reply_length_is_cut_at_the_context(hf_dir, tmp_path):
    """LLM.generate/chat without parameters, and the commands without -n, cut the model's
    max_new_tokens (100) to the room a 110-token context leaves, as the server does (the engine
    refused the request: "needs N tokens of KV cache")."""
    llm = LLM(str(hf_dir), device="cpu", dtype="float32", kv_cache_memory=8 << 20, max_model_len=110)
    seen = []
    make = llm.make_requests
    llm.make_requests = lambda ids, params: (seen.append((len(ids), params.max_tokens)), make(ids, params))[1]
    llm.generate("hello there " * 3)
    llm.chat([{"role": "user", "content": "hi"}])
    list(llm.stream("hello there " * 3))
    assert len(seen) == 3 and all(0 < m == 110 - n < 100 for n, m in seen), seen
    assert llm.generate("hi", SamplingParams(max_tokens=3))[0].token_ids.__len__() <= 3  # asked for: as given
    for command in ("generate", "run"):
        out = subprocess.run([sys.executable, "-m", "minerva", command, str(hf_dir), "hello", "--dtype", "float32",
                              "--max-model-len", "110", "--ignore-eos"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "finish=length" in out.stderr, out.stderr


def test_the_command_line_takes_the_models_defaults(hf_dir, tmp_path):
    """A model whose own temperature is 0 answers greedily: the same text as --temperature 0,
    whatever the seed; with --generation-config none it samples (temperature 0.8)."""
    greedy_dir = tmp_path / "cfg"
    greedy_dir.mkdir()
    (greedy_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))

    def run(*flags):
        out = subprocess.run([sys.executable, "-m", "minerva", "generate", str(hf_dir), "hello", "--raw", "-n", "12",
                              "--ignore-eos", "--dtype", "float32", *flags], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout

    greedy = run("--temperature", "0")
    assert run("--generation-config", str(greedy_dir), "--seed", "1") == greedy
    assert run("--generation-config", str(greedy_dir), "--seed", "2") == greedy
    assert run("--generation-config", "none", "--seed", "1") != greedy
    (greedy_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    short = run("--temperature", "0", "-n", "5")
    assert short != greedy and greedy.startswith(short.rstrip("\n"))
    assert subprocess.run([sys.executable, "-m", "minerva", "generate", str(hf_dir), "hello", "--raw", "--ignore-eos",
                           "--dtype", "float32", "--generation-config", str(greedy_dir)], capture_output=True,
                          text=True, timeout=300).stdout == short  # no -n: the model's max_new_tokens
    bad = subprocess.run([sys.executable, "-m", "minerva", "generate", str(hf_dir), "hi", "--generation-config",
                          str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--generation-config" in bad.stderr and "Traceback" not in bad.stderr


def test_show_names_the_models_defaults(gguf_file, tiny):
    from minerva.manage import model_info, show_text

    assert "  sampling        temperature=0.25, top_k=7, top_p=0.5, min_p=0.125\n" in show_text(model_info(str(gguf_file)))
    assert "  sampling        no defaults of its own\n" in show_text(model_info(str(tiny)))


@pytest.mark.parametrize("text, words", [
    ('{"temperature": 1' + "0" * 400 + ', "top_k": 5}', "temperature = 100000"),
    ("[" * 100_000 + "]" * 100_000, "nested too deep"),
    ("[0.5]", "holds an array, not a JSON object"),
    ("null", "holds null, not a JSON object"),
    ('{"top_k": 18446744073709551615, "top_p": NaN}', "top_k = 18446744073709551615"),
    ("\xff{", "not readable JSON"),
    ('{"max_new_tokens": 0, "top_k": 5}', "max_new_tokens = 0"),
    ('{"max_new_tokens": 12.5, "top_k": 5}', "max_new_tokens = 12.5"),
    ('{"max_new_tokens": "lots"}', "max_new_tokens = 'lots'"),
])
def test_a_broken_generation_config_is_a_warning(tmp_path, caplog, text, words):
    (tmp_path / "generation_config.json").write_bytes(text.encode("latin-1"))
    with caplog.at_level("WARNING", logger="minerva"):
        defaults = from_hf_dir(tmp_path)
    assert defaults == ({"top_k": 5} if '"top_k": 5' in text else {})
    assert words in caplog.text and len(caplog.text) < 1000
