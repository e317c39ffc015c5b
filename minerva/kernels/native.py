"""Minerva's C++ CPU kernels, compiled on first use with PyTorch's extension builder.

The build happens once per machine (about a minute on two cores) and is cached under
`$MINERVA_HOME/kernels` (else `~/.cache/minerva/kernels`), keyed by the source, the
compiler flags, the torch version and the CPU's features, so a changed source or a
different CPU gets its own build. On a CPU without the instructions the kernels use
(x86-64 with AVX-512 F/BW/VL/BF16 and F16C), or when the build fails, `load()`
returns None and the callers fall back to the plain-torch reference path; the
reason is logged once. Which kernel runs for what is decided in `minerva.kernels.dispatch`.
"""

from __future__ import annotations

import hashlib
import shutil
import logging
import os
import platform
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("minerva")

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("qmatmul.cpp", "attention.cpp", "ops.cpp", "module.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / name for name in ("simd.h", "kernels.h", "parallel.h")]
# -fopenmp: at::parallel_for is OpenMP in the headers; without it every kernel runs on one
# thread. The libgomp.so.1 torch already loaded serves the extension too.
CFLAGS = ["-std=c++20", "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
NEEDED_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c", "fma"}

_module: ModuleType | None = None
_tried = False
unavailable_reason: str | None = None


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir(flags: set[str]) -> Path:
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS + sorted(flags) + [torch.__version__, sys.version, "src-copy"]).encode())
    home = os.environ.get("MINERVA_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "minerva"
    return base / "kernels" / h.hexdigest()[:16]


def load() -> ModuleType | None:
    """The compiled module, or None (see `unavailable_reason`)."""
    global _module, _tried, unavailable_reason
    if _tried:
        return _module
    _tried = True
    if os.environ.get("MINERVA_NO_NATIVE"):
        unavailable_reason = "disabled by MINERVA_NO_NATIVE"
        return None
    flags = cpu_flags()
    missing = NEEDED_CPU_FLAGS - flags
    if platform.machine() not in ("x86_64", "AMD64") or missing:
        unavailable_reason = f"this CPU lacks {', '.join(sorted(missing)) or 'x86-64'}"
        log.info("packed CPU kernels unavailable: %s; using the reference path", unavailable_reason)
        return None
    build = _cache_dir(flags)
    build.mkdir(parents=True, exist_ok=True)
    scripts = sysconfig.get_path("scripts")  # pip's ninja lives beside this interpreter
    if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils import cpp_extension
        if not any(build.glob("*.so")):
            log.warning("compiling Minerva's CPU kernels (once per machine, about a minute)...")
        # Build from a copy inside the cache directory: the build files name source paths, so
        # two checkouts of the same sources share one build instead of rebuilding in turn.
        src = build / "src"
        src.mkdir(exist_ok=True)
        for f in SOURCES + HEADERS:
            if not (src / f.name).exists() or (src / f.name).read_bytes() != f.read_bytes():
                shutil.copyfile(f, src / f.name)
        _module = cpp_extension.load(name="minerva_qmatmul", sources=[str(src / s.name) for s in SOURCES],
                                     extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, build_directory=str(build), verbose=False)
    except Exception as e:  # a missing compiler or headers: run without the kernels
        unavailable_reason = f"build failed ({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})"
        log.warning("packed CPU kernels unavailable: %s; using the reference path", unavailable_reason)
        _module = None
    return _module
