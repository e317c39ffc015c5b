"""`minerva bench sweep`: generated tokens/s at each batch size, next to the roofline's
decode ceiling for the same model and machine; writes a CSV, a JSON and a plot."""

from __future__ import annotations

import random
import sys
from dataclasses import asdict
from pathlib import Path

from minerva.bench.args import add_common_options, ints
from minerva.bench.hardware import probe
from minerva.bench.measure import load_minerva, minerva_decode, random_prompt
from minerva.bench.peers import check_peer, load_peer
from minerva.bench.report import Figure, header, print_report, threads_used, write_json
from minerva.bench.roofline import decode_ceiling, model_costs
from minerva.errors import MinervaError, write_output


def cmd_sweep(args) -> int:
    rng = random.Random(args.seed)
    for peer in args.compare:
        check_peer(peer)  # before loading anything
    llm, info = load_minerva(args)
    sizes = args.batch_sizes
    rows = []
    workload = {b: [random_prompt(rng, llm, args.input_len) for _ in range(b)] for b in sizes}
    minerva_decode(llm, [random_prompt(rng, llm, 16)] * 2, 4)  # warm-up
    for b in sizes:
        rate, secs = minerva_decode(llm, workload[b], args.output_len)
        rows.append({"batch": b, "system": "minerva", "gen_tokens_per_s": rate, "seconds": secs})
        print(f"minerva batch {b:3d}: {rate:8.1f} generated tokens/s", file=sys.stderr)
    ceiling = _sweep_ceiling(llm, args, sizes)
    lines = header(llm.path, threads_used(args))
    model_path, model_name = llm.path, llm.path.name
    systems = [info]
    del llm
    for peer in args.compare:
        runner = load_peer(peer, model_path, threads_used(args),
                           n_ctx=(args.input_len + args.output_len + 8) * max(sizes), n_seq=max(sizes))
        systems.append(runner.info)
        for b in sizes:
            rate = runner.decode_batch(workload[b], args.output_len)
            rows.append({"batch": b, "system": peer, "gen_tokens_per_s": rate})
            print(f"{peer} batch {b:3d}: {rate:8.1f} generated tokens/s", file=sys.stderr)
        runner.close()
    figures = [Figure(f"gen b{r['batch']}", r["system"], [r["gen_tokens_per_s"]]) for r in rows]
    print_report(lines, systems, figures)
    out = Path(args.out).expanduser()  # (its folder made, the files tried, by check_args)
    table = ["system,batch,gen_tokens_per_s",
             *(f"{r['system']},{r['batch']},{r['gen_tokens_per_s']:.2f}" for r in rows),
             *(f"roofline,{b},{c:.2f}" for b, c in zip(sizes, ceiling["tokens_per_s"]))]
    write_output(out.with_suffix(".csv"), "\n".join(table) + "\n", "--out")
    payload = {"header": lines, "systems": [asdict(s) for s in systems], "rows": rows, "roofline": ceiling}
    write_json(str(out.with_suffix(".json")), payload, "--out")
    write_json(args.json, payload)
    try:
        _plot(out.with_suffix(".png"), rows, sizes, ceiling, model_name, lines[0])
    except OSError as exc:
        raise MinervaError(f"--out '{out.with_suffix('.png')}' cannot be written ({exc.strerror or exc}); the "
                           f"figures are in {out.with_suffix('.csv')}") from None
    print(f"wrote {out.with_suffix('.csv')}, {out.with_suffix('.png')}")
    return 0


def _sweep_ceiling(llm, args, sizes) -> dict:
    hw = probe(seconds=2.0)
    cfg = llm.engine.config
    costs = model_costs(llm.loaded, cfg.kv_cache_dtype_k, cfg.kv_cache_dtype_v, dtype=llm.dtype)
    context = args.input_len + args.output_len // 2
    ceilings = [decode_ceiling(costs, hw, b, context, dtype=args.dtype) for b in sizes]
    return {"hardware": asdict(hw), "context": context,
            "tokens_per_s": [c.tokens_per_second for c in ceilings]}


def _plot(path: Path, rows, sizes, ceiling, model_name: str, machine_line: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for system in dict.fromkeys(r["system"] for r in rows):
        pts = [(r["batch"], r["gen_tokens_per_s"]) for r in rows if r["system"] == system]
        ax.plot(*zip(*pts), marker="o", label=system)
    ax.plot(sizes, ceiling["tokens_per_s"], linestyle="--", color="gray",
            label=f"roofline ({ceiling['hardware']['name']})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("concurrent sequences (batch size)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{model_name}: decode throughput vs batch size", fontsize=10)
    ax.text(0.01, 0.01, machine_line.removeprefix("machine: "), transform=ax.transAxes, fontsize=7,
            color="gray")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_parser(bsub) -> None:
    q = bsub.add_parser("sweep", help="generation tokens/s for batch sizes 1..64, with the roofline")
    add_common_options(q)
    q.add_argument("--batch-sizes", type=ints, default=[1, 2, 4, 8, 16, 32, 64])
    q.add_argument("--input-len", type=int, default=128)
    q.add_argument("--output-len", type=int, default=128)
    q.add_argument("--out", default="docs/bench-sweep", help="path stem for .csv, .json and .png")
    q.set_defaults(func=cmd_sweep, max_batch=64)
