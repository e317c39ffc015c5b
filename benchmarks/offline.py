"""Offline throughput: N random prompts through `LLM.generate`, and K of them batched vs one at a time.

    python benchmarks/offline.py --num-prompts 256 --sequential 32

Prompts are random token ids (like vLLM's random dataset) with input lengths uniform in
[--input-min, --input-max] and output lengths uniform in [--output-min, --output-max],
generated to full length (EOS ignored). Both measurements run in one process, on the
same loaded model, so they compare like with like.
"""

from __future__ import annotations

import argparse
import platform
import random
import time

from minerva import LLM, SamplingParams


def make_workload(llm: LLM, n: int, args) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(args.seed)
    special = {llm.tokenizer.bos_token_id, *llm.tokenizer.eos_token_ids}
    vocab = [t for t in range(min(llm.config.vocab_size, 32000)) if t not in special]
    prompts, params = [], []
    for i in range(n):
        prompts.append([rng.choice(vocab) for _ in range(rng.randint(args.input_min, args.input_max))])
        params.append(SamplingParams(max_tokens=rng.randint(args.output_min, args.output_max),
                                     temperature=0.8, seed=i, ignore_eos=True))
    return prompts, params


def timed(llm: LLM, prompts, params, progress: bool) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--sequential", type=int, default=32, help="prompts also run one at a time")
    ap.add_argument("--input-min", type=int, default=100)
    ap.add_argument("--input-max", type=int, default=1024)
    ap.add_argument("--output-min", type=int, default=100)
    ap.add_argument("--output-max", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", type=float, default=0.2)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              dtype=args.dtype)
    prompts, params = make_workload(llm, max(args.num_prompts, args.sequential), args)
    print(f"model {llm.path.name}; {platform.processor() or platform.machine()}; "
          f"KV pool {llm.engine.blocks.num_blocks} blocks of {llm.engine.blocks.block_size} tokens; "
          f"max_num_seqs {args.max_num_seqs}; dtype {args.dtype}")
    if args.num_prompts:
        secs, toks = timed(llm, prompts[:args.num_prompts], params[:args.num_prompts], True)
        print(f"{args.num_prompts} prompts: {toks} output tokens in {secs:.1f} s = {toks / secs:.1f} "
              f"output tokens/s (preemptions so far: {llm.engine.scheduler.num_preemptions})")
    k = args.sequential
    if k:
        b_secs, b_toks = timed(llm, prompts[:k], params[:k], False)
        s_secs, s_toks = 0.0, 0
        for p, sp in zip(prompts[:k], params[:k]):
            secs, toks = timed(llm, [p], [sp], False)
            s_secs, s_toks = s_secs + secs, s_toks + toks
        print(f"{k} prompts batched:       {b_toks} output tokens in {b_secs:.1f} s = {b_toks / b_secs:.1f} tokens/s")
        print(f"{k} prompts one at a time: {s_toks} output tokens in {s_secs:.1f} s = {s_toks / s_secs:.1f} tokens/s")
        print(f"batched / one at a time: {(b_toks / b_secs) / (s_toks / s_secs):.2f}x")


if __name__ == "__main__":
    main()
