"""benchmarks/matrix.py's page: medians, ratios, the share of the probed bandwidth and the
targets it names, from the figures of each engine's own process (no engine runs here)."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("matrix", ROOT / "benchmarks" / "matrix.py")
matrix = importlib.util.module_from_spec(spec)
sys.modules["matrix"] = matrix
spec.loader.exec_module(matrix)


def _round(m_tg, l_tg, m_pp, l_pp, bw=10e9):
    return {"probe": {"bandwidth": bw},
            "minerva": {"tg": m_tg, "pp": m_pp, "bytes_per_token": 5e8, "dtype": "float32", "activations": "int8",
                        "choices": "planned"},
            "llama.cpp": {"tg": l_tg, "pp": l_pp}}


def test_summary_takes_medians_and_their_ratios():
    r = {"file": "1.1b:Q4_0", "rounds": [_round(16, 10, 90, 60), _round(18, 12, 80, 50), _round(14, 11, 70, 40)]}
    s = matrix.summary(r)
    assert s["minerva_tg"] == 16 and s["llama_tg"] == 11
    assert abs(s["tg_ratio"] - 16 / 11) < 1e-9
    assert abs(s["pp_ratio"] - 80 / 50) < 1e-9
    assert abs(s["minerva_share"] - 16 * 5e8 / 10e9) < 1e-9  # 80% of the probe


def test_each_decode_share_is_over_the_probe_taken_before_it():
    """Per round, each engine's tokens/s over its own probe; the median of the rounds' shares
    (a slow minute of the host counts against neither engine)."""
    rounds = []
    for m_tg, m_bw, l_tg, l_bw in ((16, 10e9, 10, 10e9), (8, 5e9, 12, 10e9), (15, 10e9, 5, 5e9)):
        one = _round(m_tg, l_tg, 90, 50)
        del one["probe"]
        one["probe:minerva"], one["probe:llama.cpp"] = {"bandwidth": m_bw}, {"bandwidth": l_bw}
        rounds.append(one)
    s = matrix.summary({"file": "1.1b:Q4_0", "rounds": rounds})
    assert abs(s["minerva_share"] - 0.8) < 1e-9  # shares 0.8, 0.8, 0.75
    assert abs(s["llama_share"] - 0.5) < 1e-9  # 0.5, 0.6, 0.5
    assert s["bandwidth"] == 10e9  # the median of all six probes


def test_page_names_machine_command_and_the_targets_missed():
    ok = {"file": "1.1b:Q4_0", "rounds": [_round(16, 10, 90, 50)]}
    slow = {"file": "7b:Q4_0", "rounds": [_round(5, 10, 90, 50)]}
    failed = {"file": "1.1b:Q8_0", "rounds": [{"probe": {"bandwidth": 1e10}, "minerva": {"error": "minerva exited 1: x"},
                                               "llama.cpp": {"tg": 1, "pp": 1}}]}
    args = types.SimpleNamespace(rounds=1, threads=2, prompt=512, gen=32)
    text = matrix.page([ok, slow, failed], args, "python benchmarks/matrix.py --rounds 1")
    assert "`python benchmarks/matrix.py --rounds 1`" in text
    assert matrix.cpu_kind() in text
    assert "| 1.1b:Q4_0 | 16.00 | 10.00 | 1.60× | 80% |" in text
    assert "Not met here: 7b:Q4_0." in text
    assert "- 1.1b:Q8_0: minerva exited 1: x" in text
    assert "int8 activations, kernel choices planned" in text


def test_page_names_the_files_whose_decode_is_memory_bound_for_both_engines():
    """Where both engines read at 85% or more of their probes, the page says the decode ratio is
    bounded by memory there; a file where only one of them does is not named."""
    both = {"file": "1.1b:Q8_0", "rounds": [_round(18, 17, 90, 50)]}  # 90% and 85% of 10 GB/s
    one = {"file": "1.1b:Q4_0", "rounds": [_round(18, 10, 90, 50)]}  # 90% and 50%
    args = types.SimpleNamespace(rounds=1, threads=2, prompt=512, gen=32)
    text = matrix.page([both, one], args, "python benchmarks/matrix.py --rounds 1")
    line = next(ln for ln in text.splitlines() if ln.startswith("Decode at the memory bound"))
    assert "1.1b:Q8_0" in line and "1.1b:Q4_0" not in line
    assert "Decode at the memory bound" not in matrix.page([one], args, "python benchmarks/matrix.py")


def test_the_gpt_oss_shape_has_its_own_bandwidth_target():
    """GPT-OSS's step pays routing and gathering outside the kernels: its decode counts as met
    from 60% of the probe, a dense file's from 75%."""
    moe = {"file": "gpt-oss-20b:MXFP4", "rounds": [_round(14, 10, 90, 50)]}  # 70% of 10 GB/s
    dense = {"file": "7b:Q4_0", "rounds": [_round(14, 10, 90, 50)]}
    args = types.SimpleNamespace(rounds=1, threads=2, prompt=512, gen=32)
    assert "Not met here: 7b:Q4_0." in matrix.page([moe, dense], args, "python benchmarks/matrix.py")
    assert "All met here." in matrix.page([moe], args, "python benchmarks/matrix.py")
    assert "60%" in matrix.page([moe], args, "python benchmarks/matrix.py")


def test_render_writes_the_page_of_a_json_with_its_own_machine_and_date(tmp_path, monkeypatch):
    """--render: the page again from its JSON, measuring nothing; a JSON of an earlier version
    (no settings kept) takes them from its command and results."""
    data = {"machine": "Some CPU (4 cores, 8.0 GiB)", "kind": "family 1 model 2, AVX2", "date": "2026-01-02",
            "command": "python benchmarks/matrix.py --prompt 256", "kept": [],
            "results": [{"file": "1.1b:Q4_0", "rounds": [_round(16, 10, 90, 50), _round(16, 10, 90, 50)]}]}
    path = tmp_path / "some-cpu.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(sys, "argv", ["matrix.py", "--render", str(path)])
    assert matrix.main() == 0
    text = (tmp_path / "some-cpu.md").read_text()
    assert text.splitlines()[0] == "# Some CPU (family 1 model 2, AVX2)"
    assert "- date: 2026-01-02" in text and "2 rounds, each round after a bandwidth probe; medians; 4 threads" in text
    assert "prefill of 256 random tokens" in text and "| 1.1b:Q4_0 | 16.00 | 10.00 | 1.60× |" in text
    path.write_text("{}")
    with pytest.raises(SystemExit) as e:
        matrix.main()
    assert e.value.code == 2


def test_every_file_has_a_maker_and_a_path():
    for f in matrix.FILES:
        assert matrix.path_of(f).suffix == ".gguf"
    assert matrix.slug() == matrix.slug().lower() and " " not in matrix.slug()


def test_update_keeps_the_files_it_did_not_measure_and_names_their_run():
    old = {"command": "python benchmarks/matrix.py", "date": "2026-12-01", "kept": [],
           "results": [{"file": f, "rounds": [_round(16, 10, 90, 50)]} for f in ("1.1b:Q4_0", "1.1b:Q8_0", "7b:Q4_0")]}
    again = {"file": "1.1b:Q8_0", "rounds": [_round(20, 10, 90, 50)]}
    results, kept = matrix.merge(old, [again])
    assert [r["file"] for r in results] == ["1.1b:Q4_0", "1.1b:Q8_0", "7b:Q4_0"] and results[1] is again
    assert kept == [{"command": "python benchmarks/matrix.py", "date": "2026-12-01", "files": ["1.1b:Q4_0", "7b:Q4_0"]}]
    # a third run over one of the kept files: the first run keeps only the other
    third = {"command": "python benchmarks/matrix.py --only 1.1b:Q8_0 --update", "date": "2026-12-02", "kept": kept,
             "results": results}
    results, kept = matrix.merge(third, [{"file": "7b:Q4_0", "rounds": [_round(5, 10, 90, 50)]}])
    assert kept == [{"command": "python benchmarks/matrix.py --only 1.1b:Q8_0 --update", "date": "2026-12-02",
                     "files": ["1.1b:Q8_0"]},
                    {"command": "python benchmarks/matrix.py", "date": "2026-12-01", "files": ["1.1b:Q4_0"]}]
    assert matrix.merge(None, [again]) == ([again], [])
    args = types.SimpleNamespace(rounds=1, threads=2, prompt=512, gen=32)
    text = matrix.page(results, args, "python benchmarks/matrix.py --only 7b:Q4_0 --update", kept)
    assert "- kept from an earlier run, `python benchmarks/matrix.py` (2026-12-01): 1.1b:Q4_0" in text


def test_simd_features_reads_llama_cpp_system_info():
    info = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 0 | "
            "AVX512_VNNI = 0 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |")
    assert matrix.simd_features(info) == "AVX AVX2 FMA F16C"
    assert matrix.simd_features("CPU : AVX512 = 1 | AVX512_VNNI = 1 | AVX2 = 1 |") == "AVX2 AVX512 AVX512_VNNI"
    assert matrix.simd_features("CPU : NEON = 1 |") == "none"


def test_isa_and_llama_path_reach_only_their_engine(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("MINERVA_ISA", raising=False)
    args = types.SimpleNamespace(isa="avx2", llama_path=tmp_path)
    minerva_env, llama_env = matrix.child_env("minerva", args), matrix.child_env("llama.cpp", args)
    assert minerva_env["MINERVA_ISA"] == "avx2" and minerva_env["PYTHONPATH"] == "/elsewhere"
    assert "MINERVA_ISA" not in llama_env
    assert llama_env["PYTHONPATH"].split(":") == [str(tmp_path), "/elsewhere"]
    plain = matrix.child_env("minerva", types.SimpleNamespace(isa=None, llama_path=None))
    assert "MINERVA_ISA" not in plain


def test_an_isa_page_has_its_own_name_and_says_what_each_engine_ran():
    r = _round(16, 10, 90, 50)
    r["minerva"]["build"] = "avx2"
    r["llama.cpp"].update(version="0.3.36", simd="AVX AVX2 FMA F16C")
    args = types.SimpleNamespace(rounds=1, threads=2, prompt=512, gen=32, isa="avx2")
    text = matrix.page([{"file": "1.1b:Q4_0", "rounds": [r]}], args, "python benchmarks/matrix.py --isa avx2")
    assert text.splitlines()[0].endswith(", AVX2 builds")
    assert "llama-cpp-python 0.3.36 (its build: AVX AVX2 FMA F16C)" in text
    assert "avx2 kernels, float32, int8 activations" in text
    assert matrix.slug("avx2") != matrix.slug() and matrix.slug("avx2").endswith("-avx2-builds")


def test_a_llama_path_without_the_package_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["matrix.py", "--only", "1.1b:Q4_0", "--llama-path", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        matrix.main()
    assert e.value.code == 2
    assert "holds no llama_cpp package" in capsys.readouterr().err


def _fake_llama(folder: Path, info: str) -> Path:
    """A llama_cpp package in `folder` that reports `info` as its system info."""
    (folder / "llama_cpp").mkdir(parents=True)
    (folder / "llama_cpp" / "__init__.py").write_text(f"def llama_print_system_info():\n    return {info.encode()!r}\n")
    return folder


def test_isa_avx2_refuses_a_llama_cpp_built_with_avx512(tmp_path, capsys, monkeypatch):
    """A wheel pip kept from a native build, installed with --target, gave an AVX2 page whose
    llama.cpp figures were AVX-512's."""
    native = _fake_llama(tmp_path / "native", "CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 |")
    monkeypatch.setattr(sys, "argv", ["matrix.py", "--isa", "avx2", "--only", "1.1b:Q4_0", "--llama-path", str(native)])
    monkeypatch.setattr(matrix, "measure", lambda *a: pytest.fail("measured"))
    with pytest.raises(SystemExit) as e:
        matrix.main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"({native}) uses it" in err and "--no-binary llama-cpp-python" in err, err
    avx2 = _fake_llama(tmp_path / "avx2", "CPU : AVX = 1 | AVX2 = 1 | FMA = 1 | AVX512 = 0 |")
    assert matrix.peer_simd(types.SimpleNamespace(llama_path=avx2)) == "AVX AVX2 FMA"
