"""How Minerva itself is measured, through its public engine API: load it, make random
prompts, time a prefill, time a batch decoding together. `bench` and `roofline --measure`
share these, so their figures mean the same thing."""

from __future__ import annotations

import math
import random
import time

from minerva.bench.report import SystemInfo
from minerva.engine.engine import EngineConfig
from minerva.engine.sampler import SamplingParams
from minerva.llm import LLM
from minerva.machine import peak_rss_mb, rss_mb
from minerva.options import speculative_options


def load_minerva(args) -> tuple[LLM, SystemInfo]:
    start_rss = rss_mb()
    # Prompts are random, so the prefix cache only ever hits where a test puts context
    # first on purpose (pp at a depth).
    speculative = speculative_options(args) if getattr(args, "speculative", None) is not None else {}
    llm = LLM(args.model, device=args.device, kernels=args.kernels, dtype=args.dtype, threads=args.threads,
              quantize=args.quantize,
              activations=args.activations, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=max(64, getattr(args, "max_batch", 0)),
              max_num_batched_tokens=args.max_num_batched_tokens,
              decode_steps=getattr(args, "decode_steps", EngineConfig.decode_steps),
              hybrid_kv_cache=not getattr(args, "no_hybrid_kv_cache", False),
              tensor_parallel_size=getattr(args, "tensor_parallel_size", None), **speculative)
    args.dtype = llm.dtype_name  # what auto resolved to, for the report and the roofline
    args.activations = llm.activations
    info = SystemInfo("minerva", llm.loaded.load_seconds, peak_rss_mb(),
                      f"(peak; {rss_mb() - start_rss:.0f} MB for the model and KV pool, "
                      f"dtype {args.dtype}, {args.activations} activations)")
    return llm, info


def random_prompt(rng: random.Random, llm: LLM, length: int) -> list[int]:
    special = {llm.tokenizer.bos_token_id, *llm.tokenizer.eos_token_ids}
    vocab = min(llm.config.vocab_size, 32000)
    out = []
    while len(out) < length:
        t = rng.randrange(vocab)
        if t not in special:
            out.append(t)
    return out


def minerva_prefill(llm: LLM, prompt: list[int], depth: int = 0) -> float:
    """Tokens/s of computing `prompt` after its first `depth` tokens are already in the KV
    cache (they are computed first, untimed, and found by the prefix cache)."""
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    cached = depth - depth % llm.engine.blocks.block_size  # only full blocks are shared
    if depth:
        llm.generate([prompt[:depth]], one, use_tqdm=False)
    start = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    return (len(prompt) - cached) / (time.perf_counter() - start)


def minerva_decode(llm: LLM, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """Generate n tokens for each prompt together. Returns (decode tokens/s, seconds in all):
    the decode rate counts the tokens that came after every request had its first one, over
    the time from then to the last token (a request's first delta may bring more than one
    token, from a decode burst: they were computed before that moment, and do not count);
    NaN when none came after."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    firsts: set[int] = set()
    t_all_first, after, t_last = None, 0, start
    for i, _, delta in llm.stream_many(prompts, params):
        now = time.perf_counter()
        if i not in firsts and delta.token_ids:
            firsts.add(i)
            if len(firsts) == len(prompts):
                t_all_first = now
            t_last = now
            continue
        if t_all_first is not None:
            after += len(delta.token_ids)
        t_last = now
    if t_all_first is None or t_last <= t_all_first or after == 0:
        return math.nan, t_last - start
    return after / (t_last - t_all_first), t_last - start
