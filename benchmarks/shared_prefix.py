"""Prompts that begin with one long prefix, sent together: what the scheduler saves by letting
the later ones wait for the prefix's blocks (computed once, then taken from the prefix cache)
instead of computing them beside the first.

Each setting runs in a process of its own, alternating over --rounds: `wait` is Minerva as it
is; `no-wait` the same build with that rule switched off (every request starts as soon as the
budget allows, as before it). Each process generates one token for each of --prompts prompts:
--shared tokens in common, then two of their own. Prints the time and the prefix-cache hits.

    python benchmarks/shared_prefix.py smollm2-135m --shared 2690
    python benchmarks/shared_prefix.py ~/.cache/minerva/synthetic/tinyllama-1.1b-Q4_0.gguf --shared 1000
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

RUN = """
import json, sys, time
from minerva import LLM, SamplingParams
from minerva.engine.scheduler import Scheduler
model, n, shared, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if mode == "no-wait":
    Scheduler._shares_prompt = lambda self, req: False
llm = LLM(model, kv_cache_memory=float(sys.argv[5]))
one = SamplingParams(max_tokens=1, temperature=0)
llm.generate([[5] * 20], one, use_tqdm=False)  # the kernels warm, a row's time measured
prefix = list(range(1000, 1000 + shared))
prompts = [prefix + [2000 + k, 3000 + k] for k in range(n)]
start = time.perf_counter()
llm.generate(prompts, one, use_tqdm=False)
print(json.dumps({"seconds": time.perf_counter() - start, "hits": llm.engine.blocks.prefix_hits}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--shared", type=int, default=1000, help="tokens the prompts have in common")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-memory", type=float, default=600e6)
    args = ap.parse_args()
    seen: dict[str, list[float]] = {"no-wait": [], "wait": []}
    for r in range(args.rounds):
        for mode in seen:
            out = subprocess.run([sys.executable, "-c", RUN, args.model, str(args.prompts), str(args.shared), mode,
                                  str(args.kv_cache_memory)], capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            seen[mode].append(result["seconds"])
            print(f"round {r + 1} {mode:8s} {result['seconds']:6.2f} s, prefix-cache hits {result['hits']}", flush=True)
    a, b = statistics.median(seen["no-wait"]), statistics.median(seen["wait"])
    print(f"{args.prompts} prompts sharing {args.shared} tokens: no-wait {a:.2f} s, wait {b:.2f} s "
          f"(medians of {args.rounds}; {a / b:.2f}x)")


if __name__ == "__main__":
    main()
