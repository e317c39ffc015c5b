"""`minerva roofline`: the fastest a model can run on given hardware, and how close Minerva gets.

A forward pass must read every matmul weight once and each sequence's K/V, and must
do 2 FLOPs per weight per token plus the attention products. Dividing those bytes by
the memory bandwidth and those FLOPs by the compute peak gives two lower bounds on
the time of a step; the larger one is the ceiling (the "roofline"). Decode at batch 1
is nearly always memory bound, large batches and prefill become compute bound.

The costs come from the loaded model itself (the bytes its weights really take,
packed or dense), the hardware from `minerva.bench.hardware` (measured here, or datasheet
figures for other hardware), and `--measure` runs the engine to put real tokens/s
next to each ceiling.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
from dataclasses import dataclass

import torch

from minerva.bench.hardware import PRESETS, Hardware, hardware_from_args, probe
from minerva.bench.measure import minerva_decode, minerva_prefill, random_prompt
from minerva.errors import MinervaError
from minerva.kernels.attention import PagedKVCache
from minerva.kernels import tune
from minerva.kernels.kv_quant import KV_FORMATS
from minerva.kernels.weights import PackedWeight
from minerva.options import ACTIVATIONS_HELP, add_no_tune
from minerva.llm import LLM, resolve_dtype
from minerva.machine import machine, peak_rss_mb
from minerva.models.config import SLIDING
from minerva.models.layers import Linear, MoE
from minerva.models.loader import LoadedModel

DTYPES = ("float32", "bfloat16")
DEFAULT_CONTEXTS = (128, 512, 2048, 8192)
# The decode runs of --measure: a short random prompt, then this many new tokens.
DECODE_PROMPT_TOKENS = 16
DECODE_TOKENS_BATCH_1 = 128
DECODE_TOKENS_BATCH_N = 64


# ----------------------------------------------------------------------- costs

@dataclass(frozen=True)
class ModelCosts:
    """What one token costs a model: bytes to read and FLOPs to do."""

    weight_bytes_per_token: int  # every matmul weight, as held for compute, read once per pass
    matmul_params: int  # weights of all matmuls (rows * cols), lm_head included
    kv_bytes_per_token: int  # K and V (and their scales) of one token of context, all layers
    num_heads: int
    head_dim: int
    windows: tuple[int | None, ...]  # per layer: the sliding window, or None for full attention
    max_context: int
    int8_params: int = 0  # of matmul_params, those whose products take 8-bit activations
    head_params: int = 0  # of matmul_params, the LM head's: a prompt needs its logits for the last token only
    head_int8_params: int = 0  # of head_params, those on 8-bit activations (all or none)
    # Mixture of experts: of the above, what the expert matrices hold, and the share of a
    # layer's experts one token uses (top k / experts).
    expert_bytes: int = 0
    expert_params: int = 0
    expert_int8_params: int = 0
    expert_share: float = 1.0

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes one pass over `tokens` tokens reads: the dense weights, and each
        expert that at least one token picks (expected share under uniform routing)."""
        picked = 1 - (1 - self.expert_share) ** tokens
        return self.weight_bytes_per_token - self.expert_bytes * (1 - picked)

    @property
    def active_params(self) -> float:
        """Matmul weights one token multiplies: all but the experts it does not pick."""
        return self.matmul_params - self.expert_params * (1 - self.expert_share)

    @property
    def active_int8_params(self) -> float:
        return self.int8_params - self.expert_int8_params * (1 - self.expert_share)

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.weight_bytes_per_token / self.matmul_params

    def keys_seen(self, context: int) -> int:
        """Keys one new token attends to, summed over layers, with `context` tokens in its sequence."""
        return sum(context if w is None else min(context, w) for w in self.windows)

    def attention_flops(self, context: int) -> float:
        """Q.K^T and P.V of one new token: 2 + 2 FLOPs per head, dimension and key."""
        return 4 * self.num_heads * self.head_dim * self.keys_seen(context)

    def flops_per_token(self, context: int) -> float:
        return 2 * self.active_params + self.attention_flops(context)

    def kv_bytes_read(self, context: int) -> float:
        """K/V bytes one sequence reads to decode a token at `context` (windows included)."""
        return self.kv_bytes_per_token * self.keys_seen(context) / self.num_layers

    def prefill_flops(self, prompt_len: int) -> float:
        """FLOPs of a whole prompt: token i (1-based) attends to i keys, causally."""
        keys = 0
        for w in self.windows:
            if w is None or w >= prompt_len:
                keys += prompt_len * (prompt_len + 1) // 2
            else:
                keys += w * (w + 1) // 2 + (prompt_len - w) * w
        body = self.active_params - self.head_params
        return 2 * body * prompt_len + 2 * self.head_params + 4 * self.num_heads * self.head_dim * keys

    def prefill_int8_flops(self, prompt_len: int) -> float:
        """Of `prefill_flops`, the matmul FLOPs on 8-bit activations."""
        return 2 * (self.active_int8_params - self.head_int8_params) * prompt_len + 2 * self.head_int8_params


def _compute_dtype(weights: list) -> torch.dtype:
    w = weights[0]
    return w.dtype if isinstance(w, PackedWeight) else w.tensor.dtype


def model_costs(loaded: LoadedModel, kv_cache_dtype_k: str = "auto", kv_cache_dtype_v: str = "auto",
                dtype: torch.dtype | None = None) -> ModelCosts:
    """Per-token costs of a loaded model.

    Every `Linear` weight counts once (fused QKV and gate/up are one weight; a tied lm_head
    is the embedding object and counts once, as the logits read all of it each step); the
    embedding lookup reads one row per token and is left out. Bytes are what the matmul
    reads: the packed bytes where a packed kernel runs, the dequantized copy where one was
    made. KV bytes follow the engine's pool layout for the given formats ("auto" = `dtype`,
    by default the dtype the weights compute in).
    """
    model, config = loaded.model, loaded.config
    weights = list({id(m.weight): m.weight for m in model.modules() if isinstance(m, Linear)}.values())
    if not weights:
        raise MinervaError(f"'{loaded.path}' has no matmul weights to cost")
    kv = PagedKVCache.bytes_per_block(config.num_layers, 1, config.num_kv_heads, config.head_dim,
                                      kv_cache_dtype_k, kv_cache_dtype_v, dtype or _compute_dtype(weights))
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    head_params = head.shape[0] * head.shape[1] if head is not None else 0
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    experts = list({id(lin.weight): lin.weight for m in moes for lin in m.experts.modules()
                    if isinstance(lin, Linear)}.values())
    return ModelCosts(
        weight_bytes_per_token=sum(w.compute_nbytes for w in weights),
        matmul_params=sum(w.shape[0] * w.shape[1] for w in weights),
        kv_bytes_per_token=kv,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        windows=tuple(config.sliding_window if t == SLIDING else None for t in config.layer_types),
        max_context=config.max_position,
        int8_params=sum(w.shape[0] * w.shape[1] for w in weights if isinstance(w, PackedWeight) and w.int8),
        head_params=head_params,
        head_int8_params=head_params if isinstance(head, PackedWeight) and head.int8 else 0,
        expert_bytes=sum(w.compute_nbytes for w in experts),
        expert_params=sum(w.shape[0] * w.shape[1] for w in experts),
        expert_int8_params=sum(w.shape[0] * w.shape[1] for w in experts if isinstance(w, PackedWeight) and w.int8),
        expert_share=moes[0].top_k / len(moes[0].experts) if moes else 1.0,
    )


# -------------------------------------------------------------------- ceilings

@dataclass(frozen=True)
class Ceiling:
    """The best tokens/s of one kind of step, and which resource sets it."""

    tokens_per_second: float
    bound: str  # "memory" or "compute"
    memory_seconds: float  # per step: bytes / bandwidth
    compute_seconds: float  # per step: FLOPs / peak


def _ceiling(tokens: int, step_bytes: float, step_flops: float, hw: Hardware, dtype: str,
             int8_flops: float = 0.0) -> Ceiling:
    """`int8_flops` of the step's `step_flops` run on the int8 peak, the rest on the `dtype` peak."""
    memory = step_bytes / hw.bandwidth
    compute = (step_flops - int8_flops) / hw.peak_flops(dtype) + int8_flops / hw.int8_peak(dtype)
    return Ceiling(tokens / max(memory, compute), "memory" if memory >= compute else "compute",
                   memory, compute)


def decode_ceiling(costs: ModelCosts, hw: Hardware, batch: int, context: int,
                   dtype: str = "float32") -> Ceiling:
    """Tokens/s of all `batch` sequences together, each decoding one token at `context`.

    The weights are read once for the whole batch; each sequence reads its own K/V.
    """
    step_bytes = costs.weight_bytes_read(batch) + batch * costs.kv_bytes_read(context)
    return _ceiling(batch, step_bytes, batch * costs.flops_per_token(context), hw, dtype,
                    batch * 2 * costs.active_int8_params)


@dataclass(frozen=True)
class ParallelDecode:
    """Batch decode split over `world` devices like the probed one (tensor parallelism)."""

    world: int
    tokens_per_second: float
    one_device: float  # tokens/s of the same step on one device
    comm_seconds: float  # per step: the all-reduces, the logits gather and the step broadcast

    @property
    def speedup(self) -> float:
        return self.tokens_per_second / self.one_device


def parallel_decode(costs: ModelCosts, hw: Hardware, hidden: int, vocab: int, batch: int, context: int,
                    world: int, link_bandwidth: float, link_latency: float, dtype: str = "float32") -> ParallelDecode:
    """Each device reads and computes 1/world of the step; per step the ranks all-reduce two
    [batch, hidden] activations per layer and the embedding (ring: 2 (N-1)/N of the bytes and
    2 (N-1) latencies each), gather [batch, vocab / N] float32 logits on rank 0 and receive the
    step's batch (one latency). `link_bandwidth` in bytes/s, `link_latency` in seconds."""
    one = decode_ceiling(costs, hw, batch, context, dtype)
    step = batch / one.tokens_per_second
    act = batch * hidden * (4 if dtype == "float32" else 2)
    n = world
    all_reduce = 2 * (n - 1) / n * act / link_bandwidth + 2 * (n - 1) * link_latency
    gather = (n - 1) / n * batch * vocab * 4 / link_bandwidth + (n - 1) * link_latency
    comm = (2 * costs.num_layers + 1) * all_reduce + gather + link_latency
    return ParallelDecode(world, batch / (step / world + comm), one.tokens_per_second, comm)


def prefill_ceiling(costs: ModelCosts, hw: Hardware, prompt_len: int, dtype: str = "float32",
                    depth: int = 0) -> Ceiling:
    """Prompt tokens/s of one prompt computed in a single pass (weights read once), after
    `depth` tokens of its sequence are already in the KV cache."""
    flops = costs.prefill_flops(depth + prompt_len) - costs.prefill_flops(depth)
    return _ceiling(prompt_len, costs.weight_bytes_read(prompt_len), flops, hw, dtype,
                    costs.prefill_int8_flops(depth + prompt_len) - costs.prefill_int8_flops(depth))


# ------------------------------------------------------------------------- CLI

def _load_average() -> str:
    """Other work on the machine competes with the probe and the engine: say how much there was."""
    try:
        return f"; load average {os.getloadavg()[0]:.2f} over the last minute"
    except (AttributeError, OSError):  # not on Windows
        return ""


def _contexts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got '{text}'") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"context lengths must be >= 1, got '{text}'")
    return values


def _rate(x: float) -> str:
    return f"{x:,.1f} tok/s" if x < 100 else f"{x:,.0f} tok/s"


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
            .rstrip() for r in rows]


@dataclass(frozen=True)
class Row:
    """One line of the report's main table."""

    label: str
    ceiling: Ceiling
    measured: float | None = None  # tokens/s the engine reached

    def cells(self) -> list[str]:
        cells = [self.label, _rate(self.ceiling.tokens_per_second), self.ceiling.bound]
        if self.measured is not None and not math.isfinite(self.measured):  # nothing could be timed
            cells += ["n/a", "n/a"]
        elif self.measured is not None:
            fraction = self.measured / self.ceiling.tokens_per_second
            cells += [_rate(self.measured), f"{100 * fraction:.1f}%"]
        return cells


def ceiling_table(rows: list[Row]) -> list[str]:
    """Each row's ceiling and what bounds it, and where measured the rate and the fraction reached."""
    measured = any(r.measured is not None for r in rows)
    out = _table([["", "ceiling", "bound"] + (["measured", "of ceiling"] if measured else [])]
                 + [r.cells() for r in rows], right={1, 3, 4})
    if any(r.measured and r.measured > r.ceiling.tokens_per_second for r in rows):
        out.append("(above 100%: the engine beat a probed peak; the probe times torch's own kernels, "
                   "which are not always the fastest here, and a busy machine lowers either figure)")
    return out


def _rows(llm: LLM, costs: ModelCosts, hw: Hardware, args: argparse.Namespace) -> list[Row]:
    """Prefill, batch-1 decode and batch-N decode ceilings, with --measure also what the engine
    reaches. Decode ceilings are taken at the mean context of the measured runs."""
    ctx_1 = DECODE_PROMPT_TOKENS + DECODE_TOKENS_BATCH_1 // 2
    ctx_n = DECODE_PROMPT_TOKENS + DECODE_TOKENS_BATCH_N // 2
    prefill = prefill_ceiling(costs, hw, args.prompt, args.dtype)
    decode_1 = decode_ceiling(costs, hw, 1, ctx_1, args.dtype)
    decode_n = decode_ceiling(costs, hw, args.batch, ctx_n, args.dtype)
    measured: list[float | None] = [None, None, None]
    if args.measure:  # the same measurements as `minerva bench`
        print("measuring: warm-up, prefill, batch-1 decode, batch-N decode...", file=sys.stderr)
        rng = random.Random(0)

        def prompts(count: int, length: int) -> list[list[int]]:
            return [random_prompt(rng, llm, length) for _ in range(count)]

        minerva_decode(llm, prompts(1, 8), 4)
        measured = [minerva_prefill(llm, prompts(1, args.prompt)[0]),
                    minerva_decode(llm, prompts(1, DECODE_PROMPT_TOKENS), DECODE_TOKENS_BATCH_1)[0],
                    minerva_decode(llm, prompts(args.batch, DECODE_PROMPT_TOKENS), DECODE_TOKENS_BATCH_N)[0]]
    return [Row(f"prefill, {args.prompt}-token prompt", prefill, measured[0]),
            Row(f"decode, batch 1, context {ctx_1}", decode_1, measured[1]),
            Row(f"decode, batch {args.batch}, context {ctx_n}", decode_n, measured[2])]


def _context_table(costs: ModelCosts, hw: Hardware, args: argparse.Namespace) -> list[str]:
    table = [["context", "KV read per sequence", "batch 1", "bound", f"batch {args.batch}", "bound"]]
    for ctx in sorted({min(c, costs.max_context) for c in args.context}):
        one = decode_ceiling(costs, hw, 1, ctx, args.dtype)
        many = decode_ceiling(costs, hw, args.batch, ctx, args.dtype)
        table.append([str(ctx), f"{costs.kv_bytes_read(ctx) / 1e6:,.1f} MB", _rate(one.tokens_per_second),
                      one.bound, _rate(many.tokens_per_second), many.bound])
    return _table(table, right={0, 1, 2, 4})


def _parallel_table(costs: ModelCosts, hw: Hardware, config, args: argparse.Namespace) -> str:
    n, bw, lat = args.tensor_parallel_size, args.link_bandwidth, args.link_latency
    context = min(args.context[0], costs.max_context)
    lines = [f"tensor parallelism over {n} devices like this one, linked at {bw:g} GB/s with {lat:g} us latency "
             f"(context {context}): {2 * costs.num_layers + 1} all-reduces of batch x {config.hidden_size} "
             f"activations per step, {config.vocab_size}-wide logits gathered"]
    rows = [["batch", "1 device", f"{n} devices", "communication / step", "speedup"]]
    for batch in (1, args.batch):
        p = parallel_decode(costs, hw, config.hidden_size, config.vocab_size, batch, context, n, bw * 1e9,
                            lat * 1e-6, args.dtype)
        rows.append([str(batch), _rate(p.one_device), _rate(p.tokens_per_second), f"{p.comm_seconds * 1e3:.3f} ms",
                     f"{p.speedup:.2f}x"])
    return "\n".join(lines + _table(rows, right={1, 2, 3, 4}))


def cmd_roofline(args: argparse.Namespace) -> int:
    hw = hardware_from_args(args.hardware, args.bandwidth, args.tflops)
    if hw is not None and args.measure:
        raise MinervaError("--measure runs the engine on this machine; it cannot be combined with "
                           "--hardware, --bandwidth or --tflops")
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 2:
        raise MinervaError(f"--tensor-parallel-size must be at least 2 for a prediction, got {args.tensor_parallel_size}")
    if not (args.link_bandwidth > 0 and args.link_latency >= 0):
        raise MinervaError("--link-bandwidth must be > 0 and --link-latency >= 0")
    for flag in ("batch", "prompt"):
        if getattr(args, flag) < 1:
            raise MinervaError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if hw is not None else resolve_dtype("auto", torch.device("cpu"))
    kv = args.kv_cache_dtype
    # The probe measures the CPU, so the engine runs there too. Without --measure the KV
    # pool is never used: keep it small.
    llm = LLM(args.model, device="cpu", dtype=args.dtype, activations=args.activations,
              kv_cache_memory=0.2 if args.measure else float(64 << 20),
              max_num_seqs=max(64, args.batch), kv_cache_dtype_k=kv, kv_cache_dtype_v=kv)
    loaded, config = llm.loaded, llm.config
    load_rss = peak_rss_mb()
    costs = model_costs(loaded, kv, kv, llm.dtype)
    if args.prompt >= costs.max_context:
        raise MinervaError(f"--prompt {args.prompt} does not fit the model's context of "
                           f"{costs.max_context} tokens; give at most {costs.max_context - 1}")
    probed = hw is None
    if hw is None:
        print("probing memory bandwidth and compute peaks...", file=sys.stderr)
        hw = probe()
    rows = _rows(llm, costs, hw, args)

    attention = 4 * costs.num_heads * costs.head_dim * costs.num_layers
    sliding = [w for w in costs.windows if w is not None]
    windows = (f" ({len(sliding)} of {costs.num_layers} layers stop growing at a {max(sliding)}-token window)"
               if sliding else "")
    int8_scope = ""
    if costs.int8_params:
        int8_scope = (" (the int8 peak for the matmuls on 8-bit activations)" if hw.int8_ops
                      else " (also for the matmuls on 8-bit activations: no int8 peak known)")
    moe = (f", of which a token uses {costs.active_params / 1e6:,.1f} M: {config.num_experts_per_tok} of "
           f"{config.num_experts} experts" if costs.expert_params else "")
    scope = "" if probed else "; predictions only: the engine has not run there, weights costed as held here"
    out = [
        "minerva roofline",
        f"machine:   {machine().describe()}{_load_average()}",
        f"command:   {' '.join(sys.argv)}",
        (f"model:     {loaded.path} ({config.architecture}, {config.num_layers} layers, context "
         f"{config.max_position}); loaded in {loaded.load_seconds:.2f} s, peak RSS {load_rss:.0f} MB"),
        f"hardware:  {hw.describe()}",
        f"           ceilings use the {args.dtype} peak{int8_scope}{scope}",
        (f"per token: {costs.weight_bytes_read(1) / 1e6:,.1f} MB of weights read "
         f"({costs.bits_per_weight:.2f} bits x {costs.matmul_params / 1e6:,.1f} M matmul weights{moe}), "
         f"{2 * costs.active_params / 1e9:.3f} GFLOP + {attention / 1e3:,.1f} kFLOP per token of context"
         f"{windows}; "
         f"KV {costs.kv_bytes_per_token / 1e3:,.1f} KB per token of context "
         f"({args.dtype if kv == 'auto' else kv})"),
        "",
    ]
    out += ceiling_table(rows)
    out += ["", f"decode ceiling by context length (batch 1 and batch {args.batch}, all sequences together):"]
    out += _context_table(costs, hw, args)
    if args.tensor_parallel_size:
        out += ["", _parallel_table(costs, hw, config, args)]
    source, chosen = tune.in_force() if probed else (None, None)  # this machine's: not for --hardware
    if probed:
        out += ["", f"int8 kernel choices: {source}"]
    if chosen is not None:
        out += tune.table(chosen, hw.bandwidth if probed else None)
        if tune.busy_note(chosen):
            out += [f"note: {tune.busy_note(chosen)}"]
    if probed:
        out += ["", (f"peak RSS of the whole run: {peak_rss_mb():.0f} MB "
                     "(the probe's 512 MiB buffer included)")]
    print("\n".join(out))
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `minerva roofline` on the CLI's sub-command parsers."""
    p = subparsers.add_parser(
        "roofline", help="speed ceilings of a model on this machine (measured) or other hardware",
        description="minerva roofline [MODEL]: the fastest prefill and decode can go given the memory "
                    "bandwidth and compute peak (probed here in a few seconds, or from --hardware), "
                    "and with --measure how close the engine gets")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="a pulled name, a .gguf file, a Hugging Face directory or repo (default smollm2-135m)")
    p.add_argument("--hardware", default=None, metavar="NAME",
                   help=f"predict for other hardware instead of probing this one: {', '.join(PRESETS)}")
    p.add_argument("--bandwidth", type=float, default=None, metavar="GB/s",
                   help="memory bandwidth of other hardware (with --tflops, or overriding --hardware)")
    p.add_argument("--tflops", type=float, default=None, metavar="TFLOPS",
                   help="compute peak of other hardware, used for every dtype")
    p.add_argument("--batch", type=int, default=32, help="sequences decoding together (default 32)")
    p.add_argument("--context", type=_contexts, default=list(DEFAULT_CONTEXTS), metavar="N,N,...",
                   help="context lengths of the decode table (default 128,512,2048,8192, capped at the "
                        "model's context)")
    p.add_argument("--prompt", type=int, default=512, help="prompt length for prefill (default 512)")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="activation dtype; picks the fp32 or bf16 compute peak (default auto: what the "
                        "engine would pick here, bfloat16 for --hardware)")
    p.add_argument("--activations", default="auto", choices=["auto", "float", "int8"], help=ACTIVATIONS_HELP)
    p.add_argument("--kv-cache-dtype", default="auto", choices=sorted(KV_FORMATS),
                   help="K and V cache precision (default auto: the activation dtype)")
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="also predict batch decode split over N devices like this one (tensor parallelism)")
    p.add_argument("--link-bandwidth", type=float, default=10.0, metavar="GB/s",
                   help="bandwidth between the devices for --tensor-parallel-size (default 10)")
    p.add_argument("--link-latency", type=float, default=5.0, metavar="US",
                   help="latency of one message between the devices, microseconds (default 5)")
    add_no_tune(p)
    p.add_argument("--measure", action="store_true",
                   help="run the engine here (prefill, batch-1 and batch-N decode) and report the "
                        "fraction of each ceiling reached")
    p.set_defaults(func=cmd_roofline)
    return p
