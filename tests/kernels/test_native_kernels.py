"""The packed C++ CPU kernels against the references: the gguf package's dequantization
and a float64 matmul of the dequantized weights."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from minerva.kernels import native
from tests.helpers.quant_blocks import bits, random_blocks, realistic_blocks

PACKED_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
                QT.MXFP4]

capable = native.capable()
if not capable:
    pytest.skip(f"this CPU cannot run the packed kernels ({native.load() or native.unavailable_reason})",
                allow_module_level=True)


@pytest.fixture(scope="module")
def kernels():
    mod = native.load()
    assert mod is not None, f"the CPU supports the kernels but they did not load: {native.unavailable_reason}"
    return mod


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_decoding_is_bit_identical_to_gguf(kernels, qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, (9, 512), rng)
    ours = kernels.dequantize_rows(torch.from_numpy(raw), int(qtype), 512)
    ref = gguf_dequantize(raw, qtype).reshape(9, 512)
    np.testing.assert_array_equal(bits(ours.numpy()), bits(ref))


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matmul_matches_float64_reference(kernels, qtype, dtype):
    rng = np.random.default_rng(7)
    rows, cols = 37, 768  # rows not a multiple of the tile: exercises the edges
    raw = realistic_blocks(qtype, rows, cols, rng)
    w = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(rows, cols)).double()
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(0))
    y = kernels.qmatmul(x.to(dtype), torch.from_numpy(raw), int(qtype), rows, cols)
    assert y.dtype == dtype and y.shape == (11, rows)
    if dtype == torch.float32:
        ref, tol = x.double() @ w.T, 1e-5
    elif native.built == "avx512":  # bf16 dot products: exact products of bf16-rounded operands,
        # summed in fp32; the result rounded to bf16
        ref, tol = x.bfloat16().double() @ w.bfloat16().double().T, 2 ** -8
    else:  # the AVX2 build widens x to fp32 and keeps the weights' fp32 values
        ref, tol = x.bfloat16().double() @ w.T, 2 ** -8
    err = (y.double() - ref).abs().max() / ref.abs().max()
    assert err < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q2_K, QT.Q3_K, QT.Q6_K, QT.MXFP4], ids=lambda t: t.name)
def test_a_row_does_not_depend_on_the_batch(kernels, qtype, dtype):
    rng = np.random.default_rng(3)
    raw = torch.from_numpy(realistic_blocks(qtype, 40, 512, rng))
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
    full = kernels.qmatmul(x, raw, int(qtype), 40, 512)
    for lo, hi in [(0, 1), (5, 6), (2, 5), (1, 5), (3, 10), (12, 13)]:  # registers (M <= 4) and panels
        assert torch.equal(kernels.qmatmul(x[lo:hi], raw, int(qtype), 40, 512), full[lo:hi])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.qmatmul(x, raw, int(qtype), 40, 512), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("threads", [2, 3, 5, 8])
def test_every_chunk_is_computed_once_whatever_the_threads(kernels, threads):
    """The pool hands each thread a region of chunks and lets the others take what is left of
    it: with any thread count (more threads than cores, more threads than chunks) every output
    row is computed, as on one thread."""
    rng = np.random.default_rng(5)
    before = torch.get_num_threads()
    try:
        for rows in (16, 40, 136, 1000):
            raw = torch.from_numpy(realistic_blocks(QT.Q4_K, rows, 512, rng))
            for m in (1, 24):
                x = torch.randn(m, 512, generator=torch.Generator().manual_seed(rows + m))
                kernels.set_num_threads(1)
                alone = kernels.qmatmul_q8(x, raw, int(QT.Q4_K), rows, 512)
                kernels.set_num_threads(threads)
                for _ in range(3):
                    assert torch.equal(kernels.qmatmul_q8(x, raw, int(QT.Q4_K), rows, 512), alone), (rows, m)
    finally:
        kernels.set_num_threads(0)
        torch.set_num_threads(before)


def test_the_thread_pool_counts_its_calls(kernels):
    """pool_stats (the server's cpu_pool_* metrics) counts each kernel call split over threads,
    or run alone while backed off; a call on one thread is neither."""
    raw = torch.from_numpy(realistic_blocks(QT.Q4_K, 64, 1024, np.random.default_rng(0)))
    x = torch.randn(32, 1024)
    threads = torch.get_num_threads()
    try:
        kernels.set_num_threads(1)
        before = native.pool_stats()
        kernels.qmatmul_q8(x, raw, int(QT.Q4_K), 64, 1024)
        assert native.pool_stats() == before
        kernels.set_num_threads(2)
        kernels.qmatmul_q8(x, raw, int(QT.Q4_K), 64, 1024)
        after = native.pool_stats()
    finally:
        kernels.set_num_threads(0)
        torch.set_num_threads(threads)
    split = after["parallel_calls"] - before["parallel_calls"]
    alone = after["backed_off_calls"] - before["backed_off_calls"]
    assert split >= 0 and alone >= 0 and split + alone == 2  # the activations' quantization, then the matmul
    assert after["stalls"] >= before["stalls"] and after["backoffs"] >= before["backoffs"]
    # a parallel call's caller waits for the helper's chunks, if only for nanoseconds
    assert after["wait_seconds"] > before["wait_seconds"] if split else after["wait_seconds"] == before["wait_seconds"]


def test_bad_arguments_raise(kernels):
    raw = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="bytes"):
        kernels.qmatmul(torch.zeros(1, 32), raw, int(QT.Q4_1), 5, 32)
    with pytest.raises(RuntimeError, match="no packed kernel"):
        kernels.qmatmul(torch.zeros(1, 32), raw, int(QT.IQ2_XXS), 4, 32)


FLOAT_TYPES = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}


@pytest.mark.parametrize("qtype", list(FLOAT_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_float_matrices_run_on_the_same_kernels(kernels, qtype, dtype):
    """F32/F16/BF16 weights read as blocks of 32: decoding is exact widening, the matmul
    matches float64, and rows do not depend on the batch."""
    rows, cols = 37, 768
    w = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(5)) * 0.05).to(FLOAT_TYPES[qtype])
    raw = w.contiguous().view(torch.uint8)
    assert torch.equal(kernels.dequantize_rows(raw, int(qtype), cols), w.float())
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(0))
    y = kernels.qmatmul(x.to(dtype), raw, int(qtype), rows, cols)
    if dtype == torch.float32:
        ref, tol = x.double() @ w.double().T, 1e-5
    else:
        ref, tol = x.bfloat16().double() @ w.bfloat16().double().T, 2 ** -8
    assert (y.double() - ref).abs().max() / ref.abs().max() < tol
    for lo, hi in [(0, 1), (2, 5), (3, 10)]:
        assert torch.equal(kernels.qmatmul(x[lo:hi].to(dtype), raw, int(qtype), rows, cols), y[lo:hi])


def _load_in_a_fresh_process() -> None:
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", "from minerva.kernels import native; "
                           "assert native.load() is not None, native.unavailable_reason"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_a_build_killed_midway_does_not_hang_later_loads(kernels):
    """torch's builder leaves its lock file behind when a build is killed; a later load
    clears it (no live build holds Minerva's OS lock) instead of waiting for it forever."""
    from pathlib import Path
    stale = Path(kernels.__file__).parent / "lock"  # the build directory
    stale.touch()
    try:
        _load_in_a_fresh_process()
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def _fake_build(parent, name: str, age_days: float | None, stamped: bool = True):
    import os
    d = parent / name
    (d / "src").mkdir(parents=True)
    (d / "minerva_qmatmul.so").write_bytes(b"")
    if age_days is not None:
        t = time.time() - age_days * 86400
        for f in [d / "minerva_qmatmul.so", d / "src"]:
            os.utime(f, (t, t))
        if stamped:
            (d / native.USED_STAMP).touch()
            os.utime(d / native.USED_STAMP, (t, t))
    return d


def test_builds_unused_for_a_month_are_pruned(tmp_path):
    """Kernel builds pile up as sources, torch or the CPU change (12 MB each): a load removes
    the ones no load has used for KEEP_UNUSED_DAYS, by their stamp or, unstamped, by their
    module's time; never a recent one, one a process is building in, or a folder not a build."""
    import fcntl
    current = _fake_build(tmp_path, "0" * 16, None)
    old = _fake_build(tmp_path, "1" * 16, 40)
    old_unstamped = _fake_build(tmp_path, "2" * 16, 40, stamped=False)
    recent = _fake_build(tmp_path, "3" * 16, 10)
    old_but_used_lately = _fake_build(tmp_path, "4" * 16, 40)
    (old_but_used_lately / native.USED_STAMP).touch()
    building = _fake_build(tmp_path, "5" * 16, 40)
    not_a_build = _fake_build(tmp_path, "notes", 40)
    with open(building / "minerva-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = native._prune(current)
    assert sorted(removed) == sorted([old, old_unstamped])
    assert not old.exists() and not old_unstamped.exists()
    for kept in (current, recent, old_but_used_lately, building, not_a_build):
        assert (kept / "src").is_dir(), kept


def test_a_load_stamps_its_build_and_prunes_old_ones(kernels):
    """Through load() in a fresh process, in the real kernel cache."""
    from pathlib import Path
    build = Path(kernels.__file__).parent
    stale = _fake_build(build.parent, "f" * 15 + "e", 45)
    try:
        _load_in_a_fresh_process()
        assert not stale.exists()
        assert time.time() - (build / native.USED_STAMP).stat().st_mtime < 300
    finally:
        import shutil
        shutil.rmtree(stale, ignore_errors=True)


def test_a_fresh_build_reports_its_progress_and_time(tmp_path, caplog):
    """Without a terminal, a fresh build says every `every` seconds how many of its files
    are compiled, and at the end how long it took (it was minutes of silence)."""
    import logging
    import time
    caplog.set_level(logging.WARNING, logger="minerva")
    (tmp_path / "old.o").touch()
    import os
    os.utime(tmp_path / "old.o", (0, 0))  # an object file of an earlier build does not count
    with native.compile_progress(tmp_path, total=3, every=0.2):
        (tmp_path / "a.o").touch()
        time.sleep(1.2)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("still compiling: 1 of 3 files") for m in said), said
    assert said[-1].startswith("compiled Minerva's CPU kernels in "), said


@pytest.mark.parametrize("V", [1, 7, 8, 9, 49152, 49155])
def test_argmax_rows_is_torch_argmax(kernels, V):
    """First index of the largest value, a NaN counting as the largest, rows of any length."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(12, V, generator=g)
    x[1] = float("-inf")  # every value the same: index 0
    x[2, V // 2:] = 100.0  # ties: the first
    x[3, V - 1] = float("nan")
    x[4, V // 3] = float("nan")
    x[4, V - 1] = float("nan")  # the first NaN
    x[5, :] = 0.0
    x[5, V - 1] = -0.0  # -0 and 0 are equal: the first
    x[6, V - 1] = float("inf")
    x[7] = x[7].round()  # many ties among small integers
    want = x.argmax(-1)
    assert torch.equal(kernels.argmax_rows(x), want)
    assert torch.equal(kernels.argmax_rows(x[:0]), want[:0])


@pytest.mark.parametrize("V", [1, 9, 32000])
def test_greedy_rows_is_argmax_with_the_logits_check(kernels, V):
    """The argmax as a list, -1 for each row check_logits refuses (a NaN or +inf anywhere in it,
    or -inf everywhere: no token possible)."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(6, V, generator=g)
    x[1] = float("-inf")
    x[2, V - 1] = float("nan")
    x[3, V // 2] = float("inf")
    x[4, 0] = float("nan")
    x[4, V - 1] = float("inf")
    want = [int(i) if math.isfinite(float(row.max())) else -1 for row, i in zip(x, x.argmax(-1))]
    assert want[0] >= 0 and want[1:5] == [-1, -1, -1, -1]
    assert kernels.greedy_rows(x) == want
    assert kernels.greedy_rows(x[:0]) == []


def test_a_kernel_call_lets_other_python_threads_run(kernels):
    """The kernels run without the GIL: while one thread is inside a long call, another thread's
    Python goes on (the server's event loop answers during a long prefill). With the GIL held
    the other thread would not tick at all until the call returned."""
    rows, cols = 4096, 4096
    w = torch.from_numpy(random_blocks(QT.Q8_0, (rows, cols), np.random.default_rng(0)))
    x = torch.randn(64, cols)
    start = time.perf_counter()
    kernels.qmatmul_q8(x, w, int(QT.Q8_0), rows, cols)
    m = max(64, min(8192, int(64 * 0.5 / max(time.perf_counter() - start, 1e-4))))  # a call of ~0.5 s
    x = torch.randn(m, cols)
    seconds = []
    worker = threading.Thread(target=lambda: seconds.append(_timed(kernels.qmatmul_q8, x, w, int(QT.Q8_0), rows, cols)))
    ticks = 0
    worker.start()
    while worker.is_alive():
        ticks += 1
        time.sleep(0.002)
    worker.join()
    assert seconds and seconds[0] > 0.05, seconds
    assert ticks >= 10, f"the other thread ticked {ticks} times during a {seconds[0]:.2f} s kernel call"


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def test_a_kernel_cache_that_cannot_be_made_is_an_error_naming_minerva_home(tmp_path, monkeypatch):
    """MINERVA_HOME a file, or where the cache's folder cannot be made: load() raised a traceback
    from mkdir; it is the user's setting, so an error naming it (not a silent run on the
    reference path), at every load."""
    import re

    from minerva.errors import MinervaError
    for name in ("_tried", "_refused", "unavailable_reason"):
        monkeypatch.setattr(native, name, getattr(native, name))
    monkeypatch.delenv("MINERVA_NO_NATIVE", raising=False)
    monkeypatch.delenv("MINERVA_ISA", raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for home, message in ((blocker, f"MINERVA_HOME '{blocker}' is a file, not a folder"),
                          (blocker / "home", f"MINERVA_HOME '{blocker / 'home'}' cannot be created (Not a directory); "
                                             "set MINERVA_HOME to a writable folder")):
        monkeypatch.setattr(native, "_tried", False)
        monkeypatch.setattr(native, "_refused", None)
        monkeypatch.setenv("MINERVA_HOME", str(home))
        for _ in range(2):
            with pytest.raises(MinervaError, match=re.escape(message)):
                native.load()
