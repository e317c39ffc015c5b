"""Minerva next to llama.cpp in one process, measurements interleaved round by round.

`minerva bench latency --compare llama.cpp` measures all of Minerva's figures, then all of
llama.cpp's; on a shared machine whose load drifts over minutes, that alone can move the
ratio by 20%. Here each round runs one prefill and one decode on each engine, back to back,
on the same random prompts, and the report gives the medians, the ratio of the medians and
every round's ratio.

    python benchmarks/interleaved_llamacpp.py FILE [--activations int8] [--rounds 5]
        [--prompt 512] [--gen 32]

Needs llama-cpp-python (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minerva.bench.measure import load_minerva, minerva_decode, minerva_prefill, random_prompt  # noqa: E402
from minerva.bench.peers import load_peer  # noqa: E402
from minerva.machine import machine  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a .gguf file (llama.cpp reads the same file)")
    p.add_argument("--activations", choices=("float", "int8"), default="float")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of the prefill test")
    p.add_argument("--gen", type=int, default=32, help="tokens of the decode test (after a 16-token prompt)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    threads = args.threads or machine().physical_cores
    opts = types.SimpleNamespace(model=args.model, dtype="auto", threads=threads, quantize=None,
                                 activations=args.activations, kv_cache_memory=0.2,
                                 max_num_batched_tokens=max(2048, args.prompt), seed=0, speculative=None)
    llm, _ = load_minerva(opts)
    peer = load_peer("llama.cpp", llm.path, threads, n_ctx=args.prompt + args.gen + 64)
    rng = random.Random(0)
    minerva_prefill(llm, random_prompt(rng, llm, 64))  # warm-up
    pp, tg = f"pp{args.prompt}", f"tg{args.gen}"
    res: dict[str, list[float]] = {f"{e} {t}": [] for t in (pp, tg) for e in ("minerva", "llama.cpp")}
    for r in range(args.rounds):
        prompt, short = random_prompt(rng, llm, args.prompt), random_prompt(rng, llm, 16)
        res[f"minerva {pp}"].append(minerva_prefill(llm, prompt))
        res[f"llama.cpp {pp}"].append(peer.prefill(prompt, 0))
        res[f"minerva {tg}"].append(minerva_decode(llm, [short], args.gen + 1)[0])
        res[f"llama.cpp {tg}"].append(peer.decode(short, args.gen))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in res.items()), flush=True)
    peer.close()
    print(f"\n{args.model}, {threads} threads, activations {args.activations}, {args.rounds} rounds (tokens/s)")
    for t in (pp, tg):
        m, ll = res[f"minerva {t}"], res[f"llama.cpp {t}"]
        ratios = " ".join(f"{a / b:.2f}" for a, b in zip(m, ll))
        print(f"{t:8s} minerva {statistics.median(m):7.1f}  llama.cpp {statistics.median(ll):7.1f}  "
              f"ratio of medians {statistics.median(m) / statistics.median(ll):.2f}  rounds: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
