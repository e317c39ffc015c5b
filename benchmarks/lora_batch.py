"""LoRA adapters in one batch: the throughput of 16 requests spread over 4 adapters of a
model, against the same 16 requests on the base model alone.

    python benchmarks/lora_batch.py [--model smollm2-135m] [--adapters 4] [--rank 16] [--rounds 5]

The adapters are written in PEFT's format (adapter_config.json, adapter_model.safetensors)
with random A and B of rank `--rank` on every attention and MLP projection (q, k, v, o,
gate, up, down: PEFT's `all-linear`). Each round runs the base model and the adapted one,
each in its own process, in turn: 16 prompts of about 60 tokens, 128 tokens out each
(ignore_eos, greedy), one `generate` call after a warm-up call. Prints each run's output
tokens per second, the medians, and the median of the rounds' ratios (adapters / base).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. The story "
          "should be set on a rocky island in the north, in winter, and end with a surprise. Story {i}:")

RUN = r"""
import json, sys, time
from minerva import LLM, SamplingParams
model, folder, n, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
names = [f"a{i}" for i in range(n)]
llm = LLM(model, lora={a: f"{folder}/{a}" for a in names} if folder else None)
prompts = [PROMPT.format(i=i) for i in range(16)]
params = [SamplingParams(max_tokens=128, temperature=0, ignore_eos=True,
                         adapter=names[i % n] if folder else None) for i in range(16)]
llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"tps": tokens / (time.perf_counter() - t), "tokens": tokens}))
"""


def write_adapters(model: str, folder: Path, n: int, rank: int) -> None:
    """n PEFT LoRA adapters of `rank` for `model`'s shapes (read from its header)."""
    from minerva.models.loader import read_config
    from minerva.store import resolve
    c = read_config(resolve(model))
    kv = c.num_kv_heads * c.head_dim
    shapes = {"q_proj": (c.num_heads * c.head_dim, c.hidden_size), "k_proj": (kv, c.hidden_size),
              "v_proj": (kv, c.hidden_size), "o_proj": (c.hidden_size, c.num_heads * c.head_dim),
              "gate_proj": (c.intermediate_size, c.hidden_size), "up_proj": (c.intermediate_size, c.hidden_size),
              "down_proj": (c.hidden_size, c.intermediate_size)}
    for a in range(n):
        g = torch.Generator().manual_seed(a)
        tensors = {}
        for layer in range(c.num_layers):
            for block, names in PROJECTIONS.items():
                for name in names:
                    out, inp = shapes[name]
                    key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                    tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
                    tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
        d = folder / f"a{a}"
        d.mkdir(parents=True)
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
            "target_modules": [p for names in PROJECTIONS.values() for p in names], "task_type": "CAUSAL_LM"}))


def run(model: str, folder: str, n: int) -> float:
    code = f"PROMPT = {PROMPT!r}\n" + RUN
    out = subprocess.run([sys.executable, "-c", code, model, folder, str(n), "1"], capture_output=True, text=True,
                         timeout=1200)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])["tps"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_adapters(args.model, Path(tmp), args.adapters, args.rank)
        base, lora = [], []
        for r in range(args.rounds):
            base.append(run(args.model, "", args.adapters))
            lora.append(run(args.model, tmp, args.adapters))
            print(f"round {r + 1}: base {base[-1]:.1f} tokens/s, {args.adapters} adapters {lora[-1]:.1f} "
                  f"tokens/s ({lora[-1] / base[-1]:.2f}x)", flush=True)
    ratios = [b / a for a, b in zip(base, lora)]
    print(f"{time.strftime('%Y-%m-%d')} {args.model}, 16 requests x 128 tokens, {args.adapters} adapters of "
          f"rank {args.rank}: base {statistics.median(base):.1f} tokens/s, adapters "
          f"{statistics.median(lora):.1f} tokens/s, median ratio {statistics.median(ratios):.2f}x "
          f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
