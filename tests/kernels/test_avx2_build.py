"""On a CPU with AVX-512, the AVX2 build (what AVX2 laptops run: no AVX-512, no VNNI, the
maddubs/madd dot products and the float32 paths) passes the kernel tests too.

`MINERVA_ISA=avx2` compiles it here without AVX-512 and VNNI (its own cached build, about two
minutes the first time) and the kernel test modules run against it in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from minerva.kernels import native, repack
from tests.helpers.quant_blocks import realistic_blocks
from tests.kernels.test_act_quant import sample_x

ROOT = Path(__file__).resolve().parents[2]
MODULES = ["kernels/test_native_kernels.py", "kernels/test_native_layer.py", "kernels/test_repack.py",
           "kernels/test_act_quant.py", "models/test_moe.py", "kernels/test_paged_attention.py", "kernels/test_ops.py",
           "kernels/test_linear.py", "kernels/test_backend_ops.py"]


@pytest.mark.slow
@pytest.mark.skipif(native.isa() != "avx512", reason="this CPU runs the AVX2 build already (or neither build)")
def test_the_avx2_build_passes_the_kernel_tests():
    env = {**os.environ, "MINERVA_ISA": "avx2"}
    which = subprocess.run([sys.executable, "-c", "from minerva.kernels import native; native.load(); "
                            "print(native.built, native.unavailable_reason)"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert which.stdout.split() == ["avx2", "None"], which.stdout + which.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *[f"tests/{m}" for m in MODULES]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def products(kernels) -> dict[str, torch.Tensor]:
    """Regrouped Q4_K, Q5_K, Q2_K and Q3_K, and Q6_K as stored (its panels regrouped at run time
    from 8 rows of x), against 1 and 9 rows of x (Q4_K/Q5_K: tiles of 6 and 3 with the int
    steps, 8 and 1 without; Q2_K/Q3_K/Q6_K: dot4 chains and an i32 multiply by the scales with
    VNNI, maddubs runs and a madd by them without)."""
    out = {}
    x = sample_x(9, 1024, seed=22)
    for qtype in (QT.Q4_K, QT.Q5_K, QT.Q2_K, QT.Q3_K, QT.Q6_K):
        raw = torch.from_numpy(realistic_blocks(qtype, 40, 1024, np.random.default_rng(21)))
        w, code = (raw, int(qtype)) if qtype == QT.Q6_K else (repack.regroup(raw, qtype, 40, 1024),
                                                              int(qtype) | repack.REGROUPED)
        for m in (1, 9):
            out[f"{qtype.name} {m}"] = kernels.qmatmul_q8(x[:m], w, code, 40, 1024)
    return out


@pytest.mark.slow
@pytest.mark.skipif(native.isa() != "avx512", reason="this CPU runs the AVX2 build already (or neither build)")
def test_int_steps_give_the_bits_of_the_avx2_build(tmp_path):
    """With VNNI and `cpu_choices`' int steps (CPUs other than Intel's take them), the Q4_K/Q5_K
    tiles sum a super-block exactly in i32 and take the same two FMAs as the AVX2 build's
    maddubs tiles: the same bits on an AVX2 laptop and on this CPU; Q2_K, Q3_K and Q6_K's
    panels likewise (their exact i32 sums are reached in other steps by the two builds)."""
    kernels = native.load()
    if kernels is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason}")
    script = ("import sys, torch; from minerva.kernels import native; from tests.kernels.test_avx2_build import products; "
              "torch.save(products(native.load()), sys.argv[1]); print(native.built)")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "avx2.pt")], cwd=ROOT,
                          env={**os.environ, "MINERVA_ISA": "avx2"}, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0 and proc.stdout.split() == ["avx2"], proc.stdout + proc.stderr[-2000:]
    avx2 = torch.load(tmp_path / "avx2.pt")
    was = kernels.cpu_choices()
    try:
        kernels.cpu_choices(was[:3] + [1])
        here = products(kernels)
    finally:
        kernels.cpu_choices(was)
    assert avx2.keys() == here.keys() and len(here) == 10
    for key in here:
        assert torch.equal(here[key], avx2[key]), key


def test_minerva_isa_names_a_build_this_cpu_can_run(monkeypatch):
    avx2_only = native.NEEDED_CPU_FLAGS["avx2"]
    both = native.NEEDED_CPU_FLAGS["avx512"] | avx2_only
    monkeypatch.setenv("MINERVA_ISA", "avx2")
    assert native.chosen_isa(both) == ("avx2", None)
    monkeypatch.setenv("MINERVA_ISA", "AVX512")
    assert native.chosen_isa(both) == ("avx512", None)
    which, why = native.chosen_isa(avx2_only)
    assert which is None and why.startswith("MINERVA_ISA=avx512 needs ") and "avx512f" in why
    monkeypatch.setenv("MINERVA_ISA", "sse")
    assert native.chosen_isa(both) == (None, "MINERVA_ISA='sse' is not one of avx512, avx2")
    monkeypatch.delenv("MINERVA_ISA")
    assert native.chosen_isa(both) == ("avx512", None) and native.chosen_isa(avx2_only) == ("avx2", None)


def _fresh_load(monkeypatch):
    """native.load() as in a new process; the module's state is put back afterwards."""
    for name in ("_tried", "_refused", "unavailable_reason"):
        monkeypatch.setattr(native, name, getattr(native, name))
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_refused", None)
    monkeypatch.delenv("MINERVA_NO_NATIVE", raising=False)


def test_a_minerva_isa_the_kernels_cannot_honour_is_an_error_at_every_load(monkeypatch):
    """A MINERVA_ISA that names no build, or one this CPU lacks, was a note and a run on the
    reference path several times slower: an error naming it and what to set, raised by every
    load (a later one falling back without a word would run slow all the same)."""
    from minerva.errors import MinervaError

    _fresh_load(monkeypatch)
    monkeypatch.setenv("MINERVA_ISA", "sse")
    for _ in range(2):
        with pytest.raises(MinervaError, match=r"^MINERVA_ISA='sse' is not one of avx512, avx2; set it to one of "
                                               r"them, or unset it for the widest this CPU runs"):
            native.load()
    _fresh_load(monkeypatch)
    monkeypatch.setenv("MINERVA_ISA", "avx512")
    monkeypatch.setattr(native, "cpu_flags", lambda: set(native.NEEDED_CPU_FLAGS["avx2"]))
    with pytest.raises(MinervaError, match=r"^MINERVA_ISA=avx512 needs .*avx512f.*, which this CPU lacks; "
                                           r"unset MINERVA_ISA \(this CPU runs"):
        native.load()
    assert native.unavailable_reason.startswith("MINERVA_ISA=avx512 needs")
