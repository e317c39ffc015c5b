"""Minerva's C++ CPU kernels, compiled on first use with PyTorch's extension builder.

Two builds of the same entry points (`csrc/kernels.h`): one for x86-64 CPUs with
AVX-512 (F, BW, VL, BF16) and F16C, one for CPUs with AVX2, FMA and F16C (most laptops
and many servers); `isa()` picks the first the CPU can run. The build happens once per machine (about a minute on two cores) and is cached under
`$MINERVA_HOME/kernels` (else `~/.cache/minerva/kernels`), keyed by the source, the
compiler flags, the torch version and the CPU's features, so a changed source or a
different CPU gets its own build. Each load marks its build as used; builds no load has used
for `KEEP_UNUSED_DAYS` (an older Minerva's, another torch's) are removed then, so upgrades do
not pile them up. `MINERVA_ISA=avx2` runs the AVX2 build on a CPU with
AVX-512, compiled without AVX-512 and VNNI (what an AVX2 laptop runs, so tests here cover
it); `MINERVA_ISA=avx512` insists on the AVX-512 build. On a CPU with neither, or when the build fails, `load()`
returns None and the callers fall back to the plain-torch reference path; the
reason is logged once. What the user set and the kernels cannot honour (a MINERVA_ISA that names
no build or one this CPU cannot run, a MINERVA_HOME the cache cannot be made in) is a
MinervaError instead, raised by every call: not a run several times slower than asked for.
Which kernel runs for what is decided in `minerva.kernels.dispatch`.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import logging
import os
import platform
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from minerva.errors import MinervaError, home_folder, make_home_folder

log = logging.getLogger("minerva")

CSRC = Path(__file__).parent / "csrc"
# the int8 matmul (8-bit activations), the same sources in both builds: q8_matmul.cpp lists them
Q8_SOURCES = ("q8_matmul.cpp", "q8_quant.cpp", "q8_cpu.cpp", "q8_repack_x8.cpp", "q8_repack_k.cpp", "q8_q6k.cpp")
# the sources of each build, by instruction set; module.cpp (the Python module) is shared
SOURCES = {
    "avx512": [CSRC / name for name in ("qmatmul.cpp", *Q8_SOURCES, "attention.cpp", "ops.cpp", "sampling.cpp",
                                        "lora.cpp", "module.cpp")],
    "avx2": [CSRC / name for name in ("qmatmul_avx2.cpp", *Q8_SOURCES, "attention_avx2.cpp", "ops_avx2.cpp",
                                      "sampling.cpp", "lora.cpp", "module.cpp")],
}
HEADERS = [CSRC / name for name in (
    "simd.h", "simd_avx2.h", "kernels.h", "parallel.h", "qformat.h", "attention_parts.h", "exchange.h", "ops_tensor.h",
    "attention_tensor.h", "q8_blocks.h", "q8_quant.h", "q8_cpu.h", "q8_kernels.h", "q8_lanes.h", "q8_repack.h")]
# -fopenmp: at::parallel_for is OpenMP in the headers; without it every kernel runs on one
# thread. The libgomp.so.1 torch already loaded serves the extension too.
# -fvisibility=hidden: the module exports its Python entry point alone (pybind11's advice), so
# its own calls bind within it and no other library in the process can take them over.
CFLAGS = ["-std=c++20", "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp",
          "-fvisibility=hidden"]
LDFLAGS = ["-fopenmp"]
# what each build needs from the CPU, best first
NEEDED_CPU_FLAGS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c", "fma"},
    "avx2": {"avx2", "fma", "f16c"},
}
# a build chosen below the CPU's best (MINERVA_ISA) is compiled as for a CPU without these
NARROWER_CFLAGS = {"avx2": ["-mno-avx512f", "-mno-avxvnni"]}
# MINERVA_ISA=avx2-vnni, for tests: the AVX2 build as an AVX2 CPU with VNNI compiles it (Intel's
# since Alder Lake: AVX-VNNI, no AVX-512), on a CPU with AVX-512 VNNI, whose dot products it
# takes in their EVEX form (q8_blocks.h); it loads as the avx2 build
AVX2_VNNI = "avx2-vnni"
AVX2_VNNI_NEEDS = NEEDED_CPU_FLAGS["avx2"] | {"avx512_vnni", "avx512vl"}
AVX2_VNNI_CFLAGS = ["-mno-avx512f", "-mno-avxvnni", "-DMINERVA_EVEX_VNNI"]

# a build that no load has used for this long is removed by the next load of another build
KEEP_UNUSED_DAYS = 30
USED_STAMP = "last-used"

_module: ModuleType | None = None
_tried = False
_refused: str | None = None  # the error of a setting the kernels cannot honour, raised by every load()
unavailable_reason: str | None = None
built: str | None = None  # the build that loaded: "avx512" or "avx2"
_build_dir: Path | None = None


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa(flags: set[str] | None = None) -> str | None:
    """The build this CPU runs ("avx512" or "avx2"), or None when it can run neither."""
    flags = cpu_flags() if flags is None else flags
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return next((name for name, needed in NEEDED_CPU_FLAGS.items() if needed <= flags), None)


def chosen_isa(flags: set[str]) -> tuple[str | None, str | None]:
    """The build to load and, when there is none, why: `isa`, or the one MINERVA_ISA names."""
    best = isa(flags)
    wanted = os.environ.get("MINERVA_ISA", "").strip().lower()
    if not wanted:
        return best, None
    if wanted == AVX2_VNNI:
        missing = AVX2_VNNI_NEEDS - flags
        return (None, f"MINERVA_ISA={wanted} needs {', '.join(sorted(missing))}") if missing else (wanted, None)
    if wanted not in NEEDED_CPU_FLAGS:
        return None, f"MINERVA_ISA={wanted!r} is not one of {', '.join(NEEDED_CPU_FLAGS)}"
    if best is None or list(NEEDED_CPU_FLAGS).index(wanted) < list(NEEDED_CPU_FLAGS).index(best):
        return None, f"MINERVA_ISA={wanted} needs {', '.join(sorted(NEEDED_CPU_FLAGS[wanted] - flags))}"
    return wanted, None


def _cflags(which: str, flags: set[str]) -> list[str]:
    if which == AVX2_VNNI:
        return CFLAGS + AVX2_VNNI_CFLAGS
    return CFLAGS + (NARROWER_CFLAGS.get(which, []) if which != isa(flags) else [])


def capable() -> bool:
    """Whether this CPU can run one of the builds (tests use it to skip)."""
    return isa() is not None


def _sources_of(which: str) -> str:
    return "avx2" if which == AVX2_VNNI else which


def _cache_dir(flags: set[str], build: str) -> Path:
    h = hashlib.sha256()
    for src in SOURCES[_sources_of(build)] + HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(_cflags(build, flags) + LDFLAGS + sorted(flags) + [torch.__version__, sys.version, "src-copy",
                                                                        build]).encode())
    return home_folder("kernels", "the kernel cache") / h.hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(build: Path):
    """One build at a time in `build`, under a lock the OS drops when its holder dies.

    torch's extension builder serialises builds with a lock file it deletes when done; a
    process killed mid-build (a timeout, Ctrl-C) leaves it behind, and every later load would
    wait for it forever. Holding this lock means no live process is building here, so such a
    file is stale and goes."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: torch's lock file alone
        yield
        return
    with open(build / "minerva-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_dir() -> Path | None:
    """The directory of the build that loaded (None where none did): what belongs to this
    build on this machine, as the planner's choices (`minerva.kernels.tune`), goes there."""
    return _build_dir if _module is not None else None


def pool_stats() -> dict[str, float] | None:
    """The kernels' thread pool since the process started (parallel calls, calls run on one
    thread while backed off from helpers that kept losing their cores, stalls, back-offs,
    seconds callers waited for helpers after their own chunks), or None where the kernels
    did not load."""
    return _module.pool_stats() if _module is not None else None


def for_tensor(t) -> ModuleType | None:
    """The compiled module where tensor `t` is on the CPU (None elsewhere, or where it does not load)."""
    return load() if t.device.type == "cpu" else None


@contextlib.contextmanager
def compile_progress(build: Path, total: int, every: float = 30.0):
    """While a fresh build compiles into `build`: a progress bar of its `total` translation
    units on a terminal (the object files ninja has written, in parallel where there are
    cores), else a line every `every` seconds; then the elapsed time."""
    start, stop = time.time(), threading.Event()

    def done() -> int:
        return sum(1 for o in build.glob("*.o") if o.stat().st_mtime >= start - 1)

    def watch() -> None:
        from tqdm import tqdm
        last = start
        with tqdm(total=total, desc="compiling Minerva's CPU kernels", unit="file", leave=False,
                  disable=not sys.stderr.isatty()) as bar:
            while not stop.wait(0.5):
                bar.n = min(done(), total)
                bar.refresh()
                if bar.disable and time.time() - last >= every:
                    last = time.time()
                    log.warning("still compiling: %d of %d files, %.0f s", min(done(), total), total, last - start)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
    log.warning("compiled Minerva's CPU kernels in %.0f s", time.time() - start)  # (not when it failed)


@contextlib.contextmanager
def _first_build(build: Path, total: int):
    """compile_progress where `build` holds no module yet (asked under the build lock)."""
    if any(build.glob("*.so")):
        yield
        return
    log.warning("compiling Minerva's CPU kernels (once per machine, a minute or two)...")
    with compile_progress(build, total):
        yield


def _refuse(message: str) -> MinervaError:
    global _refused, unavailable_reason
    _refused = unavailable_reason = message
    return MinervaError(message)


def _isa_refusal(refused: str, flags: set[str]) -> str:
    """What to say of a MINERVA_ISA that names no build, or one this CPU cannot run."""
    best = isa(flags)
    if os.environ.get("MINERVA_ISA", "").strip().lower() not in (*NEEDED_CPU_FLAGS, AVX2_VNNI):
        return f"{refused}; set it to one of them, or unset it for the widest this CPU runs ({best or 'none'})"
    return (f"{refused}, which this CPU lacks; " + (f"unset MINERVA_ISA (this CPU runs the {best} build)" if best
                                                     else "unset MINERVA_ISA (this CPU runs neither build)"))


def load() -> ModuleType | None:
    """The compiled module, or None (see `unavailable_reason`); a MinervaError for a setting
    it cannot honour (MINERVA_ISA, MINERVA_HOME), at every call."""
    global _module, _tried, unavailable_reason, built, _build_dir
    if _tried:
        if _refused is not None:
            raise MinervaError(_refused)
        return _module
    _tried = True
    if os.environ.get("MINERVA_NO_NATIVE"):
        unavailable_reason = "disabled by MINERVA_NO_NATIVE"
        return None
    flags = cpu_flags()
    which, refused = chosen_isa(flags)
    if refused:  # the user's choice of build: not a silent run on the reference path
        raise _refuse(_isa_refusal(refused, flags))
    if which is None:
        missing = NEEDED_CPU_FLAGS["avx2"] - flags
        unavailable_reason = (f"this CPU lacks {', '.join(sorted(missing))}" if missing and platform.machine()
                              in ("x86_64", "AMD64") else "not an x86-64 CPU")
        log.info("packed CPU kernels unavailable: %s; using the reference path", unavailable_reason)
        return None
    sources = SOURCES[_sources_of(which)]
    try:
        build = make_home_folder(_cache_dir(flags, which))
    except MinervaError as exc:  # MINERVA_HOME unusable: the user's setting, said as such
        raise _refuse(str(exc)) from None
    _stamp(build)  # (before the build: a pruning process sees it in use)
    scripts = sysconfig.get_path("scripts")  # pip's ninja lives beside this interpreter
    if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils import cpp_extension

        # Build from a copy inside the cache directory: the build files name source paths, so
        # two checkouts of the same sources share one build instead of rebuilding in turn.
        src = build / "src"
        src.mkdir(exist_ok=True)
        for f in sources + HEADERS:
            if not (src / f.name).exists() or (src / f.name).read_bytes() != f.read_bytes():
                shutil.copyfile(f, src / f.name)
        with _build_lock(build), _first_build(build, len(sources)):  # (a build another process made: silent)
            _module = cpp_extension.load(name="minerva_qmatmul", sources=[str(src / s.name) for s in sources],
                                         extra_cflags=_cflags(which, flags), extra_ldflags=LDFLAGS,
                                         build_directory=str(build),
                                         verbose=False)
        built, _build_dir = _sources_of(which), build
        _prune(build)
    except Exception as e:  # a missing compiler or headers: run without the kernels
        unavailable_reason = f"build failed ({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__})"
        log.warning("packed CPU kernels unavailable: %s; using the reference path", unavailable_reason)
        _module = None
    return _module


def _last_used(build: Path) -> float:
    """When a load last used `build`: its stamp, else (a build from before stamps, or one that
    failed) its module's or its sources' time."""
    for f in [build / USED_STAMP, *build.glob("*.so"), build / "src", build]:
        with contextlib.suppress(OSError):
            return f.stat().st_mtime
    return time.time()


def _stamp(build: Path) -> None:
    with contextlib.suppress(OSError):
        (build / USED_STAMP).touch()


def _prune(build: Path, keep_days: float = KEEP_UNUSED_DAYS) -> list[Path]:
    """Remove the siblings of `build` that no load has used for `keep_days` days, each under its
    build lock taken without waiting (a process compiling there keeps it), looked at again
    once locked. Returns the removed directories; a failure is logged, never raised."""
    removed = []
    cutoff = time.time() - keep_days * 86400
    try:
        for other in build.parent.iterdir():
            if (other != build and other.is_dir() and _is_build_name(other.name) and _last_used(other) < cutoff
                    and _remove_unlocked(other, cutoff)):
                removed.append(other)
    except OSError as e:
        log.info("kernel cache not pruned: %s", e)
    if removed:
        log.info("removed %d kernel builds unused for %g days from %s", len(removed), keep_days, build.parent)
    return removed


def _is_build_name(name: str) -> bool:
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name)


def _remove_unlocked(build: Path, cutoff: float) -> bool:
    """Remove `build` unless a process holds its build lock (it is compiling there) or it was
    used since `cutoff`."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        with open(build / "minerva-build.lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False
            if _last_used(build) >= cutoff:
                return False
            shutil.rmtree(build)
            return True
    except OSError as e:
        log.info("kernel build %s not removed: %s", build, e)
        return False
