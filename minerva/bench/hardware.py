"""What a machine can do: its measured memory bandwidth and compute peaks, and datasheet
figures for hardware Minerva is not running on (the host's description is `minerva.machine`).

`minerva roofline` divides a model's bytes and FLOPs per token by these numbers.
The probe measures the CPU with torch itself, so its figures are the ones torch's
kernels reach here, not the vendor's theoretical peaks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from minerva.errors import MinervaError
from minerva.kernels import hugepages, native
from minerva.machine import machine

# -------------------------------------------------------------------- hardware

@dataclass(frozen=True)
class Hardware:
    """Memory bandwidth and peak compute: the two slopes of a roofline."""

    name: str
    bandwidth: float  # bytes/s, memory to compute units
    fp32_flops: float  # FLOP/s of float32 matmul
    bf16_flops: float  # FLOP/s of bfloat16 matmul
    source: str  # "measured" or "datasheet" (or "given" for --bandwidth/--tflops)
    # int8 dot products, 2 ops per multiply-add: the matmuls of `--activations int8`
    # (None: not known; those matmuls are then costed at the float peak)
    int8_ops: float | None = None

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for activations of `dtype` ("float32" or "bfloat16")."""
        peaks = {"float32": self.fp32_flops, "bfloat16": self.bf16_flops}
        if dtype not in peaks:
            raise MinervaError(f"no compute peak for dtype '{dtype}'; choose one of {', '.join(peaks)}")
        return peaks[dtype]

    def int8_peak(self, dtype: str) -> float:
        """Peak op/s of int8 dot products, or the `dtype` peak where the int8 one is not known."""
        return self.int8_ops if self.int8_ops else self.peak_flops(dtype)

    def describe(self) -> str:
        int8 = f", {_ops(self.int8_ops, 'OPS')} int8" if self.int8_ops else ""
        return (f"{self.name} ({self.source}): {self.bandwidth / 1e9:,.1f} GB/s, "
                f"{_ops(self.bf16_flops, 'FLOPS')} bf16, {_ops(self.fp32_flops, 'FLOPS')} fp32{int8}")


def _ops(rate: float, unit: str) -> str:
    """A compute rate in T (or, below 1e12, G) units: CPU figures read as 0.00 in T."""
    return f"{rate / 1e12:,.2f} T{unit}" if rate >= 1e12 else f"{rate / 1e9:,.1f} G{unit}"


# Datasheet figures: dense (no structured sparsity) peaks. The fp32 figure is the
# non-tensor-core rate, which is what a float32 torch matmul gets on NVIDIA GPUs by
# default (TF32 is off for matmuls unless a program turns it on).
PRESETS: dict[str, Hardware] = {
    # NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, BF16 tensor 989 TFLOPS dense, FP32 67 TFLOPS,
    # INT8 tensor 1,979 TOPS dense.
    "h100": Hardware("NVIDIA H100 SXM", 3.35e12, 67e12, 989e12, "datasheet", 1979e12),
    # NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, same compute as H100 SXM.
    "h200": Hardware("NVIDIA H200 SXM", 4.8e12, 67e12, 989e12, "datasheet", 1979e12),
    # NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e, BF16 tensor 312 TFLOPS dense, FP32 19.5 TFLOPS,
    # INT8 tensor 624 TOPS dense.
    "a100": Hardware("NVIDIA A100 80GB SXM", 2.039e12, 19.5e12, 312e12, "datasheet", 624e12),
    # NVIDIA Ada (RTX 4090) whitepaper: 1,008 GB/s GDDR6X, FP32 82.6 TFLOPS,
    # BF16 tensor with FP32 accumulate 165.2 TFLOPS dense, INT8 tensor 660.6 TOPS dense.
    "4090": Hardware("NVIDIA GeForce RTX 4090", 1.008e12, 82.6e12, 165.2e12, "datasheet", 660.6e12),
    # Apple M2 Ultra (76-core GPU): 800 GB/s unified memory, about 27.2 TFLOPS FP32 (Apple's
    # figure); the GPU runs 16-bit floats at about the fp32 rate, so bf16 uses the same number.
    "m2-ultra": Hardware("Apple M2 Ultra (76-core GPU)", 800e9, 27.2e12, 27.2e12, "datasheet"),
}


def hardware_from_args(name: str | None = None, bandwidth_gbs: float | None = None,
                       tflops: float | None = None) -> Hardware | None:
    """The hardware named on the command line, or None for "this machine: probe it".

    `name` picks a preset; `bandwidth_gbs` (GB/s) and `tflops` (used for both fp32 and
    bf16) override its figures, or, without a name, describe other hardware on their own
    (then both are needed).
    """
    for flag, value in (("--bandwidth", bandwidth_gbs), ("--tflops", tflops)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise MinervaError(f"{flag} must be a positive number, got {value}")
    overridden = bandwidth_gbs is not None or tflops is not None
    if name is None and not overridden:
        return None
    if name is not None:
        base = PRESETS.get(name.lower())
        if base is None:
            raise MinervaError(f"unknown hardware '{name}'; choose one of {', '.join(PRESETS)}")
        if overridden:
            base = replace(base, source=f"{base.source}, overridden")
    elif bandwidth_gbs is None or tflops is None:
        raise MinervaError("describe other hardware with both --bandwidth GB/s and --tflops TFLOPS, "
                           f"or name it with --hardware ({', '.join(PRESETS)})")
    else:
        base = Hardware("given hardware", 0.0, 0.0, 0.0, "given")
    if bandwidth_gbs is not None:
        base = replace(base, bandwidth=bandwidth_gbs * 1e9)
    if tflops is not None:
        base = replace(base, fp32_flops=tflops * 1e12, bf16_flops=tflops * 1e12, int8_ops=tflops * 1e12)
    return base


# ----------------------------------------------------------------------- probe

READ_BUFFER_BYTES = 512 << 20  # far beyond any last-level cache slice a core sees
MATMUL_SIZE = 2048


def _best_seconds(fn: Callable[[], object], deadline: float, min_reps: int = 2) -> float:
    """Shortest of repeated runs of `fn` after one warm-up, repeating until `deadline`
    (a `time.perf_counter()` value) and at least `min_reps` times."""
    fn()
    best = math.inf
    reps = 0
    while reps < min_reps or time.perf_counter() < deadline:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        reps += 1
    return best


def _bandwidth(seconds: float) -> float:
    """Read bandwidth in bytes/s: the better of a full read (sum) and a copy of one half of
    the buffer into the other, counted as read + write."""
    start = time.perf_counter()
    # in 2 MiB pages where the OS has them, as the loader keeps weights and the KV pool
    # (minerva.kernels.hugepages): with 4 KiB pages, TLB misses cap the rate below the memory's
    x = hugepages.pool(READ_BUFFER_BYTES).view(torch.float32).fill_(1.0)  # filled: every page is touched
    half = x.numel() // 2
    read = x.nbytes / _best_seconds(x.sum, start + seconds / 2)
    copy = 2 * half * x.element_size() / _best_seconds(lambda: torch.add(x[:half], 0, out=x[half:]),
                                                       start + seconds)
    return max(read, copy)


def _matmul_flops(dtype: torch.dtype, seconds: float) -> float:
    """Best FLOP/s of an n x n matmul. n doubles from 256 up to MATMUL_SIZE while the next
    size's product (8x the work) still fits in a quarter of `seconds`, so a CPU without a
    fast path for `dtype` (bf16 without AVX-512 BF16 takes about a minute for one 2048^3
    product) is measured on a smaller product instead of stalling the probe."""
    start = time.perf_counter()
    n = 256
    while True:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        c = torch.empty(n, n, dtype=dtype)
        torch.mm(a, b, out=c)  # the first call pays one-time set-up
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        if n >= MATMUL_SIZE or 8 * (time.perf_counter() - t) > seconds / 4:
            break
        n *= 2
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b, out=c), start + seconds)


def _int8_ops(seconds: float) -> float | None:
    """Best op/s (2 per multiply-add) of the int8 dot-product instructions the `--activations
    int8` kernels use, run on registers on every thread: what those kernels could reach if
    nothing but their multiply-adds took time. None without the native kernels."""
    kernel = native.load()
    if kernel is None:
        return None
    start = time.perf_counter()
    chunks = 4 * torch.get_num_threads()  # several per thread, so a late thread costs little
    steps = 1024
    while True:  # double the work until a run takes a tenth of the time allowed
        t = time.perf_counter()
        kernel.int8_peak_probe(chunks, steps)
        if time.perf_counter() - t > seconds / 10 or steps >= 1 << 30:
            break
        steps *= 2
    macs = kernel.int8_peak_probe(chunks, steps)  # 256 or 512 a step: the kernels' widest dot products
    return 2 * macs / _best_seconds(lambda: kernel.int8_peak_probe(chunks, steps), start + seconds)


def probe(seconds: float = 3.0, threads: int | None = None) -> Hardware:
    """Measure this CPU: read bandwidth over a 512 MiB buffer and fp32/bf16 matmul peaks
    with torch, and the int8 dot-product peak with Minerva's kernels; best of several runs
    each, in about `seconds` in all (a little more where `seconds` is too short for two
    timed runs of each).

    Uses torch's thread count unless `threads` is given (restored afterwards).
    """
    if threads is not None and threads < 1:
        raise MinervaError(f"threads must be at least 1, got {threads}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        used = torch.get_num_threads()
        bandwidth = _bandwidth(0.4 * seconds)
        fp32 = _matmul_flops(torch.float32, 0.25 * seconds)
        int8 = _int8_ops(0.1 * seconds)
        # The AVX2 build widens bf16 activations to float32 for its FMAs, so its bf16 peak is
        # the fp32 one; torch's own bf16 matmul there is an emulation at about 1 GFLOPS.
        bf16 = fp32 if native.built == "avx2" else _matmul_flops(torch.bfloat16, 0.25 * seconds)
    finally:
        torch.set_num_threads(before)
    return Hardware(f"{machine().cpu}, {used} thread{'s' if used != 1 else ''}", bandwidth, fp32, bf16,
                    "measured", int8)
