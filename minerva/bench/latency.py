"""`minerva bench latency`, llama-bench style: prompt processing (pp) and generation (tg) of
one sequence, optionally at a KV depth, as mean ± standard deviation over `-r` repetitions,
then each test's roofline ceiling on this machine (bandwidth and compute probed, costs as in
`minerva roofline`) and the fraction of it Minerva reached."""

from __future__ import annotations

import random
from dataclasses import asdict

from minerva.bench.args import add_common_options, ints
from minerva.bench.hardware import probe
from minerva.bench.measure import load_minerva, minerva_decode, minerva_prefill, random_prompt
from minerva.bench.peers import check_peer, load_peer
from minerva.bench.report import Figure, header, print_report, threads_used, write_json
from minerva.bench.roofline import Row, ceiling_table, decode_ceiling, model_costs, prefill_ceiling
from minerva.errors import MinervaError


def cmd_latency(args) -> int:
    rng = random.Random(args.seed)
    for peer in args.compare:
        check_peer(peer)  # before loading anything
    llm, info = load_minerva(args)
    systems, figures = [info], []
    depths = args.depth or [0]

    def prompts(length: int) -> list[list[int]]:
        return [random_prompt(rng, llm, max(length, 1)) for _ in range(args.repetitions)]

    ctx = llm.engine.max_model_len  # the model's context, or less when the KV pool holds less
    longest = max(depths) + max([*args.prompt, *args.gen, 1]) + 1
    if longest > ctx:  # before anything runs, so no figure is lost
        raise MinervaError(f"--depth {max(depths)} plus the longest prompt or generation needs {longest} tokens "
                           f"of context, but this model and KV cache hold {ctx}; lower --depth "
                           f"(or raise --kv-cache-memory)")
    plan = []  # (name, kind, depth, prompts, n): pp prompts hold depth + n tokens
    for d in depths:
        suffix = f"@d{d}" if d else ""
        plan += [(f"pp{p}{suffix}", "pp", d, prompts(d + p), p) for p in args.prompt if p]
        plan += [(f"tg{n}{suffix}", "tg", d, prompts(d), n) for n in args.gen if n]

    minerva_prefill(llm, prompts(min(64, longest - 1))[0])  # warm-up: fits where the longest test does
    for name, kind, depth, ps, n in plan:
        fig = Figure(name, "minerva")
        for prompt in ps:
            if kind == "pp":
                fig.samples.append(minerva_prefill(llm, prompt, depth))
            else:  # n + 1 tokens: the first comes from the prompt's forward, then n decode steps
                fig.samples.append(minerva_decode(llm, [prompt], n + 1)[0])
        figures.append(fig)
    roofline_lines, roofline = _roofline(llm, args, plan, figures)
    lines = header(llm.path, threads_used(args))
    model_path = llm.path
    llm = None  # free the model before loading a peer
    for peer in args.compare:
        runner = load_peer(peer, model_path, threads_used(args), n_ctx=_ctx_needed(plan))
        systems.append(runner.info)
        for name, kind, depth, ps, n in plan:
            fig = Figure(name, peer)
            for prompt in ps:
                if kind == "pp":
                    fig.samples.append(runner.prefill(prompt, depth))
                else:
                    fig.samples.append(runner.decode(prompt, n))
            figures.append(fig)
        runner.close()
    print_report(lines, systems, figures)
    untimed = [f.name for f in figures if f.samples and not f.timed]
    if untimed:
        print(f"{', '.join(untimed)}: n/a: every token came with the first (a decode burst computes up to "
              f"--decode-steps {getattr(args, 'decode_steps', 1)} tokens at once), too few to time; give -n above "
              "it, or --decode-steps 1")
    print("\n".join(roofline_lines))
    write_json(args.json, {"header": lines, "systems": [asdict(s) for s in systems],
                           "figures": [{**asdict(f), "mean": f.mean, "std": f.std} for f in figures],
                           "roofline": roofline})
    return 0


def _roofline(llm, args, plan, figures: list[Figure]) -> tuple[list[str], dict]:
    """Each test's ceiling on this machine (probed), and the fraction of it Minerva reached:
    tg at batch 1 and its mean context, pp after its depth."""
    hw = probe(seconds=2.0)
    cfg = llm.engine.config
    costs = model_costs(llm.loaded, cfg.kv_cache_dtype_k, cfg.kv_cache_dtype_v, dtype=llm.dtype)
    rows = []
    for (name, kind, depth, _, n), fig in zip(plan, figures):
        ceiling = (prefill_ceiling(costs, hw, n, args.dtype, depth) if kind == "pp"
                   else decode_ceiling(costs, hw, 1, max(depth, 1) + n // 2, args.dtype))
        rows.append(Row(name, ceiling, fig.mean))
    int8 = "; int8 for the matmuls on 8-bit activations" if costs.int8_params and hw.int8_ops else ""
    lines = ["", f"roofline: {hw.describe()}; {costs.weight_bytes_read(1) / 1e6:,.1f} MB of weights "
                 f"read per decode step ({args.dtype} ceilings{int8})", *ceiling_table(rows)]
    return lines, {"hardware": asdict(hw), "weight_bytes_per_token": costs.weight_bytes_read(1),
                   "tests": [{"name": r.label, "ceiling_tokens_per_s": r.ceiling.tokens_per_second,
                              "bound": r.ceiling.bound, "fraction": r.measured / r.ceiling.tokens_per_second}
                             for r in rows]}


def _ctx_needed(plan) -> int:
    return max(len(p) + n + 8 for _, _, _, ps, n in plan for p in ps)


def add_parser(bsub) -> None:
    q = bsub.add_parser("latency", help="llama-bench style: prompt processing (pp) and generation (tg)")
    add_common_options(q)
    q.add_argument("-p", "--prompt", type=ints, default=[512], help="prompt lengths (comma-separated)")
    q.add_argument("-n", "--gen", type=ints, default=[128], help="generation lengths (comma-separated)")
    q.add_argument("-r", "--repetitions", type=int, default=5)
    q.add_argument("-d", "--depth", type=ints, default=[0], help="KV depth (tokens already in context)")
    q.set_defaults(func=cmd_latency)
