"""On a CPU with AVX-512, the AVX2 build (what AVX2 laptops run: no AVX-512, no VNNI, the
maddubs/madd dot products and the float32 paths) passes the kernel tests too.

`MINERVA_ISA=avx2` compiles it here without AVX-512 and VNNI (its own cached build, about two
minutes the first time) and the kernel test modules run against it in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minerva.kernels import native

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["test_native_kernels.py", "test_native_layer.py", "test_repack.py", "test_act_quant.py", "test_moe.py",
           "test_paged_attention.py", "test_ops.py", "test_linear.py"]


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
