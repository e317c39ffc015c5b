"""`minerva bench serve` against a live server on a tiny model: it runs, reports vLLM's metrics
as text and JSON, and counts tokens as the server does. It asserts no speeds."""

from __future__ import annotations

import json

import pytest

from minerva import LLM
from minerva.cli import main
from tests.helpers.cli import assert_clean_error, run
from tests.helpers.server import running_server


@pytest.fixture(scope="module")
def url(tiny):
    # a token a step, so that each streamed chunk is one token (decode bursts send several)
    llm = LLM(str(tiny), device="cpu", dtype="float32", kv_cache_memory=4e6, decode_steps=1)
    with running_server(llm, served_model_name="tiny") as (base_url, _):
        yield base_url


@pytest.mark.parametrize("rate,concurrency", [("inf", "3"), ("40", None)])
def test_bench_serve_reports(tiny, url, tmp_path, rate, concurrency):
    out = tmp_path / "result.json"
    args = ["bench", "serve", str(tiny), "--base-url", url, "--num-prompts", "6", "--random-input-len", "16",
            "--random-output-len", "5", "--ignore-eos", "--request-rate", rate, "--result-file", str(out)]
    proc = run(*args, *(["--max-concurrency", concurrency] if concurrency else []))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    for line in ("Successful requests:", "Output token throughput (tok/s):", "Mean TTFT (ms):",
                 "Median TPOT (ms):", "P99 ITL (ms):", "Median E2EL (ms):"):
        assert line in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 6 * 5  # the server's usage, EOS ignored
    assert result["model"] == "tiny"
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = result[key]
        assert 0 < s["median"] <= s["p99"] and s["mean"] > 0, (key, s)
    # ITL: one gap between each pair of successive chunks, 5 tokens -> 4 gaps a request
    assert all(len(x) == 4 for x in result["itls_ms"])
    assert result["e2el_ms"]["median"] >= result["ttft_ms"]["median"]


def test_bench_serve_no_server(tiny):
    assert_clean_error(run("bench", "serve", str(tiny), "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"),
                       "is the server running")


def test_bench_serve_names_a_missing_key(tiny):
    llm = LLM(str(tiny), device="cpu", dtype="float32", kv_cache_memory=4e6)
    with running_server(llm, served_model_name="tiny", api_key="sk-local") as (base_url, _):
        assert_clean_error(run("bench", "serve", str(tiny), "--base-url", base_url, "--num-prompts", "1"),
                           "wants an API key: give --api-key")


def test_bench_serve_bad_flags(tiny, tmp_path, capsys):
    assert_clean_error(run("bench", "serve", str(tiny), "--max-concurrency", "0"), "--max-concurrency")
    assert_clean_error(run("bench", "serve", str(tiny), "--json-schemas", "11"), "--json-schemas must be in [0, 10]")

    def error(*args: str) -> str:  # in this process: these are refused before anything is sent or loaded
        assert main(["bench", "serve", str(tiny), *args]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("minerva: error: "), err
        return err

    # a port out of range was "ExceptionGroup: unhandled errors in a TaskGroup"; checked as `serve` does
    for port in ("99999", "-1"):
        assert f"--port must be in [1, 65535], got {port}" in error("--port", port)
    for url in ("127.0.0.1:8000", "http://127.0.0.1:99999", "ftp://127.0.0.1:8000"):
        assert f"--base-url '{url}' is not a server's URL; give one such as http://127.0.0.1:8000" in error(
            "--base-url", url)
    # the results were written only at the end, a write error uncaught: the path is tried first
    out = tmp_path / "no" / "r.json"
    assert f"--result-file '{out}' cannot be written (its folder" in error("--result-file", str(out))


def test_bench_serve_takes_an_sdk_base_url(tiny, url):
    """A base URL as an OpenAI SDK takes it, ending in /v1, asked for .../v1/v1/models ("KeyError:
    'data'"): the /v1 is the routes', so it is dropped."""
    proc = run("bench", "serve", str(tiny), "--base-url", url + "/v1/", "--num-prompts", "1", "--random-input-len", "8",
               "--random-output-len", "2")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert f"target:  {url}/v1/completions (model 'tiny')" in proc.stdout


def test_bench_serve_compare_offline_rounds(tiny, url, tmp_path):
    out = tmp_path / "result.json"
    proc = run("bench", "serve", str(tiny), "--base-url", url, "--num-prompts", "4", "--random-input-len", "16",
               "--random-output-len", "4", "--ignore-eos", "--max-concurrency", "2", "--compare-offline",
               "--repeat", "2", "--kv-cache-memory", "4e6", "--result-file", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    for line in ("Server / offline throughput:", "Server median TTFT / offline prefill:", "Median of 2 rounds",
                 "server_over_offline_throughput:"):
        assert line in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 2
    assert result["offline"]["total_output_tokens"] == 4 * 4 and result["offline"]["max_num_seqs"] == 2
    assert all(r["ratios"]["server_over_offline_throughput"] > 0 for r in result["rounds"])
