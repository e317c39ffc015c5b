"""benchmarks/gpu_check.py, the prepared GPU check, exercised on the CPU: its dry run runs every
stage at toy sizes (the Triton kernels through the interpreter, against the CPU reference path)
and writes both reports; its model cut keeps the real weights of the layers and tokens it keeps;
its inputs are refused with one line each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_stages  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[test]')")


def run(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_the_dry_run_runs_every_stage_and_writes_both_reports(tmp_path, smollm2_gguf):
    proc = run("--dry-run", "--out", tmp_path / "out", "--work", tmp_path / "work")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    names = [r["stage"] for r in report["stages"]]
    assert names == list(gpu_stages.stages({"smollm2": "", "gemma3": ""}))  # in the order they run
    status = {r["stage"]: r["status"] for r in report["stages"]}
    # without a GPU the CUDA tests and the graph switch are skipped, saying why; every other stage ran and passed
    assert status.pop("cuda_tests") == "skipped" and status.pop("graphs") == "skipped"
    assert set(status.values()) == {"passed"}, status
    by = {r["stage"]: r for r in report["stages"]}
    assert by["logits_smollm2"]["max_err_rel"] <= 1e-3 and by["logits_smollm2"]["argmax_agree"] == 1.0
    assert all(by[f"greedy_{m}"]["equal"] == [True, True] for m in ("smollm2", "gemma3"))
    assert len(by["kernels"]["table"]) == 2 * len(gpu_stages.TYPES_CHECKED)
    assert by["decode_1.1b_q4_0"]["tokens_per_s"] > 0 and by["throughput"]["output_tokens"] == 4 * 3
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert md.startswith("# Minerva GPU check") and "dry run on the CPU" in md
    assert "- kernels that ran: triton (" in md  # the path that ran, by name
    assert all(f"| {n} |" in md for n in names)
    assert md == proc.stdout[proc.stdout.index("# Minerva GPU check"):]


def test_a_cut_model_keeps_the_weights_of_what_it_keeps(tmp_path, smollm2_gguf):
    out = tmp_path / "cut.gguf"
    gpu_check.cut_model(Path(smollm2_gguf), out, 2, 4096)
    full, cut = gguf.GGUFReader(smollm2_gguf), gguf.GGUFReader(out)
    assert cut.fields["llama.block_count"].contents() == 2 and len(cut.fields["tokenizer.ggml.tokens"].contents()) == 4096
    assert "first 2 of 30 layers" in cut.fields["general.description"].contents()
    tensors = {t.name: t for t in full.tensors}
    assert {t.name for t in cut.tensors} == {n for n in tensors if not n.startswith("blk.") or int(n.split(".")[1]) < 2}
    for t in cut.tensors:
        want = np.asarray(tensors[t.name].data)
        assert np.array_equal(np.asarray(t.data), want[:4096] if t.name == "token_embd.weight" else want), t.name
    from minerva import LLM
    llm = LLM(str(out), device="cpu", kernels="reference", dtype="float32", activations="float",
              kv_cache_memory=64 << 20)
    assert llm.config.num_layers == 2 and llm.config.vocab_size == 4096
    assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids


def test_a_cut_past_the_model_is_refused(tmp_path, smollm2_gguf):
    with pytest.raises(SystemExit, match="cannot cut .* to 31 layers"):
        gpu_check.cut_model(Path(smollm2_gguf), tmp_path / "x.gguf", 31, 4096)


def test_only_missing_packages_are_installed_and_never_torch_or_triton(tmp_path):
    for name in ("torch-2.11.0-cp312-cp312-linux_x86_64.whl", "triton-3.6.0-cp312-cp312-linux_x86_64.whl",
                 "numpy-2.0.0-cp312-cp312-linux_x86_64.whl", "no_such_package_here-1.0-py3-none-any.whl",
                 "pydantic_core-2.0-cp312-cp312-linux_x86_64.whl"):
        (tmp_path / name).write_bytes(b"")
    assert [w.name for w in gpu_check.missing_wheels(tmp_path)] == ["no_such_package_here-1.0-py3-none-any.whl"]


def test_the_wheels_asked_for_take_pyproject_s_versions():
    reqs = gpu_check._requirements()
    assert "gguf>=0.17" in reqs and "llguidance>=1.9" in reqs and not any(r.startswith(("torch", "triton")) for r in reqs)


@pytest.mark.parametrize("args, message", [
    (["--dry-run", "--model", "Bad Name=x"], "--model takes NAME=PATH"),
    (["--dry-run", "--model", "a=/no/such/file.gguf"], "--model a: /no/such/file.gguf is not a file"),
    (["--dry-run", "--stages", "env,warp"], "no stage warp; the stages: env, kernels"),
    (["--from", "/no/such/pack"], "--from /no/such/pack: no such folder; make it with --pack first"),
])
def test_bad_arguments_get_one_line(args, message):
    proc = run(*args, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_without_a_gpu_the_real_check_says_to_dry_run(tmp_path):
    proc = run("--stages", "env", "--out", tmp_path, timeout=120)
    assert proc.returncode == 2 and "no CUDA GPU here; run with --dry-run" in proc.stderr
