"""A GGUF file's matmuls with one row of x, one call per matrix, against one large matrix
streamed from memory: what per-call costs take from decode's bandwidth.

    python benchmarks/matmul_sweep.py FILE [--reps 9] [--threads 2] [--after]

Each rep times one large regrouped Q4_K matrix (131072 x 2048, 151 MB), then every `blk.*`
matrix of the file once, in file order, each read from memory (together they are larger
than the caches), all in 2 MiB pages as the loader keeps them. Decode in the engine makes
fewer calls than this: it fuses Q/K/V of one type, and gate/up, into one call each. Prints both bandwidths per rep, and per kind of matrix
its bandwidth and time per call in the median sweep. Needs the int8 kernels.

--after also times, after each matrix of the sweep (outside the sweep's time), one call of a
16-row matrix that stays in cache, and prints per kind of matrix what that call took right
after it against the same call repeated at once: what the next call pays for the caches the
matrix's stream emptied.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minerva.kernels import hugepages, native, repack  # noqa: E402
from synthetic import RandomTensor  # noqa: E402  (this script's folder is on the path)

Q = gguf.GGMLQuantizationType


def packed(raw: np.ndarray, qtype: Q, rows: int, cols: int, kernels) -> tuple[torch.Tensor, int]:
    """The matrix as the int8 path keeps it (regrouped where the type has a layout for it)."""
    w = torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, -1).copy())
    if repack.applies(kernels, qtype):
        return repack.regroup_in_place(w, qtype, rows, cols, kernels), int(qtype) | repack.REGROUPED
    return w, int(qtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a .gguf file")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--after", action="store_true", help="time a small call after each matrix (above)")
    args = ap.parse_args()
    if args.reps < 1 or args.threads < 1:
        ap.error("--reps and --threads must be at least 1")
    if not Path(args.model).is_file():
        ap.error(f"no such file: {args.model}")
    kernels = native.load()
    if kernels is None:
        raise SystemExit("this CPU cannot run the packed kernels (AVX2 or AVX-512 needed)")
    torch.set_num_threads(args.threads)
    kernels.set_num_threads(args.threads)
    try:
        tensors = gguf.GGUFReader(args.model).tensors
    except (ValueError, OSError) as e:
        raise SystemExit(f"{args.model}: not a GGUF file this script can read ({e})") from None
    mats = []
    for t in tensors:
        qtype = Q(t.tensor_type)
        if not t.name.startswith("blk.") or len(t.shape) != 2 or qtype in (Q.F32, Q.F16, Q.BF16):
            continue
        cols, rows = int(t.shape[0]), int(t.shape[1])
        mats.append((t.name.split(".")[-2] + " " + qtype.name, *packed(t.data, qtype, rows, cols, kernels), rows, cols))
    if not mats:
        raise SystemExit(f"{args.model}: no packed blk.* matrices")
    xs = {cols: torch.randn(1, cols) for *_, cols in mats}
    big_t = RandomTensor(Q.Q4_K, (131072, 2048), np.random.SeedSequence(0), {})
    raw = np.random.default_rng(0).integers(0, 256, big_t.nbytes, dtype=np.uint8)
    big, big_qt = packed(big_t._shape(raw), Q.Q4_K, 131072, 2048, kernels)
    # in 2 MiB pages, as the loader keeps them (minerva.kernels.hugepages)
    pages = hugepages.Pool(hugepages.padded(big) + sum(hugepages.padded(w) for _, w, *_ in mats))
    big = pages.take(big)
    mats = [(kind, pages.take(w), *rest) for kind, w, *rest in mats]
    bx = torch.randn(1, 2048)
    nbytes = sum(w.numel() for _, w, *_ in mats)
    _, w0, small_qt, _, small_cols = mats[0]
    small = w0[:16].clone()  # two groups of 8 rows (or 16 rows of the GGUF layout)
    big_s, sweep_s, per_call = [], [], []
    after: dict[str, list[float]] = defaultdict(list)
    warm: list[float] = []

    def small_call() -> float:
        s = time.perf_counter()
        kernels.qmatmul_q8(xs[small_cols], small, small_qt, 16, small_cols)
        return time.perf_counter() - s

    for _ in range(args.reps):
        start = time.perf_counter()
        kernels.qmatmul_q8(bx, big, big_qt, 131072, 2048)
        big_s.append(time.perf_counter() - start)
        times = []
        paused = 0.0  # the small calls' time, left out of the sweep's
        start = time.perf_counter()
        for kind, w, qt, rows, cols in mats:
            s = time.perf_counter()
            kernels.qmatmul_q8(xs[cols], w, qt, rows, cols)
            times.append(time.perf_counter() - s)
            if args.after:
                s = time.perf_counter()
                after[kind].append(small_call())
                warm.append(small_call())
                paused += time.perf_counter() - s
        sweep_s.append(time.perf_counter() - start - paused)
        per_call.append(times)
    print(f"{args.model}, {args.threads} threads; GB/s of one 131072 x 2048 Q4_K / of the sweep, per rep: "
          + " ".join(f"{big.numel() / b / 1e9:.0f}/{nbytes / s / 1e9:.0f}" for b, s in zip(big_s, sweep_s)))
    ratios = [(nbytes / s) / (big.numel() / b) for b, s in zip(big_s, sweep_s)]
    print(f"{len(mats)} calls, {nbytes / 1e6:.0f} MB: median sweep {statistics.median(sweep_s) * 1e3:.2f} ms; "
          f"sweep / large-matrix bandwidth, median of the reps' ratios: {statistics.median(ratios):.2f}")
    median = per_call[sorted(range(args.reps), key=lambda i: sweep_s[i])[args.reps // 2]]
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    for (kind, w, *_), t in zip(mats, median):
        kinds[kind][0] += t
        kinds[kind][1] += w.numel()
        kinds[kind][2] += 1
    for kind, (t, b, n) in sorted(kinds.items()):
        print(f"  {kind:20s} {n:3d} calls {t * 1e3:7.2f} ms  {b / t / 1e9:5.1f} GB/s  {t / n * 1e6:6.1f} us a call")
    if args.after:
        print(f"a 16-row call right after each kind, median (the same call repeated at once: "
              f"{statistics.median(warm) * 1e6:.1f} us):")
        for kind, t in sorted(after.items()):
            print(f"  {kind:20s} {statistics.median(t) * 1e6:6.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
