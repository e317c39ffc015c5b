"""KV memory a long request holds, and its decode speed, with sliding-window layers in their own
block tables (the default) against one table for all layers (`--no-hybrid-kv-cache`).

Both engines are loaded in one process. For each depth a random context is computed once in
each (then found by the prefix cache); each pair then runs the context plus a fresh 8-token
suffix through both, alternating which goes first, and records the KV bytes the request holds
at its first token and its decode tokens/s after it. Medians of the pairs.

    python benchmarks/hybrid_kv.py gemma3-270m --depths 4096,16384,32000 --tokens 32 --pairs 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from minerva import LLM, SamplingParams


def held_and_rate(llm: LLM, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(KV bytes the request holds at its first token, decode tokens/s after it)."""
    cache, blocks = llm.engine.cache, llm.engine.blocks
    per_block = cache.nbytes / cache.num_blocks
    params = SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True)
    held, first, n = 0.0, None, 0
    for delta in llm.stream(prompt, params):
        if first is None:
            held, first = blocks.num_used_blocks * per_block, time.perf_counter()
        else:
            n += len(delta.token_ids)
    return held, n / (time.perf_counter() - first)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--depths", default="4096,16384,32000")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens timed per run")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--kv-cache-memory", type=float, default=0.2, help="for each engine")
    p.add_argument("--load-first", choices=["hybrid", "one-table"], default="hybrid",
                   help="which engine to load first (the table keeps its columns)")
    args = p.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    modes = ["hybrid", "one table"] if args.load_first == "hybrid" else ["one table", "hybrid"]
    loaded = {mode: LLM(args.model, kv_cache_memory=args.kv_cache_memory, hybrid_kv_cache=(mode == "hybrid"))
              for mode in modes}
    engines = {mode: loaded[mode] for mode in ("hybrid", "one table")}
    for mode, llm in engines.items():
        e = llm.engine
        print(f"{mode}: {e.cache.layout.num_groups} block tables, {e.blocks.num_blocks} blocks of "
              f"{e.cache.nbytes / e.cache.num_blocks / 1e3:.1f} KB, max model length {e.max_model_len}")
    rng = random.Random(0)
    vocab = min(32000, next(iter(engines.values())).config.vocab_size)
    print("| depth | KV held, hybrid | KV held, one table | ratio | decode tok/s, hybrid | one table | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for depth in depths:
        context = [rng.randrange(100, vocab) for _ in range(depth)]
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for llm in engines.values():
            llm.generate([context], one, use_tqdm=False)
        got: dict[str, list[tuple[float, float]]] = {mode: [] for mode in engines}
        for i in range(args.pairs):
            suffix = [rng.randrange(100, vocab) for _ in range(8)]
            order = list(engines) if i % 2 == 0 else list(engines)[::-1]
            for mode in order:
                got[mode].append(held_and_rate(engines[mode], context + suffix, args.tokens))
        (hb, hr), (ob, orate) = ([statistics.median(x) for x in zip(*got[m])] for m in engines)
        print(f"| {depth} | {hb / 1e6:.1f} MB | {ob / 1e6:.1f} MB | {ob / hb:.2f}× | {hr:.1f} | {orate:.1f} | "
              f"{hr / orate:.3f}× |", flush=True)
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
