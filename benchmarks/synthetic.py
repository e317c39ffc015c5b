"""Write GGUF files with random weights in the real shapes of TinyLlama-1.1B, Mistral-7B and
Llama-3-8B, so that kernels and the engine can be measured at real sizes without the real models.

    python benchmarks/synthetic.py tinyllama-1.1b --type Q4_K_M
    python benchmarks/synthetic.py llama3-8b --type Q4_K_M -o /tmp/llama3-8b-q4km.gguf
    python benchmarks/synthetic.py tinyllama-1.1b --type Q4_0 --context 32768   # long-context decode
    python benchmarks/synthetic.py mistral-7b --type Q8_0 --layers 2             # a small, quick file
    minerva bench latency FILE -p 128 -n 32 -r 2
    minerva roofline FILE --measure

Without `-o` the file goes to `$MINERVA_HOME/synthetic/` (`~/.cache/minerva/synthetic/`), named
after the shape, the type and the options (`tinyllama-1.1b-Q4_K_M.gguf`, `...-ctx32768.gguf`).
The script prints the path, the size, the time taken and the bytes of each tensor type.

What a file holds, and why it can stand in for the real one:

- Tensors: llama.cpp's names, shapes and order for the llama architecture (`token_embd`,
  `blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
  ffn_down}`, `output_norm`, `output`), and the metadata llama.cpp's converter writes
  (sizes, head counts, rope base, RMS epsilon, context length, `general.file_type`).
- Types: `--type` names a llama.cpp file type and every matrix gets the type `llama-quantize`
  gives it in that mix (llama.cpp `src/llama-quant.cpp`, `llama_tensor_get_type`): the
  output matrix is Q6_K in every quantized mix but Q8_0; Q4_K_M and Q5_K_M store `attn_v` and
  `ffn_down` as Q6_K in the first and last eighth of the layers and every third layer
  between; Q4_K_S stores the first four `attn_v` and the first eighth of `ffn_down` as Q5_K;
  Q3_K_M stores `attn_output` as Q4_K, `attn_v` as Q5_K in layers 0-1 and Q4_K after, and
  `ffn_down` as Q5_K in the first sixteenth and Q4_K after; Q3_K_L stores all three as Q5_K;
  Q2_K stores `attn_output` and `ffn_down` as Q3_K and `attn_v` as Q4_K (Q3_K with fewer
  than 4 query heads per KV head); F16/BF16 are what the converter writes. `Q3_K`, `Q4_K`
  and `Q5_K`, and any type with `--pure`, use one type for every matrix (`llama-quantize
  --pure`). Norms are F32 ones.
- Values: each block is random bytes whose fp16 scale fields (and, for Q2_K/Q4_K/Q5_K, the
  minimums) are then set so the dequantized weights have mean 0 and std 0.02, like
  trained weights: nothing is NaN or infinite and activations stay bounded. F16/BF16 values
  are normal(0, 0.02). The same arguments and `--seed` give the same bytes.
- Tokenizer: the `tokenizer.*` metadata and chat template of a pulled model (SmolLM2-135M
  by default, `--tokenizer`), cut to the shape's vocabulary (with the merges whose tokens
  are all kept: SmolLM2's ids follow its merge order, so a text whose SmolLM2 ids fall under
  the cut tokenizes the same) or padded with `<unused_N>` tokens of type UNUSED, so that
  the rows of `token_embd` and `output` equal the token count.

`--layers N` keeps the shape but stacks N layers (the mix rules then see an N-layer
model, as llama.cpp would); `--shrink F` divides the hidden size, feed-forward size and
head counts by F (head size and vocabulary kept) for tests that need a fast file. Neither
is a real shape any more. The real files the defaults mimic are about 0.67 GB
(TinyLlama Q4_K_M), 4.4 GB (Mistral-7B Q4_K_M) and 4.9 GB (Llama-3-8B Q4_K_M).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any, Callable

import gguf
import numpy as np

from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile
from minerva.store import resolve, store_root

QT = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType
WEIGHT_STD = 0.02  # of every dequantized matrix: about what trained LLM weights have
CHUNK_BYTES = 64 << 20  # random bytes made at a time


# ------------------------------------------------------------------ shapes

@dataclass(frozen=True)
class Shape:
    title: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "tinyllama-1.1b": Shape("TinyLlama-1.1B", 22, 2048, 5632, 32, 4, 32000, 2048, 10000.0),
    "mistral-7b": Shape("Mistral-7B", 32, 4096, 14336, 32, 8, 32000, 32768, 1e6),
    "llama3-8b": Shape("Llama-3-8B", 32, 4096, 14336, 32, 8, 128256, 8192, 500000.0),
}


def adjust(shape: Shape, layers: int | None = None, context: int | None = None, shrink: int = 1) -> Shape:
    """The shape with another layer count, context length, or sizes divided by `shrink`
    (feed-forward rounded up to the 256-value K-quant block, at least one KV head)."""
    if layers is not None and layers < 1 or context is not None and context < 1 or shrink < 1:
        raise MinervaError("--layers, --context and --shrink must be at least 1")
    if shape.heads % shrink or (shape.heads // shrink * shape.head_dim) % 256:
        raise MinervaError(f"--shrink {shrink} does not divide {shape.title}'s {shape.heads} heads into "
                           "a hidden size that is a multiple of 256")
    return replace(shape, layers=layers or shape.layers, context=context or shape.context,
                   hidden=shape.heads // shrink * shape.head_dim, heads=shape.heads // shrink,
                   kv_heads=max(1, shape.kv_heads // shrink),
                   ffn=-(-shape.ffn // shrink // 256) * 256)


# --------------------------------------------------------------- file types

def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _k_m(role: str, i: int, n: int, gqa: int) -> QT | None:  # Q4_K_M and Q5_K_M
    return QT.Q6_K if role in ("attn_v", "ffn_down") and _more_bits(i, n) else None


def _q4_k_s(role: str, i: int, n: int, gqa: int) -> QT | None:
    if role == "attn_v" and i < 4 or role == "ffn_down" and i < n // 8:
        return QT.Q5_K
    return None


def _q2_k(role: str, i: int, n: int, gqa: int) -> QT | None:
    if role == "attn_v":
        return QT.Q4_K if gqa >= 4 else QT.Q3_K
    return QT.Q3_K if role in ("ffn_down", "attn_output") else None


def _q3_k_m(role: str, i: int, n: int, gqa: int) -> QT | None:
    if role == "attn_v":
        return QT.Q5_K if i < 2 else QT.Q4_K
    if role == "ffn_down":
        return QT.Q5_K if i < n // 16 else QT.Q4_K
    return QT.Q4_K if role == "attn_output" else None


def _q3_k_l(role: str, i: int, n: int, gqa: int) -> QT | None:
    return QT.Q5_K if role in ("attn_v", "ffn_down", "attn_output") else None


@dataclass(frozen=True)
class FileType:
    base: QT  # the type of every matrix the rules below do not change
    ftype: FT | None  # general.file_type; None where llama.cpp has none (pure K types)
    # (role, layer, layers, query heads per KV head) -> type
    layer_rule: Callable[[str, int, int, int], QT | None] | None = None
    pure: bool = False  # one type for every matrix, the output too


FILE_TYPES = {
    "F16": FileType(QT.F16, FT.MOSTLY_F16),
    "BF16": FileType(QT.BF16, FT.MOSTLY_BF16),
    "Q8_0": FileType(QT.Q8_0, FT.MOSTLY_Q8_0),
    "Q4_0": FileType(QT.Q4_0, FT.MOSTLY_Q4_0),
    "Q4_1": FileType(QT.Q4_1, FT.MOSTLY_Q4_1),
    "Q5_0": FileType(QT.Q5_0, FT.MOSTLY_Q5_0),
    "Q5_1": FileType(QT.Q5_1, FT.MOSTLY_Q5_1),
    "Q2_K": FileType(QT.Q2_K, FT.MOSTLY_Q2_K, _q2_k),
    "Q3_K_S": FileType(QT.Q3_K, FT.MOSTLY_Q3_K_S),
    "Q3_K_M": FileType(QT.Q3_K, FT.MOSTLY_Q3_K_M, _q3_k_m),
    "Q3_K_L": FileType(QT.Q3_K, FT.MOSTLY_Q3_K_L, _q3_k_l),
    "Q4_K_S": FileType(QT.Q4_K, FT.MOSTLY_Q4_K_S, _q4_k_s),
    "Q4_K_M": FileType(QT.Q4_K, FT.MOSTLY_Q4_K_M, _k_m),
    "Q5_K_S": FileType(QT.Q5_K, FT.MOSTLY_Q5_K_S),
    "Q5_K_M": FileType(QT.Q5_K, FT.MOSTLY_Q5_K_M, _k_m),
    "Q6_K": FileType(QT.Q6_K, FT.MOSTLY_Q6_K),
    "Q3_K": FileType(QT.Q3_K, None, pure=True),
    "Q4_K": FileType(QT.Q4_K, None, pure=True),
    "Q5_K": FileType(QT.Q5_K, None, pure=True),
}
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)


def tensor_type(ft: FileType, role: str, layer: int, layers: int, pure: bool = False, gqa: int = 1) -> QT:
    """The type llama-quantize (or, for F16/BF16, the converter) gives one tensor."""
    if role.endswith("norm"):
        return QT.F32
    if pure or ft.pure or ft.base in FLOAT_TYPES:
        return ft.base
    if role == "output":
        return QT.Q8_0 if ft.base == QT.Q8_0 else QT.Q6_K
    return (ft.layer_rule and ft.layer_rule(role, layer, layers, gqa)) or ft.base


LAYER_TENSORS: dict[str, Callable[[Shape], tuple[int, ...]]] = {  # torch order: (rows, cols)
    "attn_norm": lambda s: (s.hidden,),
    "attn_q": lambda s: (s.heads * s.head_dim, s.hidden),
    "attn_k": lambda s: (s.kv_heads * s.head_dim, s.hidden),
    "attn_v": lambda s: (s.kv_heads * s.head_dim, s.hidden),
    "attn_output": lambda s: (s.hidden, s.heads * s.head_dim),
    "ffn_norm": lambda s: (s.hidden,),
    "ffn_gate": lambda s: (s.ffn, s.hidden),
    "ffn_up": lambda s: (s.ffn, s.hidden),
    "ffn_down": lambda s: (s.hidden, s.ffn),
}


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # torch order
    qtype: QT


def plan(shape: Shape, type_name: str, pure: bool = False) -> list[TensorPlan]:
    """Every tensor of the file, in llama.cpp's order, with its shape and type."""
    ft = FILE_TYPES[type_name]

    def one(name: str, role: str, dims: tuple[int, ...], layer: int = 0) -> TensorPlan:
        qtype = tensor_type(ft, role, layer, shape.layers, pure, shape.heads // shape.kv_heads)
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if dims[-1] % block:
            raise MinervaError(f"{name}: rows of {dims[-1]} values do not split into {qtype.name} "
                               f"blocks of {block}")
        return TensorPlan(name, dims, qtype)

    out = [one("token_embd.weight", "token_embd", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        out += [one(f"blk.{i}.{role}.weight", role, dims(shape), i) for role, dims in LAYER_TENSORS.items()]
    out.append(one("output_norm.weight", "output_norm", (shape.hidden,)))
    out.append(one("output.weight", "output", (shape.vocab, shape.hidden)))
    return out


# ------------------------------------------------------------ random blocks

def _rms_uniform(levels: int, centre: float) -> float:
    """RMS of q - centre for q uniform on 0 .. levels-1."""
    return math.sqrt((levels**2 - 1) / 12 + ((levels - 1) / 2 - centre) ** 2)


_RMS_INT8 = _rms_uniform(256, 128)  # a random signed byte
_RMS_SCALE6 = _rms_uniform(64, 0)  # a random 6-bit K-quant sub-block scale


@dataclass(frozen=True)
class Recipe:
    """How random bytes become a sane block: the RMS of a dequantized value when d = 1, the
    fp16 fields to set (byte offset, value as a multiple of d), whether d takes a random
    sign per block (Q4_0/Q5_0, whose codes run -8..7 and -16..15: as in llama.cpp's
    quantizer, where d = max / -8 has the sign of the block's largest value, so the mean
    is 0), and for Q4_K/Q5_K (their 12 bytes of 6-bit scales and mins) or Q2_K (16 bytes of a
    4-bit scale and min) whether each minimum is made equal to its scale (with
    dmin = centre * d every sub-block is then d * scale * (q - centre): mean 0)."""

    unit_rms: float
    fields: tuple[tuple[int, float], ...]
    signed: bool = False
    mins_follow_scales: str | None = None  # "k12" (Q4_K/Q5_K) or "q2k"


RECIPES = {  # offsets and layouts as in gguf.quants and minerva/formats/quant.py
    QT.Q4_0: Recipe(_rms_uniform(16, 8), ((0, 1.0),), signed=True),
    QT.Q4_1: Recipe(_rms_uniform(16, 7.5), ((0, 1.0), (2, -7.5))),
    QT.Q5_0: Recipe(_rms_uniform(32, 16), ((0, 1.0),), signed=True),
    QT.Q5_1: Recipe(_rms_uniform(32, 15.5), ((0, 1.0), (2, -15.5))),
    QT.Q8_0: Recipe(_RMS_INT8, ((0, 1.0),)),
    QT.Q2_K: Recipe(_rms_uniform(16, 0) * _rms_uniform(4, 1.5), ((80, 1.0), (82, 1.5)), mins_follow_scales="q2k"),
    # random 6-bit scales (-32..31) times random 3-bit values (-4..3): mean 0.25 d, std 42 d
    QT.Q3_K: Recipe(_rms_uniform(64, 32) * _rms_uniform(8, 4), ((108, 1.0),)),
    QT.Q4_K: Recipe(_RMS_SCALE6 * _rms_uniform(16, 7.5), ((0, 1.0), (2, 7.5)), mins_follow_scales="k12"),
    QT.Q5_K: Recipe(_RMS_SCALE6 * _rms_uniform(32, 15.5), ((0, 1.0), (2, 15.5)), mins_follow_scales="k12"),
    QT.Q6_K: Recipe(_RMS_INT8 * _rms_uniform(64, 32), ((208, 1.0),)),  # int8 scales stay random
}


def _normal_table(qtype: QT) -> np.ndarray:
    """65536 fp16 or bf16 bit patterns at the quantiles of normal(0, WEIGHT_STD): a random
    uint16 picks one, which is a normal draw at a fraction of the cost of sampling one."""
    dist = NormalDist(0.0, WEIGHT_STD)
    q = np.array([dist.inv_cdf((i + 0.5) / 65536) for i in range(65536)], dtype=np.float32)
    if qtype == QT.F16:
        return q.astype(np.float16).view(np.uint16)
    bits = q.view(np.uint32).astype(np.uint64)  # bf16: round to nearest even
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


class Hole:
    """A tensor's bytes left unwritten (a hole in the file, read back as zeros): for a caller
    that fills the weights itself after loading, such as benchmarks/gpu_check.py on a GPU."""

    dtype = np.dtype(np.uint8)

    def __init__(self, qtype: QT, shape: tuple[int, int]):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        self.shape = (shape[0], shape[1] // block * size)
        self.nbytes = self.shape[0] * self.shape[1]

    def tofile(self, fout) -> None:
        fout.seek(self.nbytes - 1, 1)
        fout.write(b"\0")  # the file reaches the tensor's end even where nothing follows it


class RandomTensor:
    """The packed bytes of one tensor, made a slab of rows at a time when GGUFWriter writes
    them (it calls `tofile`): no more than one slab is in memory at once."""

    dtype = np.dtype(np.uint8)

    def __init__(self, qtype: QT, shape: tuple[int, int], seed: np.random.SeedSequence,
                 tables: dict[QT, np.ndarray]):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        self.qtype, self.seed = qtype, seed
        self.shape = (shape[0], shape[1] // block * size)  # bytes, as GGUFWriter's raw_shape
        self.nbytes = self.shape[0] * self.shape[1]
        self.type_size = size
        self.table = tables.get(qtype)
        if qtype in RECIPES:
            recipe = RECIPES[qtype]
            d = np.float16(WEIGHT_STD / recipe.unit_rms)
            self.fields = [(off, np.array([mult * float(d)], np.float16).view(np.uint8))
                           for off, mult in recipe.fields]
            self.signed, self.mins_follow_scales = recipe.signed, recipe.mins_follow_scales
        elif self.table is None:
            raise MinervaError(f"no recipe for random {qtype.name} tensors")

    def slabs(self):
        """The tensor's bytes, a slab of rows at a time."""
        bits = np.random.SFC64(self.seed)
        rows, row_bytes = self.shape
        step = max(1, CHUNK_BYTES // row_bytes)
        for r in range(0, rows, step):
            n = min(step, rows - r) * row_bytes
            raw = bits.random_raw(-(-n // 8)).view(np.uint8)[:n]
            yield self._shape(raw)

    def tofile(self, fout) -> None:
        for slab in self.slabs():
            slab.tofile(fout)

    def _shape(self, raw: np.ndarray) -> np.ndarray:
        """Random bytes -> bytes of valid blocks (or of normal floats)."""
        if self.table is not None:
            return self.table[raw.view(np.uint16)]
        blocks = raw.reshape(-1, self.type_size)
        sign = blocks[:, 1] & 0x80 if self.signed else None  # a random bit, before d is written over it
        for off, value in self.fields:
            blocks[:, off:off + 2] = value
        if self.signed:
            blocks[:, 1] |= sign
        if self.mins_follow_scales == "k12":  # 12 scale bytes at 4..15: 4 of scales, 4 of mins, 4 of both
            blocks[:, 8:12] = blocks[:, 4:8]
            low = blocks[:, 12:16] & 0x0F
            blocks[:, 12:16] = low | (low << 4)
        elif self.mins_follow_scales == "q2k":  # 16 bytes at 0..15: scale low nibble, min high
            low = blocks[:, 0:16] & 0x0F
            blocks[:, 0:16] = low | (low << 4)
        return raw


# -------------------------------------------------------------- tokenizer

UNUSED = int(gguf.TokenType.UNUSED)
TOKEN_IDS = ("bos", "eos", "eot", "eom", "unknown", "padding", "sep")
TOKENIZER_WRITERS = {  # metadata key -> GGUFWriter method that writes it with llama.cpp's type
    "tokenizer.ggml.model": "add_tokenizer_model", "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list", "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.scores": "add_token_scores", "tokenizer.ggml.merges": "add_token_merges",
    "tokenizer.ggml.add_bos_token": "add_add_bos_token", "tokenizer.ggml.add_eos_token": "add_add_eos_token",
    "tokenizer.ggml.add_space_prefix": "add_add_space_prefix", "tokenizer.chat_template": "add_chat_template",
    **{f"tokenizer.ggml.{k}_token_id": f"add_{'unk' if k == 'unknown' else 'pad' if k == 'padding' else k}"
                                        "_token_id" for k in TOKEN_IDS},
}


def _merge_parts(merge: str) -> tuple[str, str]:
    pos = merge.find(" ", 1)  # as llama.cpp splits a merge: a space inside the first part is kept
    return merge[:pos], merge[pos + 1:]


def fit_vocabulary(md: dict[str, Any], vocab: int) -> dict[str, Any]:
    """The `tokenizer.*` metadata of `md` with exactly `vocab` tokens: cut (dropping merges
    that name a dropped token; special ids must survive) or padded with UNUSED tokens."""
    out = {k: v for k, v in md.items() if k.startswith("tokenizer.")}
    tokens = list(out["tokenizer.ggml.tokens"])
    n = len(tokens)
    types = list(out.get("tokenizer.ggml.token_type") or [1] * n)
    scores = out.get("tokenizer.ggml.scores")
    if vocab < n:
        tokens, types = tokens[:vocab], types[:vocab]
        kept = set(tokens)
        if "tokenizer.ggml.merges" in out:
            out["tokenizer.ggml.merges"] = [m for m in out["tokenizer.ggml.merges"]
                                            if all(p in kept for p in (*_merge_parts(m), "".join(_merge_parts(m))))]
        lost = [k for k in (f"tokenizer.ggml.{t}_token_id" for t in TOKEN_IDS) if out.get(k, -1) >= vocab]
        if lost:
            raise MinervaError(f"cutting the vocabulary to {vocab} tokens drops {', '.join(lost)}; "
                               "take the tokenizer from another model (--tokenizer)")
    elif vocab > n:
        extra = [f"<unused_{i}>" for i in range(vocab - n)]
        if set(extra) & set(tokens):
            raise MinervaError("the tokenizer already has <unused_N> tokens; cannot pad it")
        tokens, types = tokens + extra, types + [UNUSED] * len(extra)
    out["tokenizer.ggml.tokens"], out["tokenizer.ggml.token_type"] = tokens, types
    if scores is not None:
        out["tokenizer.ggml.scores"] = (list(scores) + [0.0] * vocab)[:vocab]
    return out


# ------------------------------------------------------------------ writing

def default_path(shape_name: str, type_name: str, args: argparse.Namespace) -> Path:
    parts = [shape_name, type_name]
    parts += ["pure"] if args.pure and not FILE_TYPES[type_name].pure else []
    parts += [f"ctx{args.context}"] if args.context else []
    parts += [f"{args.layers}layers"] if args.layers else []
    parts += [f"shrink{args.shrink}"] if args.shrink > 1 else []
    parts += [f"seed{args.seed}"] if args.seed else []
    return store_root().parent / "synthetic" / ("-".join(parts) + ".gguf")


def write(path: Path, shape: Shape, type_name: str, *, seed: int = 0, pure: bool = False,
          tokenizer: Path | None = None, progress: bool = False, sparse: bool = False) -> list[TensorPlan]:
    """Write the file (under a temporary name, renamed when complete); return its tensors.
    `sparse`: the matrices' bytes are left as holes, zeros when read (see `Hole`)."""
    ft, tensors = FILE_TYPES[type_name], plan(shape, type_name, pure)
    source = resolve(tokenizer or "smollm2-135m")
    tok = fit_vocabulary(GGUFFile(source).metadata, shape.vocab)
    w, partial = open_writer(path, "llama", f"{shape.title} shape, random weights",
                             f"synthetic: random weights in {shape.title}'s tensor shapes, written by Minerva's "
                             f"benchmarks/synthetic.py (type {type_name}{', pure' if pure else ''}, seed {seed}); "
                             f"tokenizer from {source.name}")
    if ft.ftype is not None:
        w.add_file_type(int(ft.ftype))
    if any(t.qtype not in FLOAT_TYPES for t in tensors):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(shape.vocab)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_rope_freq_base(shape.rope_theta)
    for key, value in tok.items():
        if key in TOKENIZER_WRITERS:
            getattr(w, TOKENIZER_WRITERS[key])(value)
        else:
            print(f"note: tokenizer key {key} of {source.name} is not copied", file=sys.stderr)
    tables = {q: _normal_table(q) for q in {t.qtype for t in tensors} & {QT.F16, QT.BF16}}
    seeds = np.random.SeedSequence(seed).spawn(len(tensors))
    for t, s in zip(tensors, seeds):
        if t.qtype == QT.F32:
            w.add_tensor(t.name, np.ones(t.shape, dtype=np.float32))
        else:
            data = Hole(t.qtype, t.shape) if sparse else RandomTensor(t.qtype, t.shape, s, tables)
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.qtype)  # type: ignore[arg-type]
    finish(w, partial, path, progress)
    return tensors


def open_writer(path: Path, arch: str, name: str | None = None,
                description: str | None = None) -> tuple[gguf.GGUFWriter, Path]:
    """A writer of `path` under a temporary name (`finish` renames it), its name and description set."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(partial, arch)
    if name is not None:
        w.add_type("model")
        w.add_name(name)
        w.add_description(description or name)
    return w, partial


def finish(w: gguf.GGUFWriter, partial: Path, path: Path, progress: bool) -> None:
    """Write what `w` holds to `partial` and rename it to `path`; on failure remove it."""
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=progress)
        w.close()
        partial.replace(path)
    except BaseException:
        w.close()
        partial.unlink(missing_ok=True)
        raise


def report(path: Path, secs: float, shape_line: str, tensors: list[TensorPlan]) -> None:
    size = path.stat().st_size
    print(f"wrote {path}")
    print(shape_line)
    print(f"size {size:,} bytes ({size / 1e9:.2f} GB) in {secs:.1f} s ({size / 1e6 / secs:,.0f} MB/s)")
    print("\n".join(breakdown(tensors)))


def breakdown(tensors: list[TensorPlan]) -> list[str]:
    """Lines of a table: for each tensor type, its tensors, weights and bytes."""
    rows: dict[str, list[int]] = {}
    for t in tensors:
        block, size = gguf.GGML_QUANT_SIZES[t.qtype]
        n = math.prod(t.shape)
        row = rows.setdefault(t.qtype.name, [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + n, row[2] + n // block * size
    total = sum(r[2] for r in rows.values())
    out = [f"{'type':<6}{'tensors':>9}{'weights':>16}{'bytes':>16}{'share':>8}{'bits/weight':>13}"]
    for name, (count, n, nbytes) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        out.append(f"{name:<6}{count:>9}{n:>16,}{nbytes:>16,}{100 * nbytes / total:>7.1f}%"
                   f"{8 * nbytes / n:>13.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:9]))
    p.add_argument("shape", choices=SHAPES)
    p.add_argument("--type", default="Q4_K_M", choices=FILE_TYPES, help="llama.cpp file type (default Q4_K_M)")
    p.add_argument("--pure", action="store_true", help="one type for every matrix (llama-quantize --pure)")
    p.add_argument("--context", type=int, default=None, help="context length in the metadata (rope positions)")
    p.add_argument("--layers", type=int, default=None, help="stack this many layers instead of the shape's")
    p.add_argument("--shrink", type=int, default=1, help="divide hidden, feed-forward and head counts (tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="model to copy the tokenizer from (default smollm2-135m)")
    p.add_argument("-o", "--output", type=Path, default=None, help="file to write (default: see above)")
    args = p.parse_args(argv)
    try:
        shape = adjust(SHAPES[args.shape], args.layers, args.context, args.shrink)
        path = args.output or default_path(args.shape, args.type, args)
        start = time.perf_counter()
        tensors = write(path, shape, args.type, seed=args.seed, pure=args.pure, tokenizer=args.tokenizer,
                        progress=sys.stderr.isatty())
    except (MinervaError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report(path, time.perf_counter() - start,
           f"{shape.title} shape: {shape.layers} layers, hidden {shape.hidden}, feed-forward {shape.ffn}, "
           f"{shape.heads} heads / {shape.kv_heads} KV heads, vocabulary {shape.vocab}, context {shape.context}",
           tensors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
