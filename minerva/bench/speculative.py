"""`minerva bench speculative`: generation with and without speculative decoding, one run.

The task is input-grounded, where speculation pays: the model is asked to rewrite a given
text (about 500 tokens; `--text` to use another), greedily. One engine serves both sides
(requests opt out with `speculative_tokens=0`), alternating repetitions, so both share the
loaded model and the machine's state. With `--batch N` N copies run together, which shows
speculation standing down for large batches. Reports tokens/s both ways, the ratio, the
acceptance rate, tokens per verifying step and the accepted-length histogram, and checks
that the greedy outputs are identical.
"""

from __future__ import annotations

import statistics
import time
from importlib import resources
from pathlib import Path

from minerva.bench.args import add_common_options
from minerva.bench.measure import load_minerva
from minerva.bench.report import header, threads_used, write_json
from minerva.engine.sampler import SamplingParams
from minerva.errors import MinervaError
from minerva.options import add_speculative_options, speculative_options

TASK = "Rewrite the following text with the same words, fixing only typos if there are any:\n\n{text}"


def default_text() -> str:
    return resources.files("minerva").joinpath("data/prose.txt").read_text()


def _run(llm, prompt: str, params, batch: int) -> tuple[float, list[list[int]]]:
    """Generation tokens/s (after each request's first token) and the outputs."""
    start = time.perf_counter()
    outs = llm.generate([prompt] * batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, [o.outputs[0].token_ids for o in outs]


def cmd_speculative(args) -> int:
    if not args.speculative:
        raise MinervaError("bench speculative needs --speculative ngram|self[:LAYERS]|draft:MODEL")
    resolved = speculative_options(args)  # the defaults of what was not given, for the report
    args.num_speculative_tokens, args.speculative_max_batch = (resolved["num_speculative_tokens"],
                                                               resolved["speculative_max_batch"])
    for name in ("repetitions", "gen", "batch", "text_tokens"):
        if getattr(args, name) < 1:
            raise MinervaError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    try:
        text = Path(args.text).read_text() if args.text else default_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise MinervaError(f"cannot read --text '{args.text}' ({exc.__class__.__name__}); give a UTF-8 text file") from None
    if not text.split():
        raise MinervaError(f"--text '{args.text}' has no words to rewrite")
    llm, info = load_minerva(args)
    spec = llm.engine.speculator
    words = text.split()
    ids = llm.tokenizer.encode(" ".join(words))
    while len(ids) > args.text_tokens and words:  # trim the text to about --text-tokens tokens
        words = words[:int(len(words) * args.text_tokens / len(ids))]
        ids = llm.tokenizer.encode(" ".join(words))
    prompt = llm.apply_chat_template([{"role": "user", "content": TASK.format(text=" ".join(words))}])
    off = SamplingParams(max_tokens=args.gen, temperature=0, speculative_tokens=0)
    on = SamplingParams(max_tokens=args.gen, temperature=0)
    _run(llm, prompt, SamplingParams(max_tokens=4, temperature=0), 1)  # warm-up, caches the prompt
    rates = {"off": [], "on": []}
    outputs = {}
    for _ in range(args.repetitions):
        for side, params in (("off", off), ("on", on)):
            before = (spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens, spec.stats.num_steps)
            rate, outputs[side] = _run(llm, prompt, params, args.batch)
            rates[side].append(rate)
            if side == "off":
                assert (spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens,
                        spec.stats.num_steps) == before, "requests that opted out were given guesses"
    s = spec.stats
    same = outputs["off"] == outputs["on"]
    lines = header(llm.path, threads_used(args))
    lines.append(f"task:    rewrite a given text of {len(ids)} tokens, greedy, {args.gen} new tokens, "
                 f"batch {args.batch}, {args.repetitions} repetitions alternating off/on")
    lines.append(f"speculative: {args.speculative}, {args.num_speculative_tokens} tokens a step, stands down "
                 f"above {args.speculative_max_batch} running requests")
    for line in lines:
        print(line)
    print(f"{info.system:>12}: loaded in {info.load_seconds:.2f} s, resident {info.rss_mb:.0f} MB {info.detail}")
    med_off, med_on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print()
    print(f"{'speculation off':<22}{med_off:9.1f} tok/s (median; runs {', '.join(f'{r:.1f}' for r in rates['off'])})")
    print(f"{'speculation on':<22}{med_on:9.1f} tok/s (median; runs {', '.join(f'{r:.1f}' for r in rates['on'])})")
    print(f"{'speedup':<22}{med_on / med_off:9.2f}x")
    print(f"{'acceptance rate':<22}{100 * s.acceptance_rate:8.1f}%  ({s.num_accepted_tokens} of "
          f"{s.num_draft_tokens} guesses)")
    print(f"{'tokens per step':<22}{s.mean_accepted_length:9.2f}   (verifying steps: {s.num_steps})")
    print(f"{'accepted guesses':<22}" + "  ".join(f"{i}: {n}" for i, n in enumerate(s.accepted_length)))
    costs = sorted(spec.costs.seconds.items())
    if costs:
        one = spec.costs.seconds.get(1)
        print(f"{'step cost by rows':<22}" + "  ".join(
            f"{rows}: {seconds * 1e3:.1f} ms" + (f" ({seconds / one:.2f}x)" if one and rows > 1 else "")
            for rows, seconds in costs) + "   (a step's rows: one per request and its guesses)")
    print(f"{'outputs identical':<22}{'yes' if same else 'NO'}")
    write_json(args.json, {
        "header": lines, "speculative": args.speculative, "k": args.num_speculative_tokens,
        "batch": args.batch, "text_tokens": len(ids), "gen": args.gen,
        "tokens_per_second": rates, "median_off": med_off, "median_on": med_on, "speedup": med_on / med_off,
        "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
        "accepted_length_histogram": s.accepted_length, "outputs_identical": same,
        "step_seconds_by_rows": {str(rows): seconds for rows, seconds in costs},
    })
    return 0 if same else 1


def add_parser(bsub) -> None:
    q = bsub.add_parser("speculative", help="generation with and without speculative decoding, side by side")
    add_common_options(q)
    add_speculative_options(q)
    q.add_argument("-n", "--gen", type=int, default=256, help="tokens to generate (default 256)")
    q.add_argument("-r", "--repetitions", type=int, default=3)
    q.add_argument("--batch", type=int, default=1, help="copies of the request run together (default 1)")
    q.add_argument("--text", default=None, help="text file to rewrite (default: a built-in passage)")
    q.add_argument("--text-tokens", type=int, default=500, help="trim the text to about this many tokens")
    q.set_defaults(func=cmd_speculative)
