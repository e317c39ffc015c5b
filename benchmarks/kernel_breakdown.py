"""Where a batched run's time goes: every native kernel call timed, on the Python layer path.

    python benchmarks/kernel_breakdown.py --requests 32 --input-len 128 --output-len 128 --dtype bfloat16
    python benchmarks/kernel_breakdown.py --model FILE --requests 1 --input-len 16 --output-len 64 --per-token

With --per-token (batch-1 decode) each line is milliseconds per generated token, and the
int8 matmuls are split by the matrix they multiply: the LM head (as many rows as the
vocabulary) apart from the layers' matrices.

The C++ decoder layer is switched off so each kernel is called (and timed) from Python;
it runs the same kernels, so the split is the native layer's too, plus the Python between
them. Prompts are random token ids; EOS is ignored.
"""

from __future__ import annotations

import argparse
import collections
import random
import time

from minerva import LLM, SamplingParams
from minerva.kernels import dispatch
from minerva.kernels.weights import PackedWeight


class Timed:
    """The native module with every call timed."""

    def __init__(self, module):
        self.module, self.seconds, self.calls = module, collections.Counter(), collections.Counter()

    head_rows = None  # with it, a qmatmul_q8 of that many rows counts as the head

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                key = name
                if name == "qmatmul_q8" and self.head_rows is not None and len(args) > 3 and args[3] == self.head_rows:
                    key = "qmatmul_q8 (head)"
                self.seconds[key] += time.perf_counter() - start
                self.calls[key] += 1
        return timed


class TimedExperts:
    """A mixture-of-experts layer's native expert loop (`MoE.fused`), its calls timed apart."""

    def __init__(self, fused, timed: Timed):
        self.fused, self.timed = fused, timed

    def forward(self, *args):
        start = time.perf_counter()
        try:
            return self.fused.forward(*args)
        finally:
            self.timed.seconds["experts (native loop)"] += time.perf_counter() - start
            self.timed.calls["experts (native loop)"] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--activations", default="auto", choices=["auto", "float", "int8"])
    ap.add_argument("--per-token", action="store_true",
                    help="milliseconds per generated token, the LM head apart (for batch-1 decode)")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, activations=args.activations)
    cpu = dispatch.backend("cpu")
    if cpu.module is None:
        raise SystemExit(f"native kernels unavailable: {cpu.unavailable_reason}")
    timed = cpu.module = Timed(cpu.module)  # ops and attention ask the backend at each call
    if args.per_token:
        timed.head_rows = llm.config.vocab_size
    model = llm.engine.model
    model.stack = model.head = model.step_args = None  # the layers one call at a time (see CausalLM.stack_layers) ...
    for layer in llm.engine.model.layers:
        layer.fused = None  # ... each kernel one call at a time
    for m in llm.engine.model.modules():
        if isinstance(getattr(m, "weight", None), PackedWeight) and m.weight.kernel is not None:
            m.weight.kernel = timed
        if hasattr(m, "experts") and getattr(m, "fused", None) is not None:
            m.fused = TimedExperts(m.fused, timed)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.input_len)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    warm = [[rng.randrange(100, 30000) for _ in range(args.input_len)] for _ in range(2)]
    # warm-up, other prompts: no cache hits
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    timed.seconds.clear()
    timed.calls.clear()
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in out)
    print(f"{args.requests} requests x ({args.input_len} in, {args.output_len} out), {args.dtype}: "
          f"{total:.2f} s, {tokens / total:.1f} output tokens/s")
    scale, unit = (1e3 / tokens, "ms/token") if args.per_token else (1.0, "s")
    for name, secs in timed.seconds.most_common():
        print(f"  {name:20s} {secs * scale:8.2f} {unit}  {100 * secs / total:5.1f}%  ({timed.calls[name]} calls)")
    rest = total - sum(timed.seconds.values())
    print(f"  {'rest (Python)':20s} {rest * scale:8.2f} {unit}  {100 * rest / total:5.1f}%")


if __name__ == "__main__":
    main()
