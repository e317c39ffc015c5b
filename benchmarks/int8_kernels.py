"""One packed matrix through the int8 kernels, GGUF layout against regrouped, at a few row counts.

    python benchmarks/int8_kernels.py --type Q8_0 --rows 2880 --cols 2880 --m 1,2,4,8,16

Q6_K, which the loader never regroups, is timed in the GGUF layout only.

Prints milliseconds per matmul and multiply-adds per second (medians). The weights are random
blocks with small scales, in 2 MiB pages as the loader keeps weights; the matrix is the size
given, so a small one sits in the caches and a large one (--rows 32768) streams from memory.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
import torch

from minerva.kernels import hugepages, native, repack

Q = gguf.GGMLQuantizationType


def random_matrix(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> torch.Tensor:
    if qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):  # gguf cannot quantize these: random blocks as synthetic.py writes them
        from synthetic import RandomTensor  # (this script's folder is on the path)
        t = RandomTensor(qtype, (rows, cols), np.random.SeedSequence(0), {})
        raw = rng.integers(0, 256, t.nbytes, dtype=np.uint8)
        return torch.from_numpy(t._shape(raw).reshape(rows, -1).copy())
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    return torch.from_numpy(gguf.quants.quantize(x, qtype).reshape(rows, -1).copy())


def median_seconds(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="Q8_0", choices=sorted(t.name for t in repack.TYPES))
    ap.add_argument("--rows", type=int, default=2880)
    ap.add_argument("--cols", type=int, default=2880)
    ap.add_argument("--m", default="1,2,4,8,16", help="rows of x, comma-separated")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: torch's setting)")
    args = ap.parse_args()
    try:
        ms = [int(v) for v in args.m.split(",")]
    except ValueError:
        ap.error(f"--m takes row counts separated by commas, got '{args.m}'")
    block = gguf.GGML_QUANT_SIZES[Q[args.type]][0]
    if min(ms) < 1 or args.rows < 1 or args.cols < 1 or args.cols % block:
        ap.error(f"--m and --rows must be positive and --cols a multiple of {args.type}'s block of {block}")
    kernels = native.load()
    if kernels is None:
        raise SystemExit("this CPU cannot run the packed kernels (AVX2 or AVX-512 needed)")
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels.set_num_threads(args.threads)
    qtype = Q[args.type]
    ggml = random_matrix(qtype, args.rows, args.cols, np.random.default_rng(0))
    layouts = [("gguf layout", ggml, int(qtype))]
    if repack.applies(kernels, qtype):  # (Q6_K: where the build regroups it)
        regrouped = repack.regroup_in_place(ggml.clone(), qtype, args.rows, args.cols, kernels)
        layouts.append(("regrouped", regrouped, int(qtype) | repack.REGROUPED))
    pool = hugepages.Pool(sum(hugepages.padded(t) for _, t, _ in layouts))
    layouts = [(name, pool.take(t), qt) for name, t, qt in layouts]
    print(f"{args.type} {args.rows} x {args.cols} ({ggml.numel() / 1e6:.1f} MB), {torch.get_num_threads()} threads")
    for m in ms:
        x = torch.randn(m, args.cols)
        line = [f"M={m:3d}"]
        for name, packed, qt in layouts:
            s = median_seconds(lambda: kernels.qmatmul_q8(x, packed, qt, args.rows, args.cols), args.reps)
            line.append(f"{name} {s * 1e3:7.3f} ms {m * args.rows * args.cols / s / 1e9:6.1f} GMAC/s")
        print("   ".join(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
