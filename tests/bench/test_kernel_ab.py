"""benchmarks/kernel_ab.py: two checkouts' kernel builds in one process, calls alternating."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minerva.kernels import native

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernel_ab.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("kernel_ab", SCRIPT)
kernel_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_ab)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=900)


@pytest.mark.skipif(not native.capable(), reason="this CPU runs none of the kernel builds")
def test_the_same_checkout_on_both_sides_gives_the_same_bits_and_a_ratio():
    out = run("--base", str(ROOT), "--type", "Q4_K", "--rows", "64", "--cols", "512", "--m", "8", "--pairs", "6")
    assert out.returncode == 0, out.stderr
    assert "Q4_K 64 x 512, 8 rows of x" in out.stdout
    for side in ("base", "new "):
        assert re.search(rf"^{side}.*: [\d.]+ GMAC/s median, [\d.]+ best$", out.stdout, re.M), out.stdout
    ratio = re.search(r"speed new / base: ([\d.]+) median of the pairs \(quartiles ([\d.]+)-([\d.]+)\); same bits: yes",
                      out.stdout)
    assert ratio, out.stdout
    assert 0 < float(ratio.group(2)) <= float(ratio.group(1)) <= float(ratio.group(3))


def test_a_base_that_is_not_a_checkout_is_one_clear_error(tmp_path):
    out = run("--base", str(tmp_path))
    assert out.returncode == 2
    assert f"--base {tmp_path}: not a checkout of Minerva" in out.stderr.strip().splitlines()[-1]
    assert "Traceback" not in out.stderr


def test_columns_off_the_block_are_refused():
    out = run("--base", str(ROOT), "--type", "Q4_K", "--cols", "300")
    assert out.returncode == 2
    assert "--cols a multiple of Q4_K's block of 256" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_base_whose_kernels_do_not_build_names_it_and_why(tmp_path):
    kernels = tmp_path / "minerva" / "kernels"
    kernels.mkdir(parents=True)
    (tmp_path / "minerva" / "__init__.py").write_text("")
    (kernels / "__init__.py").write_text("")
    (kernels / "native.py").write_text("unavailable_reason = 'no compiler here'\n\ndef load():\n    return None\n")
    with pytest.raises(SystemExit) as e:
        kernel_ab.build_of(tmp_path)
    assert str(e.value) == f"kernel_ab: the kernels of {tmp_path} did not build: no compiler here"


@pytest.mark.slow
@pytest.mark.skipif(native.isa() != "avx512", reason="this CPU has one kernel build only (or none)")
def test_another_build_loads_beside_this_one_as_a_module_of_its_own(monkeypatch):
    """The AVX2 build stands in for another checkout's: under the loaded module's name, Python
    handed back the loaded module, and both 'builds' ran the same code."""
    this = native.load()
    monkeypatch.setenv("MINERVA_ISA", "avx2")
    other_dir = kernel_ab.build_of(ROOT)
    assert other_dir != native.build_dir()
    other = kernel_ab.load_build(other_dir)
    assert other is not this and other.qmatmul_q8 is not this.qmatmul_q8
    assert Path(other.__file__).parent == other_dir
