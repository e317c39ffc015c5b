"""What sampling costs a decode step: `sample_batch` alone, and decode with sampling end to end.

    python benchmarks/sampling.py [--vocab 49152] [--batch 1,32]
    python benchmarks/sampling.py --model smollm2-135m [--batch 1,32] [--temperature 0.8] [--top-p 0.95]

The first form times `minerva.engine.sampler.sample_batch` on random logits (scaled by
--spread) for greedy decoding and the usual sampling settings, torch on one thread and the
native kernels on all, as in an engine step; medians of --reps calls. The second decodes
--tokens tokens for each batch size with the given settings and prints the median decode
step's tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minerva.engine.sampler import SamplingParams, new_state, sample_batch
from minerva.kernels import native

SETTINGS = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.7, top_p=0.9),
            dict(temperature=0.7, top_k=40), dict(temperature=1.0, min_p=0.05)]


def time_sampler(vocab: int, batches: list[int], spread: float, reps: int) -> None:
    kernels = native.load()
    if kernels is not None:  # as in an engine step: the kernels on every thread, torch's ops on one
        kernels.set_num_threads(torch.get_num_threads())
    torch.set_num_threads(1)
    for b in batches:
        for kw in SETTINGS:
            states = [new_state(SamplingParams(seed=i, **kw), [1, 2, 3], torch.device("cpu")) for i in range(b)]
            x = torch.randn(b, vocab, generator=torch.Generator().manual_seed(0)) * spread
            sample_batch(x, states)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                sample_batch(x, states)
                times.append(time.perf_counter() - start)
            name = ", ".join(f"{k}={v}" for k, v in kw.items())
            print(f"batch {b:3d}  {name:30s} {statistics.median(times) * 1e3:8.2f} ms")


def time_decode(model: str, batches: list[int], params: SamplingParams) -> None:
    from minerva import LLM

    llm = LLM(model, kv_cache_memory=512 << 20)
    for b in batches:
        prompts = [llm.tokenizer.encode(f"Story number {i}: the history of the city ") for i in range(b)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        engine, steps = llm.engine, []
        step = engine.step

        def timed():
            start = time.perf_counter()
            out = step()
            steps.append(time.perf_counter() - start)
            return out

        engine.step = timed
        try:
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            engine.step = step
        print(f"batch {b:3d}  {b / statistics.median(steps):8.1f} tokens/s (median of {len(steps)} steps)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="decode end to end with this model instead of timing the sampler alone")
    ap.add_argument("--batch", default="1,32", help="batch sizes, comma-separated")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--spread", type=float, default=3.0, help="the random logits' standard deviation")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    try:
        batches = [int(v) for v in args.batch.split(",")]
    except ValueError:
        ap.error(f"--batch takes sizes separated by commas, got '{args.batch}'")
    if min(batches) < 1 or args.vocab < 1 or args.reps < 1 or args.tokens < 2:
        ap.error("--batch, --vocab and --reps must be positive and --tokens at least 2")
    if args.model:
        time_decode(args.model, batches, SamplingParams(max_tokens=args.tokens, temperature=args.temperature,
                                                        top_p=args.top_p, seed=1, ignore_eos=True))
    else:
        time_sampler(args.vocab, batches, args.spread, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
