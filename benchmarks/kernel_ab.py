"""Two builds of the kernels in one process, their calls alternating: a kernel change timed
against another checkout's build on a shared, noisy host.

    git worktree add /tmp/base HEAD        # (before the change) the build to compare against
    python benchmarks/kernel_ab.py --base /tmp/base --type Q5_K --rows 5632 --cols 2048 --m 512

This checkout's kernels are "new", the checkout given by --base "base"; each is built (or found
in its cache) by its own checkout, in a process of its own, then both are loaded here. One
packed matrix (random blocks, as `int8_kernels.py` makes them, regrouped by this checkout where
the type is, in 2 MiB pages as the loader keeps weights) is multiplied by both builds in turn, for --pairs pairs, the order swapped every pair: a turn is
one call (to wake the build's threads) and then --calls calls back to back, whose median counts,
and a few milliseconds' pause, so that the idle build's threads have gone to sleep.
Prints each build's median and best multiply-adds per second, the median of the pairs' speed
ratios (new over base) with its quartiles, and whether both gave the same bits (a change that
alters the packed layout or the arithmetic shows here, and its timing means little then).
Separate processes, one build each, swing with the host by more than a few percent between
runs; pairs taken milliseconds apart see the same host.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from int8_kernels import random_matrix  # (this script's folder is on the path)
from minerva.kernels import hugepages, native, repack

Q = gguf.GGMLQuantizationType
BUILD = ("from minerva.kernels import native\n"
         "if native.load() is None: raise SystemExit(native.unavailable_reason)\n"
         "print(native.build_dir())\n")


def build_of(tree: Path) -> Path:
    """The build directory of the checkout at `tree`, built there if need be."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", BUILD], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        lines = (out.stderr or out.stdout).strip().splitlines()
        raise SystemExit(f"kernel_ab: the kernels of {tree} did not build: {lines[-1] if lines else out.returncode}")
    return Path(out.stdout.strip().splitlines()[-1])


def load_build(build: Path):
    """The module built in `build`, under a name of its own: under the same name as the loaded
    one, Python would hand back that one."""
    so = build / "minerva_qmatmul.so"
    spec = importlib.util.spec_from_file_location("kernel_ab_base.minerva_qmatmul", so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="a checkout of Minerva whose kernels are the baseline")
    ap.add_argument("--type", default="Q4_K", choices=sorted(t.name for t in repack.TYPES))
    ap.add_argument("--rows", type=int, default=5632)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--m", type=int, default=512, help="rows of x")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--calls", type=int, default=5, help="calls a turn, back to back")
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: torch's setting)")
    args = ap.parse_args()
    block = gguf.GGML_QUANT_SIZES[Q[args.type]][0]
    if args.m < 1 or args.rows < 1 or args.cols < 1 or args.cols % block or args.pairs < 2 or args.calls < 1:
        ap.error(f"--m, --rows must be positive, --cols a multiple of {args.type}'s block of {block}, "
                 "--pairs 2 or more, --calls 1 or more")
    base_tree = Path(args.base).expanduser().resolve()
    if not (base_tree / "minerva" / "kernels" / "native.py").is_file():
        ap.error(f"--base {args.base}: not a checkout of Minerva (no minerva/kernels/native.py there)")
    new = native.load()
    if new is None:
        raise SystemExit(f"kernel_ab: this checkout's kernels are unavailable: {native.unavailable_reason}")
    base_build = build_of(base_tree)
    base = new if base_build == native.build_dir() else load_build(base_build)
    if args.threads:
        torch.set_num_threads(args.threads)
    for k in (new, base):
        k.set_num_threads(args.threads)

    qtype = Q[args.type]
    w = random_matrix(qtype, args.rows, args.cols, np.random.default_rng(0))
    code = int(qtype)
    if repack.applies(new, qtype) and repack.applies(base, qtype):  # (else both on the GGUF layout)
        w, code = repack.regroup_in_place(w, qtype, args.rows, args.cols, new), code | repack.REGROUPED
    w = hugepages.Pool(hugepages.padded(w)).take(w)  # in 2 MiB pages, as the loader keeps weights
    x = torch.randn(args.m, args.cols)
    same = torch.equal(new.qmatmul_q8(x, w, code, args.rows, args.cols), base.qmatmul_q8(x, w, code, args.rows, args.cols))

    def timed(k) -> float:  # a turn: one call to wake the build's threads, then the median of --calls
        k.qmatmul_q8(x, w, code, args.rows, args.cols)
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            k.qmatmul_q8(x, w, code, args.rows, args.cols)
            times.append(time.perf_counter() - start)
        time.sleep(0.005)  # the helpers spin 2 ms before sleeping: the other build's turn has the cores
        return statistics.median(times)

    t_new, t_base = [], []
    for i in range(args.pairs):
        if i % 2:
            t_base.append(timed(base))
            t_new.append(timed(new))
        else:
            t_new.append(timed(new))
            t_base.append(timed(base))
    ratios = [b / n for n, b in zip(t_new, t_base)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)

    def rate(seconds: float) -> float:
        return args.m * args.rows * args.cols / seconds / 1e9

    print(f"{args.type} {args.rows} x {args.cols}, {args.m} rows of x, {torch.get_num_threads()} threads, "
          f"{args.pairs} pairs")
    print(f"base ({base_tree}): {rate(statistics.median(t_base)):.1f} GMAC/s median, {rate(min(t_base)):.1f} best")
    print(f"new  (this checkout): {rate(statistics.median(t_new)):.1f} GMAC/s median, {rate(min(t_new)):.1f} best")
    print(f"speed new / base: {statistics.median(ratios):.3f} median of the pairs (quartiles {q1:.3f}-{q3:.3f}); "
          f"same bits: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
