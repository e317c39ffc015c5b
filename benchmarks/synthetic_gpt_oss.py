"""Write a GGUF file with random weights in the real shape of GPT-OSS-20B, so the MoE path can
be measured at its real size without the real model.

    python benchmarks/synthetic_gpt_oss.py                      # ~/.cache/minerva/synthetic/gpt-oss-20b-MXFP4.gguf
    python benchmarks/synthetic_gpt_oss.py --layers 2 -o /tmp/gpt-oss-2l.gguf   # a small, quick file
    minerva bench latency ~/.cache/minerva/synthetic/gpt-oss-20b-MXFP4.gguf -p 128 -n 32 -r 2

What the file holds, and why it can stand in for `ggml-org/gpt-oss-20b-GGUF`
(`gpt-oss-20b-mxfp4.gguf`, 12.1 GB):

- Tensors: llama.cpp's names, shapes and order for the `gpt-oss` architecture: per layer
  `attn_norm`, `attn_q`/`attn_k`/`attn_v`/`attn_output` with their biases, `attn_sinks`,
  `post_attention_norm` (the norm before the feed-forward), the router `ffn_gate_inp` with its
  bias, and the experts as 3-D tensors `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps` [32
  experts, 2880, 2880] with biases [32, 2880]; `token_embd`, `output_norm`, `output`.
- Types: the experts in MXFP4, as OpenAI released them and as every published GGUF keeps
  them; the other matrices Q8_0, the router, norms, sinks and biases F32 (llama.cpp's
  converter keeps `ffn_gate_inp` in F32). This gives the published file's size: 19.1 B expert
  weights at 4.25 bits (10.15 GB) plus 1.80 B others at 8.5 bits (1.91 GB), 12.06 GB. With
  the other matrices in BF16 it would be 13.7 GB.
- Metadata: GPT-OSS-20B's config (hidden 2880, 24 layers, 64 query heads and 8 KV heads of
  64, 32 experts with 4 per token, expert feed-forward 2880, vocabulary 201088, context
  131072, rope base 150000 with YaRN factor 32 from 4096, a 128-token window on even layers,
  RMS epsilon 1e-5), `general.file_type` MOSTLY_MXFP4_MOE.
- Values: Q8_0 blocks as benchmarks/synthetic.py makes them (std 0.02). MXFP4 blocks are
  random nibbles with the exponent byte 120 (scale 2^-7: std 0.023, mean 0). The router is
  normal(0, 0.02), so tokens spread over the experts much as a trained router spreads them
  over a batch; the biases are normal(0, 0.02) too, the sinks normal(0, 1), the norms 1.
- Tokenizer: SmolLM2's, padded with unused tokens to 201088 (synthetic.py's `fit_vocabulary`).
  Harmony's special tokens are absent: the file measures speed, not chat.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.synthetic import (CHUNK_BYTES, TOKENIZER_WRITERS, WEIGHT_STD, RandomTensor,  # noqa: E402
                                  TensorPlan, finish, fit_vocabulary, open_writer, report)
from minerva.errors import MinervaError  # noqa: E402
from minerva.formats.gguf import GGUFFile  # noqa: E402
from minerva.store import resolve, store_root  # noqa: E402

QT = gguf.GGMLQuantizationType
ARCH = "gpt-oss"
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2880, 24, 64, 8, 64
EXPERTS, EXPERTS_USED, EXPERT_FFN = 32, 4, 2880
VOCAB, CONTEXT, ROPE_THETA, WINDOW = 201088, 131072, 150000.0, 128
MXFP4_EXPONENT = 120  # block scale 2^(120 - 127) on E2M1 values of RMS 2.93: std 0.023


def plan(layers: int = LAYERS, experts: int = EXPERTS, vocab: int = VOCAB) -> list[TensorPlan]:
    """Every tensor of the file, in llama.cpp's order, with its shape (torch order) and type."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = [TensorPlan("token_embd.weight", (vocab, HIDDEN), QT.Q8_0)]
    for i in range(layers):
        p = f"blk.{i}."
        out += [TensorPlan(p + "attn_norm.weight", (HIDDEN,), QT.F32)]
        for name, rows, cols in (("attn_q", q, HIDDEN), ("attn_k", kv, HIDDEN), ("attn_v", kv, HIDDEN),
                                 ("attn_output", HIDDEN, q)):
            out += [TensorPlan(p + name + ".weight", (rows, cols), QT.Q8_0), TensorPlan(p + name + ".bias", (rows,), QT.F32)]
        out += [TensorPlan(p + "attn_sinks.weight", (HEADS,), QT.F32),
                TensorPlan(p + "post_attention_norm.weight", (HIDDEN,), QT.F32),
                TensorPlan(p + "ffn_gate_inp.weight", (experts, HIDDEN), QT.F32),
                TensorPlan(p + "ffn_gate_inp.bias", (experts,), QT.F32)]
        for name, rows, cols in (("ffn_gate_exps", EXPERT_FFN, HIDDEN), ("ffn_up_exps", EXPERT_FFN, HIDDEN),
                                 ("ffn_down_exps", HIDDEN, EXPERT_FFN)):
            out += [TensorPlan(p + name + ".weight", (experts, rows, cols), QT.MXFP4),
                    TensorPlan(p + name + ".bias", (experts, rows), QT.F32)]
    out += [TensorPlan("output_norm.weight", (HIDDEN,), QT.F32), TensorPlan("output.weight", (vocab, HIDDEN), QT.Q8_0)]
    return out


class RandomMXFP4:
    """The packed bytes of an MXFP4 tensor: random nibbles, one exponent for every block; made a
    slab at a time when GGUFWriter writes them."""

    dtype = np.dtype(np.uint8)

    def __init__(self, shape: tuple[int, ...], seed: np.random.SeedSequence):
        self.shape = (*shape[:-1], shape[-1] // 32 * 17)  # bytes, as GGUFWriter's raw_shape
        self.nbytes = int(np.prod(self.shape))
        self.seed = seed

    def tofile(self, fout) -> None:
        bits = np.random.SFC64(self.seed)
        step = CHUNK_BYTES // 17 * 17
        for start in range(0, self.nbytes, step):
            n = min(step, self.nbytes - start)
            raw = bits.random_raw(-(-n // 8)).view(np.uint8)[:n]
            raw.reshape(-1, 17)[:, 0] = MXFP4_EXPONENT
            raw.tofile(fout)


def _f32(t: TensorPlan, rng: np.random.Generator) -> np.ndarray:
    if t.name.endswith("norm.weight"):
        return np.ones(t.shape, dtype=np.float32)
    if t.name.endswith("attn_sinks.weight"):  # a logit per head, beside scores of about that size
        return rng.normal(0.0, 1.0, t.shape).astype(np.float32)
    return rng.normal(0.0, WEIGHT_STD, t.shape).astype(np.float32)  # the router and the biases


def _metadata(w: gguf.GGUFWriter, layers: int, experts: int, vocab: int, seed: int, source: Path) -> None:
    w.add_type("model")
    w.add_name("GPT-OSS-20B shape, random weights")
    w.add_description(f"synthetic: random weights in GPT-OSS-20B's tensor shapes, written by Minerva's "
                      f"benchmarks/synthetic_gpt_oss.py (seed {seed}); tokenizer from {source.name}")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(vocab)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(layers)
    w.add_feed_forward_length(EXPERT_FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_sliding_window(WINDOW)
    w.add_expert_count(experts)
    w.add_expert_used_count(min(EXPERTS_USED, experts))
    w.add_expert_feed_forward_length(EXPERT_FFN)


def write(path: Path, layers: int = LAYERS, experts: int = EXPERTS, seed: int = 0, vocab: int = VOCAB,
          tokenizer: Path | None = None, progress: bool = False) -> list[TensorPlan]:
    """Write the file (under a temporary name, renamed when complete); return its tensors."""
    if layers < 1 or experts < EXPERTS_USED:
        raise MinervaError(f"--layers must be at least 1 and --experts at least {EXPERTS_USED}")
    tensors = plan(layers, experts, vocab)
    source = resolve(tokenizer or "smollm2-135m")
    tok = fit_vocabulary(GGUFFile(source).metadata, vocab)
    w, partial = open_writer(path, ARCH)
    _metadata(w, layers, experts, vocab, seed, source)
    for key, value in tok.items():
        if key in TOKENIZER_WRITERS:
            getattr(w, TOKENIZER_WRITERS[key])(value)
    rng = np.random.default_rng(seed)
    seeds = np.random.SeedSequence(seed).spawn(len(tensors))
    for t, s in zip(tensors, seeds):
        if t.qtype == QT.F32:
            w.add_tensor(t.name, _f32(t, rng))
            continue
        data = RandomMXFP4(t.shape, s) if t.qtype == QT.MXFP4 else RandomTensor(t.qtype, t.shape, s, {})
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.qtype)  # type: ignore[arg-type]
    finish(w, partial, path, progress)
    return tensors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:5]))
    p.add_argument("--layers", type=int, default=LAYERS, help=f"layers (default {LAYERS}, the real count)")
    p.add_argument("--experts", type=int, default=EXPERTS, help=f"experts per layer (default {EXPERTS})")
    p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary (default the real one; less for tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="model to copy the tokenizer from (default smollm2-135m)")
    p.add_argument("-o", "--output", type=Path, default=None, help="file to write")
    args = p.parse_args(argv)
    suffix = "".join([f"-{args.layers}layers" if args.layers != LAYERS else "",
                      f"-{args.experts}experts" if args.experts != EXPERTS else "",
                      f"-vocab{args.vocab}" if args.vocab != VOCAB else "",
                      f"-seed{args.seed}" if args.seed else ""])
    path = args.output or store_root().parent / "synthetic" / f"gpt-oss-20b-MXFP4{suffix}.gguf"
    start = time.perf_counter()
    try:
        tensors = write(path, args.layers, args.experts, args.seed, args.vocab, args.tokenizer, sys.stderr.isatty())
    except (MinervaError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report(path, time.perf_counter() - start,
           f"GPT-OSS-20B shape: {args.layers} layers, hidden {HIDDEN}, {args.experts} experts of {EXPERT_FFN} "
           f"({EXPERTS_USED} per token), {HEADS} heads / {KV_HEADS} KV heads, vocabulary {args.vocab}", tensors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
