"""Greedy decode with several --decode-steps values, alternating round by round in one process.

    python benchmarks/decode_steps.py MODEL [--rounds 7] [--steps 1,4,8,16] [--tokens 128]

Each round decodes one 3-token prompt for `--tokens` tokens at each value in turn and prints
the decode tokens/s (`minerva.bench.measure.minerva_decode`: after the first token); the end
gives each value's median. The bursts' time cap (minerva/engine/scheduler.py, BURST_SECONDS)
stays in force: on shapes whose forwards take over 0.1 / N seconds a value N acts as less.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minerva import LLM  # noqa: E402
from minerva.bench.measure import minerva_decode  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", default="1,4,8,16", help="comma-separated --decode-steps values")
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    try:
        values = [int(v) for v in args.steps.split(",")]
    except ValueError:
        p.error(f"--steps must be comma-separated integers, got {args.steps!r}")
    if args.rounds < 1 or args.tokens < 2 or min(values) < 1:
        p.error("--rounds and every --steps value must be at least 1, --tokens at least 2")
    llm = LLM(args.model)
    scheduler = llm.engine.scheduler
    base = scheduler.config
    prompt = [[1, 15043, 727]]
    minerva_decode(llm, prompt, 64)  # warm-up
    rates: dict[int, list[float]] = {v: [] for v in values}
    for r in range(args.rounds):
        for v in values:
            scheduler.config = dataclasses.replace(base, decode_steps=v)
            rates[v].append(minerva_decode(llm, prompt, args.tokens)[0])
        print(f"round {r + 1}: " + ", ".join(f"{v}: {rates[v][-1]:.1f}" for v in values), flush=True)
    print("medians (tokens/s): " + " | ".join(f"{v}: {statistics.median(x):.1f}" for v, x in rates.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
