"""Write a real model's weights into a larger llama shape: a GGUF file that computes what the
small model computes, at the cost of the large shape.

    python benchmarks/widened.py                       # SmolLM2-135M at TinyLlama-1.1B's widths
    python benchmarks/widened.py --hidden 768 --ffn 2048 --heads 12 --kv-heads 4 --layers 4 -o /tmp/w.gguf
    minerva bench speculative FILE --speculative ngram

Random weights (`benchmarks/synthetic.py`) have a real model's sizes but not its behaviour:
they do not copy their prompt, follow a chat template or stop, so a measure that depends on
what the model says (how many speculative guesses are accepted) means nothing on them, and
the pulled models are too small for their kernels' cost to show. A widened file has both: by
default SmolLM2-135M (30 layers, hidden 576, feed-forward 1536, 9 heads / 3 KV heads of 64,
vocabulary 49,152) in TinyLlama-1.1B's widths (hidden 2048, feed-forward 5632, 32 heads / 4 KV
heads of 64), 30 layers: 1.46 B weights, 0.93 GB.

How the function is kept:

- Every matrix is the model's own blocks, byte for byte, at the top left of the larger matrix
  (a block never straddles the edge: the small sizes are multiples of the block), every
  other block zero (scale 0: the value 0 in every llama.cpp type). Query head h of KV group g
  goes to the wider group g at the same place; the extra heads, KV heads, feed-forward units
  and hidden dimensions have zero weights, so the hidden state's extra dimensions stay 0
  and add nothing.
- RMS norms average over the wider hidden state: each norm weight is multiplied by
  sqrt(small / wide) and the epsilon by small / wide, which gives the small model's norm
  exactly.
- Metadata: the tokenizer, chat template, context length and rope base are the model's.

In exact arithmetic the logits are the model's; in floating point the sums run over more
terms (zeros among them) and may round differently, so a greedy reply can part from the
small model's where two tokens are nearly tied.

The extra weights are zeros, so the values say nothing about a kernel's numerics at these
sizes (random weights do); they cost what real weights cost, since no kernel skips zeros.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.synthetic import (TOKENIZER_WRITERS, TensorPlan, finish, fit_vocabulary,  # noqa: E402
                                  open_writer, report)
from minerva.errors import MinervaError  # noqa: E402
from minerva.formats.gguf import GGUFFile  # noqa: E402
from minerva.store import resolve, store_root  # noqa: E402

QT = gguf.GGMLQuantizationType
NORMS = ("attn_norm", "ffn_norm", "output_norm")
ROLES = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


class Sizes:
    """A llama shape's widths: hidden, feed-forward, heads, KV heads, head size."""

    def __init__(self, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int):
        self.hidden, self.ffn, self.heads, self.kv_heads, self.head_dim = hidden, ffn, heads, kv_heads, head_dim
        if heads % kv_heads:
            raise MinervaError(f"{heads} heads do not split into {kv_heads} KV groups")
        self.group = heads // kv_heads

    def line(self) -> str:
        return (f"hidden {self.hidden}, feed-forward {self.ffn}, {self.heads} heads / {self.kv_heads} KV heads "
                f"of {self.head_dim}")


def query_rows(small: Sizes, wide: Sizes) -> list[int]:
    """For each query head of the small model, its head in the wide one: the same place in the
    same KV group."""
    return [h // small.group * wide.group + h % small.group for h in range(small.heads)]


def check_fits(small: Sizes, wide: Sizes) -> None:
    for what, a, b in (("hidden size", small.hidden, wide.hidden), ("feed-forward size", small.ffn, wide.ffn),
                       ("KV heads", small.kv_heads, wide.kv_heads), ("heads per KV head", small.group, wide.group)):
        if b < a:
            raise MinervaError(f"the wider shape's {what} ({b}) is smaller than the model's ({a})")


def placements(role: str, small: Sizes, wide: Sizes) -> tuple[tuple[int, int], list[tuple[int, int]], list[tuple[int, int]]]:
    """(wide shape in torch order, [(small row start, wide row start)], [(small col start,
    wide col start)]) for a matrix role; rows and columns move in runs of one head (or all)."""
    hd = small.head_dim
    heads = [(h * hd, w * hd) for h, w in enumerate(query_rows(small, wide))]
    kv = [(j * hd, j * hd) for j in range(small.kv_heads)]
    whole = [(0, 0)]
    return {
        "token_embd": ((-1, wide.hidden), whole, whole),
        "output": ((-1, wide.hidden), whole, whole),
        "attn_q": ((wide.heads * hd, wide.hidden), heads, whole),
        "attn_k": ((wide.kv_heads * hd, wide.hidden), kv, whole),
        "attn_v": ((wide.kv_heads * hd, wide.hidden), kv, whole),
        "attn_output": ((wide.hidden, wide.heads * hd), whole, heads),
        "ffn_gate": ((wide.ffn, wide.hidden), whole, whole),
        "ffn_up": ((wide.ffn, wide.hidden), whole, whole),
        "ffn_down": ((wide.hidden, wide.ffn), whole, whole),
    }[role]


class WidenedMatrix:
    """A packed matrix written into a larger one of zero blocks, made when GGUFWriter writes
    it (it calls `tofile`)."""

    dtype = np.dtype(np.uint8)

    def __init__(self, source: np.ndarray, qtype: QT, shape: tuple[int, int],
                 rows: list[tuple[int, int]], cols: list[tuple[int, int]], run_rows: int, run_cols: int):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        for n in (run_cols, shape[1]):
            if n % block:
                raise MinervaError(f"rows of {n} values do not split into {qtype.name} blocks of {block}; give "
                                   f"sizes that are multiples of {block}")
        self.source, self.rows, self.cols, self.block, self.size = source, rows, cols, block, size
        self.run_rows, self.run_cols = run_rows, run_cols
        self.shape = (shape[0], shape[1] // block * size)  # bytes, as GGUFWriter's raw_shape
        self.nbytes = self.shape[0] * self.shape[1]

    def tofile(self, fout) -> None:
        out = np.zeros(self.shape, np.uint8)
        width = self.run_cols // self.block * self.size
        for s_row, w_row in self.rows:
            for s_col, w_col in self.cols:
                s, w = s_col // self.block * self.size, w_col // self.block * self.size
                out[w_row:w_row + self.run_rows, w:w + width] = self.source[s_row:s_row + self.run_rows, s:s + width]
        out.tofile(fout)


def widen(source: Path, path: Path, wide_sizes: dict[str, int], layers: int | None = None,
          progress: bool = False) -> list[TensorPlan]:
    """Write `source` (a llama GGUF file) widened to `wide_sizes` at `path`; return its tensors."""
    f = GGUFFile(source)
    if f.architecture != "llama":
        raise MinervaError(f"'{source}' is a {f.architecture} model; widening takes the llama architecture")
    hd = int(f.get("attention.key_length") or f.require("embedding_length") // f.require("attention.head_count"))
    small = Sizes(int(f.require("embedding_length")), int(f.require("feed_forward_length")),
                  int(f.require("attention.head_count")), int(f.require("attention.head_count_kv")), hd)
    wide = Sizes(*(wide_sizes.get(k) or getattr(small, k) for k in ("hidden", "ffn", "heads", "kv_heads")), hd)
    check_fits(small, wide)
    block_count = int(f.require("block_count"))
    layers = block_count if layers is None else layers
    if not 1 <= layers <= block_count:
        raise MinervaError(f"--layers takes 1 to {block_count} (the model's layers), got {layers}")
    reader = gguf.GGUFReader(source)
    eps = float(f.require("attention.layer_norm_rms_epsilon"))
    tensors = list(_widened_tensors(source, reader, small, wide, layers))  # checked before anything is written
    w, partial = open_writer(path, "llama", f"{f.metadata.get('general.name', source.stem)}, widened",
                             f"{source.name} widened by Minerva's benchmarks/widened.py to {wide.line()}, "
                             f"{layers} layers: the model's blocks, zero weights elsewhere")
    if f.metadata.get("general.file_type") is not None:
        w.add_file_type(int(f.metadata["general.file_type"]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab = len(f.metadata["tokenizer.ggml.tokens"])
    w.add_vocab_size(vocab)
    w.add_embedding_length(wide.hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(wide.ffn)
    w.add_head_count(wide.heads)
    w.add_head_count_kv(wide.kv_heads)
    w.add_key_length(small.head_dim)
    w.add_value_length(small.head_dim)
    w.add_layer_norm_rms_eps(eps * small.hidden / wide.hidden)
    written = {"vocab_size", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "attention.key_length", "attention.value_length",
               "attention.layer_norm_rms_epsilon"}
    for field in reader.fields.values():  # the rest of the model's own: context, rope base and scaling, ...
        if field.name.startswith("llama.") and field.name.removeprefix("llama.") not in written:
            w.add_key_value(field.name, field.contents(), field.types[0],
                            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for key, value in fit_vocabulary(f.metadata, vocab).items():
        if key in TOKENIZER_WRITERS:
            getattr(w, TOKENIZER_WRITERS[key])(value)
    for plan, data in tensors:
        if isinstance(data, WidenedMatrix):
            w.add_tensor(plan.name, data, raw_shape=data.shape, raw_dtype=plan.qtype)  # type: ignore[arg-type]
        else:
            w.add_tensor(plan.name, data)
    finish(w, partial, path, progress)
    return [plan for plan, _ in tensors]


def _widened_tensors(source: Path, reader: gguf.GGUFReader, small: Sizes, wide: Sizes, layers: int):
    """(plan, data) of each tensor the widened file holds: float32 arrays for the norms (and
    rope_freqs), WidenedMatrix for the matrices."""
    norm_scale = math.sqrt(small.hidden / wide.hidden)
    for t in reader.tensors:
        name = t.name
        role = name.split(".")[-2] if "." in name else ""
        if name == "rope_freqs.weight":  # per rotary pair: the heads' size is kept
            yield TensorPlan(name, tuple(int(n) for n in t.shape), QT.F32), np.asarray(t.data, np.float32)
            continue
        if role not in NORMS and (role not in ROLES or not name.endswith(".weight") or len(t.shape) != 2):
            raise MinervaError(f"'{source}' holds tensor {name}, which widening does not place; "
                               f"it takes {', '.join(ROLES)} matrices and norm weights")
        if name.startswith("blk.") and int(name.split(".")[1]) >= layers:
            continue
        if role in NORMS:
            data = np.zeros(wide.hidden, np.float32)
            data[:small.hidden] = np.asarray(t.data, np.float32) * norm_scale
            yield TensorPlan(name, (wide.hidden,), QT.F32), data
            continue
        shape, rows, cols = placements(role, small, wide)
        src = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)
        shape = (src.shape[0] if shape[0] == -1 else shape[0], shape[1])
        run_rows = src.shape[0] if len(rows) == 1 else small.head_dim
        run_cols = int(t.shape[0]) if len(cols) == 1 else small.head_dim
        yield (TensorPlan(name, shape, t.tensor_type),
               WidenedMatrix(src, t.tensor_type, shape, rows, cols, run_rows, run_cols))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:6]))
    p.add_argument("model", nargs="?", default="smollm2-135m", help="a llama GGUF model (default smollm2-135m)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="file to write (default $MINERVA_HOME/synthetic/MODEL-widened-HIDDEN.gguf)")
    args = p.parse_args(argv)
    try:
        source = resolve(args.model)
        path = args.output or store_root().parent / "synthetic" / (
            f"{source.stem}-widened-{args.hidden}" + (f"-{args.layers}layers" if args.layers else "") + ".gguf")
        start = time.perf_counter()
        tensors = widen(source, path, {"hidden": args.hidden, "ffn": args.ffn, "heads": args.heads,
                                       "kv_heads": args.kv_heads}, args.layers, progress=sys.stderr.isatty())
    except (MinervaError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report(path, time.perf_counter() - start, f"{source.name} widened to hidden {args.hidden}, "
           f"feed-forward {args.ffn}, {args.heads} heads / {args.kv_heads} KV heads", tensors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
