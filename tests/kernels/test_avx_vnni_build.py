"""On a CPU with AVX-512 VNNI, the AVX2 build as an AVX2 CPU with VNNI runs it (Intel's laptops
and desktops since Alder Lake: AVX-VNNI, no AVX-512) passes the int8 kernels' tests and gives
the AVX2 build's bits.

`MINERVA_ISA=avx2-vnni` compiles the AVX2 sources without AVX-512, with VNNI's dot products
(their EVEX form where the CPU lacks AVX-VNNI itself: native.py), and the kernel test modules
that take the int8 paths run against it in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from minerva.kernels import native
from tests.kernels.test_avx2_build import ROOT

# the modules whose kernels take VNNI's dot products (the float paths do not differ from the AVX2 build's)
MODULES = ["kernels/test_native_kernels.py", "kernels/test_native_layer.py", "kernels/test_repack.py",
           "kernels/test_act_quant.py", "models/test_moe.py"]
VNNI_HERE = native.isa() == "avx512" and {"avx512_vnni", "avx512vl"} <= native.cpu_flags()


def _run(code: str, *args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "MINERVA_ISA": "avx2-vnni"}, timeout=timeout)


@pytest.mark.slow
@pytest.mark.skipif(not VNNI_HERE, reason="needs a CPU with AVX-512 VNNI (an AVX2 CPU with VNNI runs this build already)")
def test_the_avx_vnni_build_passes_the_int8_kernel_tests():
    which = _run("from minerva.kernels import native; m = native.load(); "
                 "print(native.built, native.unavailable_reason, m.vnni)")
    assert which.stdout.split() == ["avx2", "None", "True"], which.stdout + which.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *[f"tests/{m}" for m in MODULES]], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "MINERVA_ISA": "avx2-vnni"}, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not VNNI_HERE, reason="needs a CPU with AVX-512 VNNI (an AVX2 CPU with VNNI runs this build already)")
def test_the_avx_vnni_build_gives_the_bits_of_the_avx2_build(tmp_path):
    """The K-quants' int8 products with VNNI (dot4 chains, i32 steps) and without (maddubs
    runs, madds) reach the same exact sums, so the same bits: an Intel laptop with AVX-VNNI
    and one without answer alike."""
    script = ("import sys, torch; from minerva.kernels import native; from tests.kernels.test_avx2_build import products; "
              "torch.save(products(native.load()), sys.argv[1]); print(native.built)")
    vnni = _run(script, str(tmp_path / "vnni.pt"))
    assert vnni.returncode == 0 and vnni.stdout.split() == ["avx2"], vnni.stdout + vnni.stderr[-2000:]
    plain = subprocess.run([sys.executable, "-c", script, str(tmp_path / "avx2.pt")], cwd=ROOT, capture_output=True,
                           text=True, env={**os.environ, "MINERVA_ISA": "avx2"}, timeout=1200)
    assert plain.returncode == 0 and plain.stdout.split() == ["avx2"], plain.stdout + plain.stderr[-2000:]
    with_vnni, without = torch.load(tmp_path / "vnni.pt"), torch.load(tmp_path / "avx2.pt")
    assert with_vnni.keys() == without.keys() and len(with_vnni) == 10
    for key in with_vnni:
        assert torch.equal(with_vnni[key], without[key]), key


def test_minerva_isa_avx2_vnni_needs_a_cpu_with_vnni(monkeypatch):
    avx2_only = native.NEEDED_CPU_FLAGS["avx2"]
    monkeypatch.setenv("MINERVA_ISA", "avx2-vnni")
    assert native.chosen_isa(avx2_only | {"avx512_vnni", "avx512vl"}) == ("avx2-vnni", None)
    which, why = native.chosen_isa(avx2_only)
    assert which is None and why == "MINERVA_ISA=avx2-vnni needs avx512_vnni, avx512vl"
    assert native._isa_refusal(why, avx2_only) == (f"{why}, which this CPU lacks; unset MINERVA_ISA "
                                                   "(this CPU runs the avx2 build)")
