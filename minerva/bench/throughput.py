"""`minerva bench throughput`: offline throughput, N requests of random lengths through the
engine at once (and through a peer with continuous batching), one timed run after a warm-up."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import asdict

from minerva.bench.args import add_common_options, int_range
from minerva.bench.measure import load_minerva, random_prompt
from minerva.bench.peers import load_peer
from minerva.bench.report import Figure, header, print_report, threads_used, write_json
from minerva.engine.sampler import SamplingParams


def cmd_throughput(args) -> int:
    rng = random.Random(args.seed)
    llm, info = load_minerva(args)
    lo_in, hi_in = args.input_len
    lo_out, hi_out = args.output_len
    prompts = [random_prompt(rng, llm, rng.randint(lo_in, hi_in)) for _ in range(args.num_prompts)]
    outs = [rng.randint(lo_out, hi_out) for _ in range(args.num_prompts)]
    params = [SamplingParams(max_tokens=n, temperature=0.8, seed=i, ignore_eos=True) for i, n in enumerate(outs)]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2)  # warm-up
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
    summary = {"minerva": {"seconds": secs, "input_tokens": in_tokens, "output_tokens": out_tokens,
                           "preemptions": llm.engine.scheduler.num_preemptions}}
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
                 f"tokens (EOS ignored); minerva finished in {secs:.1f} s")
    print_report(lines, systems, figures)
    write_json(args.json, {"header": lines, "systems": [asdict(s) for s in systems], "runs": summary,
                           "figures": [{**asdict(f), "mean": f.mean} for f in figures]})
    return 0


def add_parser(bsub) -> None:
    q = bsub.add_parser("throughput", help="offline: N requests of random lengths through the engine")
    add_common_options(q)
    q.add_argument("--num-prompts", type=int, default=64)
    q.add_argument("--input-len", type=int_range, default=(100, 1024), help="N or MIN:MAX")
    q.add_argument("--output-len", type=int_range, default=(100, 512), help="N or MIN:MAX")
    q.add_argument("--max-batch", type=int, default=64, help="peer's parallel sequences")
    q.set_defaults(func=cmd_throughput)
