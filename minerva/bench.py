"""`minerva bench`: latency (llama-bench style), offline throughput, a batch-size sweep, and
`serve` (a load client for OpenAI-compatible servers, in minerva/serve/bench.py).

Each sub-command measures Minerva through its public engine API and, with
`--compare llama.cpp` or `--compare transformers`, the peer on the same model file
in the same process and run, then prints each figure side by side with the ratio.
Every report names the machine, the model, the command line, peak resident memory
and load time. Figures are the mean ± standard deviation over `-r` repetitions
(latency) or one timed run after a warm-up (throughput, sweep).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minerva.errors import MinervaError
from minerva.hardware import peak_rss_mb, rss_mb

PEERS = ("llama.cpp", "transformers")


# ----------------------------------------------------------------- reporting


@dataclass
class Figure:
    """One measured rate: tokens/s over repetitions."""

    name: str  # e.g. "pp512", "tg128", "tg128@d512", "gen b32"
    system: str  # "minerva" or a peer
    samples: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0

    def text(self) -> str:
        return f"{self.mean:9.1f} ± {self.std:6.1f}" if self.samples else "      n/a"


@dataclass
class SystemInfo:
    system: str
    load_seconds: float
    rss_mb: float  # resident memory of the loaded system (peak for minerva; growth for a peer)
    detail: str = ""


def header(model_path: Path, threads: int) -> list[str]:
    from minerva.hardware import machine

    return [f"machine: {machine().describe()}; {threads} threads",
            f"model:   {model_path}",
            f"command: {' '.join(['minerva', *sys.argv[1:]])}"]


def print_report(lines: list[str], systems: list[SystemInfo], figures: list[Figure]) -> None:
    for line in lines:
        print(line)
    for s in systems:
        print(f"{s.system:>12}: loaded in {s.load_seconds:.2f} s, resident {s.rss_mb:.0f} MB {s.detail}")
    names = list(dict.fromkeys(f.name for f in figures))
    peers = [s.system for s in systems if s.system != "minerva"]
    cols = ["minerva", *peers]
    print()
    print(f"{'test':<16}" + "".join(f"{c + ' tok/s':>22}" for c in cols)
          + "".join(f"{'vs ' + p:>17}" for p in peers))
    for name in names:
        row = {f.system: f for f in figures if f.name == name}
        cells = "".join(f"{row[c].text() if c in row else '      n/a':>22}" for c in cols)
        ratios = ""
        for p in peers:
            if p in row and "minerva" in row and row[p].mean > 0:
                ratios += f"{row['minerva'].mean / row[p].mean:>16.2f}x"
            else:
                ratios += f"{'':>17}"
        print(f"{name:<16}{cells}{ratios}")


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")


# ----------------------------------------------------------------- minerva


def load_minerva(args):
    from minerva.llm import LLM

    start_rss = rss_mb()
    # Prompts are random, so the prefix cache only ever hits where a test puts context
    # first on purpose (pp at a depth).
    llm = LLM(args.model, dtype=args.dtype, threads=args.threads, quantize=args.quantize,
              kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=max(64, getattr(args, "max_batch", 0)),
              max_num_batched_tokens=args.max_num_batched_tokens, **_speculative(args))
    args.dtype = llm.dtype_name  # what auto resolved to, for the report and the roofline
    info = SystemInfo("minerva", llm.loaded.load_seconds, peak_rss_mb(),
                      f"(peak; {rss_mb() - start_rss:.0f} MB for the model and KV pool, "
                      f"dtype {args.dtype})")
    return llm, info


def _speculative(args) -> dict:
    if getattr(args, "speculative", None) is None:
        return {}
    from minerva.cli import speculative_options

    return speculative_options(args)


def random_prompt(rng: random.Random, llm, length: int) -> list[int]:
    special = {llm.tokenizer.bos_token_id, *llm.tokenizer.eos_token_ids}
    vocab = min(llm.config.vocab_size, 32000)
    out = []
    while len(out) < length:
        t = rng.randrange(vocab)
        if t not in special:
            out.append(t)
    return out


def minerva_prefill(llm, prompt: list[int], depth: int = 0) -> float:
    """Tokens/s of computing `prompt` after its first `depth` tokens are already in the KV
    cache (they are computed first, untimed, and found by the prefix cache)."""
    from minerva.engine.sampler import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    cached = depth - depth % llm.engine.blocks.block_size  # only full blocks are shared
    if depth:
        llm.generate([prompt[:depth]], one)
    start = time.perf_counter()
    llm.generate([prompt], one)
    return (len(prompt) - cached) / (time.perf_counter() - start)


def minerva_decode(llm, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """Generate n tokens for each prompt together. Returns (decode tokens/s, seconds in all):
    the decode rate counts the tokens produced after every request has its first token,
    over the time from that moment to the last token."""
    from minerva.engine.sampler import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    firsts: set[int] = set()
    t_all_first, after, t_last = None, 0, start
    for i, _, delta in llm.stream_many(prompts, params):
        now = time.perf_counter()
        if i not in firsts and delta.token_ids:
            firsts.add(i)
            after += len(delta.token_ids) - 1
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


# ---------------------------------------------------------------- commands


def cmd_latency(args) -> int:
    from minerva import peers

    rng = random.Random(args.seed)
    llm, info = load_minerva(args)
    systems, figures = [info], []
    depths = args.depth or [0]

    def prompts(length: int) -> list[list[int]]:
        return [random_prompt(rng, llm, max(length, 1)) for _ in range(args.repetitions)]

    plan = []  # (name, kind, depth, prompts, n): pp prompts hold depth + n tokens
    for d in depths:
        suffix = f"@d{d}" if d else ""
        plan += [(f"pp{p}{suffix}", "pp", d, prompts(d + p), p) for p in args.prompt if p]
        plan += [(f"tg{n}{suffix}", "tg", d, prompts(d), n) for n in args.gen if n]

    minerva_prefill(llm, prompts(64)[0])  # warm-up
    for name, kind, depth, ps, n in plan:
        fig = Figure(name, "minerva")
        for prompt in ps:
            if kind == "pp":
                fig.samples.append(minerva_prefill(llm, prompt, depth))
            else:  # n + 1 tokens: the first comes from the prompt's forward, then n decode steps
                fig.samples.append(minerva_decode(llm, [prompt], n + 1)[0])
        figures.append(fig)
    lines = header(llm.path, args.threads or _threads())
    model_path = llm.path
    llm = None  # free the model before loading a peer
    for peer in args.compare:
        runner = peers.load(peer, model_path, args.threads or _threads(), n_ctx=_ctx_needed(plan))
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
    write_json(args.json, {"header": lines, "systems": [asdict(s) for s in systems],
                           "figures": [{**asdict(f), "mean": f.mean, "std": f.std} for f in figures]})
    return 0


def _ctx_needed(plan) -> int:
    return max(len(p) + n + 8 for _, _, _, ps, n in plan for p in ps)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def cmd_throughput(args) -> int:
    from minerva import peers
    from minerva.engine.sampler import SamplingParams

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
    lines = header(llm.path, args.threads or _threads())
    figures = [Figure("output", "minerva", [out_tokens / secs]),
               Figure("total", "minerva", [(in_tokens + out_tokens) / secs])]
    systems = [info]
    model_path = llm.path
    summary = {"minerva": {"seconds": secs, "input_tokens": in_tokens, "output_tokens": out_tokens,
                           "preemptions": llm.engine.scheduler.num_preemptions}}
    del llm, results
    for peer in args.compare:
        n_seq = min(args.num_prompts, args.max_batch)  # llama.cpp splits n_ctx among sequences
        runner = peers.load(peer, model_path, args.threads or _threads(),
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


def cmd_sweep(args) -> int:
    from minerva import peers

    rng = random.Random(args.seed)
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
    lines = header(llm.path, args.threads or _threads())
    model_path, model_name = llm.path, llm.path.name
    systems = [info]
    del llm
    for peer in args.compare:
        runner = peers.load(peer, model_path, args.threads or _threads(),
                            n_ctx=(args.input_len + args.output_len + 8) * max(sizes), n_seq=max(sizes))
        systems.append(runner.info)
        for b in sizes:
            rate = runner.decode_batch(workload[b], args.output_len)
            rows.append({"batch": b, "system": peer, "gen_tokens_per_s": rate})
            print(f"{peer} batch {b:3d}: {rate:8.1f} generated tokens/s", file=sys.stderr)
        runner.close()
    figures = [Figure(f"gen b{r['batch']}", r["system"], [r["gen_tokens_per_s"]]) for r in rows]
    print_report(lines, systems, figures)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w") as f:
        f.write("system,batch,gen_tokens_per_s\n")
        for r in rows:
            f.write(f"{r['system']},{r['batch']},{r['gen_tokens_per_s']:.2f}\n")
        for b, c in zip(sizes, ceiling["tokens_per_s"]):
            f.write(f"roofline,{b},{c:.2f}\n")
    write_json(str(out.with_suffix(".json")), {"header": lines, "systems": [asdict(s) for s in systems],
                                               "rows": rows, "roofline": ceiling})
    _plot(out.with_suffix(".png"), rows, sizes, ceiling, model_name, lines[0])
    print(f"wrote {out.with_suffix('.csv')}, {out.with_suffix('.png')}")
    return 0


def _sweep_ceiling(llm, args, sizes) -> dict:
    from minerva.hardware import probe
    from minerva.roofline import decode_ceiling, model_costs

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


# ------------------------------------------------------------------ parser


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def _range(text: str) -> tuple[int, int]:
    vals = _ints(text.replace(":", ","))
    if len(vals) == 1:
        vals = vals * 2
    if len(vals) != 2 or not 1 <= vals[0] <= vals[1]:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX with 1 <= MIN <= MAX, got '{text}'")
    return vals[0], vals[1]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure speed (latency, throughput, sweep), optionally against a peer")
    bsub = p.add_subparsers(dest="bench_command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help="pulled name, .gguf file or Hugging Face directory (default smollm2-135m)")
        q.add_argument("--compare", action="append", default=[], choices=PEERS,
                       help="also run this peer on the same model file (repeatable)")
        q.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
        q.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="activation dtype (default auto: bfloat16 where the CPU has AVX-512 BF16)")
        q.add_argument("--quantize", default=None, choices=["int8", "int4"],
                       help="quantize a SafeTensors model at load (group-wise, weight-only)")
        q.add_argument("--kv-cache-memory", type=float, default=0.2)
        q.add_argument("--max-num-batched-tokens", type=int, default=2048)
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--json", default=None, help="also write the results to this JSON file")

    q = bsub.add_parser("latency", help="llama-bench style: prompt processing (pp) and generation (tg)")
    common(q)
    q.add_argument("-p", "--prompt", type=_ints, default=[512], help="prompt lengths (comma-separated)")
    q.add_argument("-n", "--gen", type=_ints, default=[128], help="generation lengths (comma-separated)")
    q.add_argument("-r", "--repetitions", type=int, default=5)
    q.add_argument("-d", "--depth", type=_ints, default=[0], help="KV depth (tokens already in context)")
    q.set_defaults(func=cmd_latency)

    q = bsub.add_parser("throughput", help="offline: N requests of random lengths through the engine")
    common(q)
    q.add_argument("--num-prompts", type=int, default=64)
    q.add_argument("--input-len", type=_range, default=(100, 1024), help="N or MIN:MAX")
    q.add_argument("--output-len", type=_range, default=(100, 512), help="N or MIN:MAX")
    q.add_argument("--max-batch", type=int, default=64, help="peer's parallel sequences")
    q.set_defaults(func=cmd_throughput)

    q = bsub.add_parser("sweep", help="generation tokens/s for batch sizes 1..64, with the roofline")
    common(q)
    q.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16, 32, 64])
    q.add_argument("--input-len", type=int, default=128)
    q.add_argument("--output-len", type=int, default=128)
    q.add_argument("--out", default="docs/bench-sweep", help="path stem for .csv, .json and .png")
    q.set_defaults(func=cmd_sweep, max_batch=64)

    from minerva.bench_spec import add_parser as add_speculative
    from minerva.serve.bench import add_parser as add_serve

    add_speculative(bsub, common)
    add_serve(bsub)


def check_args(args) -> None:
    for name in ("repetitions", "num_prompts", "threads", "output_len", "input_len"):
        v = getattr(args, name, None)
        if isinstance(v, int) and v < 1:
            raise MinervaError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    if getattr(args, "batch_sizes", None) is not None and (not args.batch_sizes or min(args.batch_sizes) < 1):
        raise MinervaError("--batch-sizes must be positive integers")
