"""Tensor parallelism against one process, on one model file, interleaved.

    python benchmarks/tensor_parallel.py FILE [--size 2] [--rounds 3] [--prompt 32] [--gen 64]

Each round runs, in fresh processes and in alternating order, the one-process engine with
all the cores and the N-rank one with 1/N of them each: batch-1 greedy decode of --gen
tokens after a --prompt-token prompt. It prints per run the decode tokens/s, the time spent
in all-reduces per decode step (and how many), and every rank's peak resident memory;
then the median ratio N ranks / one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

RUN = r"""
import json, sys, time, torch
from minerva import LLM
from minerva.engine.sampler import SamplingParams

path, size, prompt_len, gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(path, tensor_parallel_size=size, kv_cache_memory=256 << 20)


def status(key, pid="self"):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


pids = ["self"] + [p.pid for p in (llm.group.workers if llm.group else [])]
loaded_rss = [status("VmRSS", p) for p in pids]
prompt = llm.tokenizer.encode("The history of the city " * 64)[:prompt_len]
params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),  # warm-up
             use_tqdm=False)
comm = llm.engine.runner.comm
first = None
calls0, secs0 = (comm.calls, comm.seconds) if comm else (0, 0.0)
start = time.perf_counter()
for _, _, delta in llm.stream_many([prompt], params):
    if first is None:
        first = time.perf_counter()
        calls0, secs0 = (comm.calls, comm.seconds) if comm else (0, 0.0)
end = time.perf_counter()
decode_steps = gen - 1

out = {"tok_s": decode_steps / (end - first), "threads": torch.get_num_threads(),
       "peak_rss": [status("VmHWM", p) for p in pids], "loaded_rss": loaded_rss}
if comm:
    out["all_reduce_ms_per_step"] = 1e3 * (comm.seconds - secs0) / decode_steps
    out["all_reduces_per_step"] = (comm.calls - calls0) / decode_steps
    out["exchange"] = comm.name
llm.close()
print("RESULT " + json.dumps(out))
"""


def run(path: str, size: int, prompt: int, gen: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", RUN, path, str(size), str(prompt), str(gen)],
                          capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"run with --tensor-parallel-size {size} failed:\n{proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    p.add_argument("--size", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--gen", type=int, default=64)
    args = p.parse_args()
    ratios = []
    for r in range(args.rounds):
        order = (1, args.size) if r % 2 == 0 else (args.size, 1)
        got = {n: run(args.file, n, args.prompt, args.gen) for n in order}
        one, tp = got[1], got[args.size]
        ratios.append(tp["tok_s"] / one["tok_s"])
        mb = lambda xs: "/".join(f"{x / 1e6:.0f}" for x in xs)  # noqa: E731
        print(f"round {r + 1}: 1 process ({one['threads']} threads) {one['tok_s']:.2f} tok/s, RSS after load "
              f"{mb(one['loaded_rss'])} MB, peak {mb(one['peak_rss'])} MB; "
              f"{args.size} ranks ({tp['threads']} thread(s) each, {tp['exchange']}) {tp['tok_s']:.2f} tok/s, "
              f"all-reduce {tp['all_reduce_ms_per_step']:.2f} ms/step ({tp['all_reduces_per_step']:.0f} calls), "
              f"RSS per rank after load {mb(tp['loaded_rss'])} MB, peak {mb(tp['peak_rss'])} MB; "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print(f"median ratio ({args.size} ranks / 1 process) over {args.rounds} rounds: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
