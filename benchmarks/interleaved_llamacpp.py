"""Minerva next to llama.cpp in one process, measurements interleaved round by round.

`minerva bench latency --compare llama.cpp` measures all of Minerva's figures, then all of
llama.cpp's; on a shared machine whose load drifts over minutes, that alone can move the
ratio by 20%. Here each round runs one prefill and one decode on each engine, back to back,
on the same random prompts, the engine that goes first alternating from round to round (an
odd number of rounds gives Minerva one more first place), and the report gives the medians,
the ratio of the medians and every round's ratio.

    python benchmarks/interleaved_llamacpp.py FILE [--activations int8] [--rounds 5]
        [--prompt 512] [--gen 32] [--roofline]

With `--roofline` each round also probes the machine (`minerva.bench.hardware.probe`: read
bandwidth, compute peaks) just before its tests, and each figure is given as the fraction of
that round's roofline ceiling (`minerva roofline`'s cost model, the same bytes and FLOPs for
both engines): the bandwidth this machine has drifts too, so a fraction is only meaningful
against a probe taken at the same time.

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

from minerva.bench.hardware import probe  # noqa: E402
from minerva.bench.measure import load_minerva, minerva_decode, minerva_prefill, random_prompt  # noqa: E402
from minerva.bench.peers import load_peer  # noqa: E402
from minerva.bench.roofline import decode_ceiling, model_costs, prefill_ceiling  # noqa: E402
from minerva.errors import MinervaError  # noqa: E402
from minerva.machine import machine  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a .gguf file (llama.cpp reads the same file)")
    p.add_argument("--activations", choices=("auto", "float", "int8"), default="auto")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of the prefill test")
    p.add_argument("--gen", type=int, default=32, help="tokens of the decode test (after a 16-token prompt)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--roofline", action="store_true",
                   help="probe the machine each round and give each figure's fraction of its ceiling")
    args = p.parse_args()
    for flag in ("rounds", "prompt", "gen"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
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
    fractions: dict[str, list[float]] = {k: [] for k in res}
    costs = model_costs(llm.loaded, dtype=llm.dtype) if args.roofline else None
    for r in range(args.rounds):
        prompt, short = random_prompt(rng, llm, args.prompt), random_prompt(rng, llm, 16)
        hw = probe(seconds=2.0, threads=threads) if args.roofline else None
        # who goes first alternates: in A/B runs of two Minerva builds in one process, the
        # one run first after a read-bandwidth probe came out 2-4% slower, whichever it was
        runs = {"minerva": (lambda: minerva_prefill(llm, prompt), lambda: minerva_decode(llm, [short], args.gen + 1)[0]),
                "llama.cpp": (lambda: peer.prefill(prompt, 0), lambda: peer.decode(short, args.gen))}
        order = ("minerva", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "minerva")
        for i, t in enumerate((pp, tg)):
            for e in order:
                res[f"{e} {t}"].append(runs[e][i]())
        line = f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in res.items())
        if hw is not None:
            ceiling = {pp: prefill_ceiling(costs, hw, args.prompt, llm.dtype_name).tokens_per_second,
                       tg: decode_ceiling(costs, hw, 1, 16 + args.gen // 2, llm.dtype_name).tokens_per_second}
            for k, v in res.items():
                fractions[k].append(v[-1] / ceiling[k.split()[1]])
            line += (f"; probed {hw.bandwidth / 1e9:.1f} GB/s, {hw.int8_peak(llm.dtype_name) / 1e9:.0f} GOPS int8: "
                     + ", ".join(f"{k} {100 * v[-1]:.0f}%" for k, v in fractions.items()))
        print(line, flush=True)
    peer.close()
    print(f"\n{args.model}, {threads} threads, activations {llm.activations}, {args.rounds} rounds (tokens/s)")
    for t in (pp, tg):
        m, ll = res[f"minerva {t}"], res[f"llama.cpp {t}"]
        ratios = " ".join(f"{a / b:.2f}" for a, b in zip(m, ll))
        print(f"{t:8s} minerva {statistics.median(m):7.1f}  llama.cpp {statistics.median(ll):7.1f}  "
              f"ratio of medians {statistics.median(m) / statistics.median(ll):.2f}  rounds: {ratios}")
    if args.roofline:
        print("fraction of each round's roofline ceiling (medians): "
              + ", ".join(f"{k} {100 * statistics.median(v):.0f}%" for k, v in fractions.items()))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MinervaError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
