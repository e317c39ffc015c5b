"""`minerva bench throughput`: offline throughput, N requests of random lengths through the
engine at once (and through a peer with continuous batching), one timed run after a warm-up.

With `--sequential K` the first K of the same requests also run one at a time on the same
loaded engine, and the report gives batched over one-at-a-time output tokens/s: what
continuous batching buys on this machine, measured in one process.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import asdict

from minerva.bench.args import add_common_options, int_range
from minerva.bench.measure import load_minerva, random_prompt
from minerva.bench.peers import check_peer, load_peer
from minerva.bench.report import Figure, header, print_report, threads_used, write_json
from minerva.engine.sampler import SamplingParams
from minerva.errors import MinervaError
from minerva.llm import LLM


def cmd_throughput(args) -> int:
    if not 0 <= args.sequential <= args.num_prompts:
        raise MinervaError(f"--sequential must be between 0 and --num-prompts ({args.num_prompts}), "
                           f"got {args.sequential}")
    rng = random.Random(args.seed)
    for peer in args.compare:
        check_peer(peer)  # before loading anything
    llm, info = load_minerva(args)
    lo_in, hi_in = args.input_len
    lo_out, hi_out = args.output_len
    prompts = [random_prompt(rng, llm, rng.randint(lo_in, hi_in)) for _ in range(args.num_prompts)]
    outs = [rng.randint(lo_out, hi_out) for _ in range(args.num_prompts)]
    params = [SamplingParams(max_tokens=n, temperature=0.8, seed=i, ignore_eos=True) for i, n in enumerate(outs)]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    secs = time.perf_counter() - start
    out_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    in_tokens = sum(len(p) for p in prompts)
    lines = header(llm.path, threads_used(args))
    figures = [Figure("output", "minerva", [out_tokens / secs]),
               Figure("total", "minerva", [(in_tokens + out_tokens) / secs])]
    systems = [info]
    model_path = llm.path
    preemptions = llm.engine.scheduler.num_preemptions
    summary = {"minerva": {"seconds": secs, "input_tokens": in_tokens, "output_tokens": out_tokens,
                           "preemptions": preemptions}}
    lines.append(f"engine:  KV pool {llm.engine.blocks.num_blocks} blocks of {llm.engine.blocks.block_size} "
                 f"tokens, max_num_seqs {llm.engine.config.max_num_seqs}")
    k = args.sequential
    if k:
        batched = (secs, out_tokens) if k == args.num_prompts else None
        summary["minerva"]["sequential"] = _sequential(llm, prompts[:k], params[:k], batched)
    del llm, results
    for peer in args.compare:
        n_seq = min(args.num_prompts, args.max_batch)  # llama.cpp splits n_ctx among sequences
        runner = load_peer(peer, model_path, threads_used(args),
                           n_ctx=n_seq * (max(len(p) + n for p, n in zip(prompts, outs)) + 8), n_seq=n_seq)
        systems.append(runner.info)
        secs_p = runner.generate_batch(prompts, outs, args.max_batch)
        figures += [Figure("output", peer, [sum(outs) / secs_p]),
                    Figure("total", peer, [(in_tokens + sum(outs)) / secs_p])]
        summary[peer] = {"seconds": secs_p, "input_tokens": in_tokens, "output_tokens": sum(outs)}
        runner.close()
    lines.append(f"workload: {args.num_prompts} requests, input {lo_in}-{hi_in}, output {lo_out}-{hi_out} "
                 f"tokens (EOS ignored); minerva finished in {secs:.1f} s, {preemptions} preemptions")
    print_report(lines, systems, figures)
    if k:
        _print_sequential(summary["minerva"]["sequential"])
    write_json(args.json, {"header": lines, "systems": [asdict(s) for s in systems], "runs": summary,
                           "figures": [{**asdict(f), "mean": f.mean} for f in figures]})
    return 0


def _timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def _sequential(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
                batched: tuple[float, int] | None) -> dict:
    """The same requests batched (`batched`, or run here when None) and then one at a time."""
    b_secs, b_tokens = batched or _timed(llm, prompts, params)
    s_secs, s_tokens = 0.0, 0
    for prompt, sp in zip(prompts, params):
        secs, tokens = _timed(llm, [prompt], [sp])
        s_secs, s_tokens = s_secs + secs, s_tokens + tokens
    batched_rate, one_rate = b_tokens / b_secs, s_tokens / s_secs
    return {"requests": len(prompts), "batched": {"seconds": b_secs, "output_tokens": b_tokens,
                                                  "output_tokens_per_s": batched_rate},
            "one_at_a_time": {"seconds": s_secs, "output_tokens": s_tokens, "output_tokens_per_s": one_rate},
            "batched_over_one_at_a_time": batched_rate / one_rate}


def _print_sequential(seq: dict) -> None:
    print()
    print(f"the first {seq['requests']} requests on minerva, output tokens:")
    for key, label in (("batched", "batched"), ("one_at_a_time", "one at a time")):
        run = seq[key]
        print(f"  {label:<15}{run['output_tokens']:>8} in {run['seconds']:8.2f} s = "
              f"{run['output_tokens_per_s']:9.1f} tok/s")
    print(f"  batched / one at a time: {seq['batched_over_one_at_a_time']:.2f}x")


def add_parser(bsub) -> None:
    q = bsub.add_parser("throughput", help="offline: N requests of random lengths through the engine")
    add_common_options(q)
    q.add_argument("--num-prompts", type=int, default=64)
    q.add_argument("--input-len", type=int_range, default=(100, 1024), help="N or MIN:MAX")
    q.add_argument("--output-len", type=int_range, default=(100, 512), help="N or MIN:MAX")
    q.add_argument("--max-batch", type=int, default=64, help="peer's parallel sequences")
    q.add_argument("--sequential", type=int, default=0, metavar="K",
                   help="also run the first K requests one at a time and report batched / one at a time")
    q.set_defaults(func=cmd_throughput)
