"""Greedy decode with a model's native layers as one call (`CausalLM.stack_layers`) and as
one call per layer, alternating in one process so both see the same machine.

    python benchmarks/layer_stack.py smollm2-135m [--tokens 128] [--pairs 8]

Prints each way's tokens/s per generation and the median of the pairwise ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

from minerva import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=8)
    args = ap.parse_args()
    llm = LLM(args.model)
    model = llm.loaded.model
    stack = model.stack
    if stack is None:
        raise SystemExit(f"{args.model}: its layers do not run as one native call here (no native layer kernels)")
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate(["Once upon a time"], params, use_tqdm=False)  # warm-up
    speeds: dict[str, list[float]] = {"stack": [], "per layer": []}
    try:
        for i in range(args.pairs):
            for way in ("stack", "per layer") if i % 2 == 0 else ("per layer", "stack"):
                model.stack = stack if way == "stack" else None
                start = time.perf_counter()
                llm.generate(["Once upon a time"], params, use_tqdm=False)
                speeds[way].append(args.tokens / (time.perf_counter() - start))
    finally:
        model.stack = stack
    for way, s in speeds.items():
        print(f"{way:9s} median {statistics.median(s):6.1f} tokens/s  {[round(x, 1) for x in s]}")
    ratios = [a / b for a, b in zip(speeds["stack"], speeds["per layer"])]
    print(f"stack / per layer, pairwise median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
