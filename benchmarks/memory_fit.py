"""Minerva's memory estimate against the peak resident memory it measures.

For each model, in a process of its own: load it with a KV pool of one request's context
(`--max-num-seqs 1`, `--max-model-len` = the prompt + 16 tokens), run a prompt that fills
the pool in steps of `--max-num-batched-tokens` (the largest step there is), and compare the
process's peak resident memory (VmHWM) with `LLM.memory.peak`, the estimate made from the
file's header (`minerva.models.fit`) and the pool it sized.

    python benchmarks/memory_fit.py                     # the two pulled models
    python benchmarks/memory_fit.py --synthetic         # and the synthetic shapes (benchmarks/matrix.py)
    python benchmarks/memory_fit.py FILE ... --prompt 1000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys
from minerva import LLM, SamplingParams
model, prompt = sys.argv[1], int(sys.argv[2])
llm = LLM(model, max_model_len=prompt + 16, max_num_seqs=1, kv_cache_memory=0.9)
ids = [100 + (i * 7919) % (llm.config.vocab_size - 200) for i in range(prompt)]
llm.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
e = llm.memory
print(json.dumps({"estimate": e.peak, "measured": peak, "weights": e.weights, "kv": e.kv,
                  "vocab": e.vocab, "step": e.step, "load": e.load, "base": e.base}))
"""


def measure(model: str, prompt: int) -> dict:
    """The estimate and the measured peak of one model, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(prompt)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{model}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m"])
    p.add_argument("--synthetic", action="store_true", help="also the synthetic files of benchmarks/matrix.py")
    p.add_argument("--prompt", type=int, default=2000, help="prompt tokens (default 2000)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    models = list(args.models)
    if args.synthetic:
        import matrix
        models += [str(matrix.make(spec)) for spec in matrix.FILES]
    rows = []
    print(f"{'model':40} {'estimate MB':>12} {'measured MB':>12} {'ratio':>6}   weights / KV / vocabulary MB")
    for model in models:
        r = measure(model, args.prompt)
        r["model"] = os.path.basename(model)
        rows.append(r)
        print(f"{r['model']:40} {r['estimate'] / 1e6:12,.0f} {r['measured'] / 1e6:12,.0f} "
              f"{r['estimate'] / r['measured']:6.3f}   {r['weights'] / 1e6:,.0f} / {r['kv'] / 1e6:,.0f} / "
              f"{r['vocab'] / 1e6:,.0f}", flush=True)
    worst = max(abs(r["estimate"] / r["measured"] - 1) for r in rows)
    print(f"largest difference: {worst:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
