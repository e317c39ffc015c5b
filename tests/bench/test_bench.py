"""`minerva bench` end to end on a tiny model (and on SmolLM2 against the peers that are
installed). These check that every command runs and reports what it must; they assert
no speeds."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from minerva.bench.report import Figure, write_json
from minerva.cli import main
from minerva.errors import MinervaError, output_file
from tests.helpers.cli import assert_clean_error, run
from tests.helpers.peers import HAS_LLAMA_CPP, LLAMA_CPP_IMPORTS, LLAMA_CPP_INSTALLED, LLAMA_CPP_PROBLEM
from tests.helpers.tiny_gguf import write_tiny_llama



def assert_report(out: str, *names: str) -> None:
    for line in ("machine:", "model:", "command: minerva bench", "minerva: loaded in", "resident"):
        assert line in out, out
    for name in names:
        assert any(ln.startswith(name) for ln in out.splitlines()), (name, out)


def test_latency(tiny, tmp_path):
    out = tmp_path / "lat.json"
    proc = run("bench", "latency", str(tiny), "-p", "16,32", "-n", "8", "-r", "2", "-d", "0,32",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert_report(proc.stdout, "pp16", "pp32", "tg8", "pp16@d32", "tg8@d32")
    report = json.loads(out.read_text())
    figures = report["figures"]
    assert {f["name"] for f in figures} == {"pp16", "pp32", "tg8", "pp16@d32", "pp32@d32", "tg8@d32"}
    assert all(len(f["samples"]) == 2 and all(s > 0 for s in f["samples"]) for f in figures)
    # each test next to its roofline ceiling: decode at batch 1 is bound by memory bandwidth
    roofline = {t["name"]: t for t in report["roofline"]["tests"]}
    assert set(roofline) == {f["name"] for f in figures} and report["roofline"]["hardware"]["bandwidth"] > 0
    assert roofline["tg8"]["bound"] == "memory" and all(t["fraction"] > 0 for t in roofline.values())
    assert "roofline: " in proc.stdout and "of ceiling" in proc.stdout


@pytest.mark.slow
def test_a_generation_too_short_to_time_is_no_traceback(smollm2_gguf):
    """SmolLM2, -n 1 to 4 (decode bursts of 8): a repetition whose tokens all came with the
    first is no sample, and a test with none says n/a and why; exit 0 (a NaN sample crashed
    the report's standard deviation). (How the tokens are counted: the test below.)"""
    proc = run("bench", "latency", str(smollm2_gguf), "-p", "8", "-n", "1,2,4", "-r", "2")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert_report(proc.stdout, "tg1", "tg2", "tg4")
    table = proc.stdout.split("\n\n")[1]  # the figures' table (then the note, then the roofline's)
    untimed = [ln.split()[0] for ln in table.splitlines() if ln.startswith("tg") and ln.split()[1] == "n/a"]
    assert not untimed or f"{', '.join(untimed)}: n/a: every token came with the first" in proc.stdout


class _Delta:
    def __init__(self, n: int):
        self.token_ids = list(range(n))


class _Streams:
    """An LLM whose stream_many hands out (request, tokens) deltas as listed."""

    def __init__(self, deltas):
        self.deltas = deltas

    def stream_many(self, prompts, params):
        for i, n in self.deltas:
            yield i, None, _Delta(n)


@pytest.mark.parametrize("deltas, rate", [
    ([(0, 8), (0, 4), (0, 4)], 8 / 2),  # a burst of 8 with the first: the 8 after it, over 2 s
    ([(0, 3), (1, 1), (0, 2), (1, 2)], 4 / 2),  # from the moment both had their first (1 s)
    ([(0, 8)], math.nan),  # every token came with the first: no sample
    ([(0, 1), (1, 4)], math.nan),  # the last request's first delta is the last delta
])
def test_decode_rate_counts_the_tokens_after_every_request_had_its_first(monkeypatch, deltas, rate):
    """Tokens that came with a request's first delta (a decode burst) were computed before it;
    counted as decoded in no time, they put tg at 108% of the roofline's ceiling. The clock
    reads 0 at the start, then 1, 2, 3 ... s as each delta arrives."""
    from minerva.bench import measure
    ticks = iter(range(len(deltas) + 1))
    monkeypatch.setattr(measure.time, "perf_counter", lambda: float(next(ticks)))
    prompts = [[1, 2]] * (1 + max(i for i, _ in deltas))
    got, seconds = measure.minerva_decode(_Streams(deltas), prompts, 16)
    assert seconds == len(deltas)
    assert (math.isnan(got) and math.isnan(rate)) or got == pytest.approx(rate), got


def test_a_rate_that_could_not_be_timed_is_no_sample():
    figure = Figure("tg4", "minerva", [math.nan, 100.0, 110.0])
    assert (figure.mean, figure.text()) == (105.0, "    105.0 ±    7.1")
    assert Figure("tg1", "minerva", [math.nan, math.nan]).text().strip() == "n/a"


def test_throughput(tiny):
    proc = run("bench", "throughput", str(tiny), "--num-prompts", "6", "--input-len", "4:20",
               "--output-len", "2:8")
    assert proc.returncode == 0, proc.stderr
    assert_report(proc.stdout, "output", "total")
    assert "workload: 6 requests, input 4-20, output 2-8" in proc.stdout


def test_sweep_writes_csv_json_and_plot(tiny, tmp_path):
    stem = tmp_path / "sweep"
    proc = run("bench", "sweep", str(tiny), "--batch-sizes", "1,2,4", "--input-len", "8", "--output-len", "6",
               "--out", str(stem))
    assert proc.returncode == 0, proc.stderr
    assert_report(proc.stdout, "gen b1", "gen b2", "gen b4")
    rows = list(csv.DictReader(open(stem.with_suffix(".csv"))))
    assert [(r["system"], int(r["batch"])) for r in rows] == [
        ("minerva", 1), ("minerva", 2), ("minerva", 4), ("roofline", 1), ("roofline", 2), ("roofline", 4)]
    assert all(float(r["gen_tokens_per_s"]) > 0 for r in rows)
    assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(stem.with_suffix(".json").read_text())["roofline"]["hardware"]["bandwidth"] > 0


@pytest.mark.parametrize("args,fragment", [
    (["latency", "-r", "0"], "--repetitions"),
    (["latency", "-d", "8,100000", "-r", "1"], "lower --depth"),  # checked before anything runs
    (["sweep", "--batch-sizes", "0"], "--batch-sizes"),
    (["throughput", "--num-prompts", "0"], "--num-prompts"),
    (["throughput", "--num-prompts", "2", "--sequential", "3"], "--sequential"),
    (["throughput", "--num-prompts", "2", "--sequential", "-1"], "--sequential"),
    (["throughput", "--max-batch", "0"], "--max-batch must be at least 1"),
    (["latency", "-p", "0", "-n", "0"], "nothing to measure"),
])
def test_bad_arguments(tiny, args, fragment):
    assert_clean_error(run("bench", args[0], str(tiny), *args[1:]), fragment)


@pytest.mark.parametrize("args, option", [
    (["latency", "--json", "{tmp}/no/lat.json"], "--json '{tmp}/no/lat.json' cannot be written (its folder"),
    (["throughput", "--json", "{tmp}"], "--json '{tmp}' is a directory"),
    (["speculative", "--speculative", "ngram", "--json", "{tmp}/no/spec.json"], "--json '{tmp}/no/spec.json'"),
    (["sweep", "--out", "{tmp}/file/stem"], "--out: the folder '{tmp}/file' cannot be created"),
])
def test_an_output_that_cannot_be_written_fails_before_the_run(tiny, tmp_path, capsys, args, option):
    """The results were written only at the end, a write error uncaught: a long run lost. The
    path is tried first: one line naming the option, and nothing measured."""
    (tmp_path / "file").write_text("x")
    assert main(["bench", args[0], str(tiny), *(a.format(tmp=tmp_path) for a in args[1:])]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("minerva: error: "), err
    assert option.format(tmp=tmp_path) in err, err


def test_results_that_cannot_be_written_at_the_end_are_kept(tmp_path, capsys):
    """A path tried before the run that fails at its end (the folder gone, a full disk): the
    results go to a temporary file, which the one-line error names."""
    folder = tmp_path / "out"
    folder.mkdir()
    path = folder / "r.json"
    assert output_file(str(path), "--json") == path and not path.exists()  # tried, and not left behind
    folder.rmdir()
    with pytest.raises(MinervaError) as e:
        write_json(str(path), {"figures": [1, 2]})
    message = str(e.value)
    assert message.startswith(f"--json '{path}' cannot be written (its folder '{folder}' does not exist); "
                              "the results are kept in "), message
    kept = Path(message.rsplit(" kept in ", 1)[1].removesuffix(" instead"))
    try:
        assert json.loads(kept.read_text()) == {"figures": [1, 2]}
    finally:
        kept.unlink()


def test_latency_on_a_model_of_a_short_context(tmp_path):
    """The warm-up was a 64-token prompt whatever the model's context and --prompt: a model of
    32 tokens failed. It fits where the tests do."""
    short = write_tiny_llama(tmp_path / "short.gguf", context=32)
    proc = run("bench", "latency", str(short), "-p", "8", "-n", "4", "-r", "1")
    assert proc.returncode == 0, proc.stderr
    assert_report(proc.stdout, "pp8", "tg4")


@pytest.mark.skipif(LLAMA_CPP_IMPORTS, reason="llama-cpp-python is installed and imports")
def test_missing_peer_is_a_clean_error(tiny):
    """Not installed, or installed without what it imports: one line saying which and what to run."""
    assert_clean_error(run("bench", "latency", str(tiny), "-p", "8", "-n", "2", "-r", "1", "--compare", "llama.cpp"),
                       "does not import" if LLAMA_CPP_INSTALLED else "pip install llama-cpp-python")


@pytest.mark.slow
def test_transformers_peer_on_smollm2(smollm2_gguf):
    proc = run("bench", "latency", str(smollm2_gguf), "-p", "32", "-n", "4", "-r", "1", "--compare", "transformers")
    assert proc.returncode == 0, proc.stderr
    assert_report(proc.stdout, "pp32", "tg4")
    assert "transformers: loaded in" in proc.stdout and "vs transformers" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LLAMA_CPP, reason=str(LLAMA_CPP_PROBLEM))
def test_llama_cpp_peer_on_smollm2(smollm2_gguf):
    for args in (["latency", "-p", "32", "-n", "4", "-r", "1", "-d", "0,16"],
                 ["throughput", "--num-prompts", "5", "--input-len", "8:40", "--output-len", "2:9",
                  "--max-batch", "3"]):
        proc = run("bench", *args, str(smollm2_gguf), "--compare", "llama.cpp")
        assert proc.returncode == 0, proc.stderr
        assert "llama.cpp: loaded in" in proc.stdout and "vs llama.cpp" in proc.stdout


@pytest.mark.parametrize("amx", [True, False])
def test_llama_cpp_built_with_amx_is_warned_of_before_it_runs(tmp_path, monkeypatch, capsys, amx):
    """llama.cpp's AMX matmul can crash the process (llama.cpp issue 20824), which no handler
    catches: the peer says so, with the rebuild command, before it loads anything. A stand-in
    module answers the system-info call and refuses the model."""
    import sys
    import types

    from minerva.bench.peers import load_peer
    from minerva.errors import MinervaError

    info = b"CPU : AVX512 = 1 | " + (b"AMX_INT8 = 1 | " if amx else b"") + b"REPACK = 1 |"
    fake = types.SimpleNamespace(llama_print_system_info=lambda: info, llama_backend_init=lambda: None,
                                 llama_model_default_params=lambda: None,
                                 llama_model_load_from_file=lambda path, params: None)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    with pytest.raises(MinervaError, match="could not load"):
        load_peer("llama.cpp", model, 2, 256)
    err = capsys.readouterr().err
    assert ("issue 20824" in err and "-DGGML_NATIVE=OFF" in err) == amx, err


def test_a_peer_that_cannot_run_fails_before_anything_loads(monkeypatch):
    """`--compare llama.cpp` without an importable llama-cpp-python: one error naming what to
    install (the README's line among them), raised before Minerva loads the model."""
    import sys
    import types

    from minerva.bench import latency, peers, throughput
    from minerva.errors import MinervaError

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    with pytest.raises(MinervaError, match=r"pip install -e '\.\[bench\]'") as missing:
        peers.check_peer("llama.cpp")
    assert "llama-cpp-python" in str(missing.value)
    with pytest.raises(MinervaError, match="unknown peer"):
        peers.check_peer("vllm")
    loaded = []
    monkeypatch.setattr(latency, "load_minerva", lambda args: loaded.append(args))
    monkeypatch.setattr(throughput, "load_minerva", lambda args: loaded.append(args))
    args = types.SimpleNamespace(compare=["llama.cpp"], seed=0, sequential=0, num_prompts=1)
    for command in (latency.cmd_latency, throughput.cmd_throughput):
        with pytest.raises(MinervaError, match="llama-cpp-python"):
            command(args)
    assert loaded == []
