"""Whether a model fits before it loads, as llama.cpp's `--fit` asks: the bytes its weights
will take, read from the file's header (GGUF tensor infos, SafeTensors headers), against the
memory available on the device. A model that cannot fit is refused with the numbers and
what to change, instead of being read until the system kills the process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile
from minerva.formats.safetensors import SafeTensorsDir

FLOATS = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
# bytes per weight of `--quantize` (int8: Q8_0's 34 bytes per 32; int4: Q4_1's 20), with the
# embedding and head at int8
QUANTIZED = {"int8": 34 / 32, "int4": 20 / 32}
RUNTIME = 256 << 20  # beside the weights: activations, the tokenizer, the kernels' buffers
# Bytes per entry of a GGUF header's arrays (token strings, scores, types, merges) as the
# parsed metadata and the tokenizer built from it hold them (measured: 160-300 for the
# BPE and SentencePiece vocabularies of SmolLM2, Gemma 3, Llama 2 and GPT-OSS); per byte
# of a Hugging Face tokenizer.json, as the tokenizer holds it
VOCAB_ENTRY = 250
TOKENIZER_JSON = 4
# What a model takes beside its weights while it loads: its largest packed tensor is copied
# into the 2 MiB page pool while the original lives, and up to this many freed bytes wait in
# malloc's heap between trims (minerva/kernels/hugepages.py, TRIM_EVERY)
LOAD_SLACK = 16 << 20
SAFETENSORS_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8,
                     "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


def _opened(source) -> GGUFFile | SafeTensorsDir:
    """A model's headers: `source` as opened (a GGUFFile or SafeTensorsDir), or its path."""
    if isinstance(source, (GGUFFile, SafeTensorsDir)):
        return source
    path = Path(source)
    return SafeTensorsDir(path) if path.is_dir() else GGUFFile(path)


def _sizes(source, dtype: torch.dtype, quantize: str | None) -> list[int]:
    """The bytes each weight will hold once loaded: a GGUF file's packed tensors as they are
    and its float tensors in `dtype`; a SafeTensors model's in `dtype`, or at the bytes per
    weight of `quantize` for its matmul weights."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    f = _opened(source)
    if isinstance(f, GGUFFile):
        return [math.prod(t.shape) * itemsize if t.qtype in FLOATS else t.data.nbytes for t in f.tensors.values()]
    sizes = []
    for name in f.tensor_names():
        kind, shape = f.dtype_and_shape(name)
        n = math.prod(shape)
        if kind not in ("F32", "F16", "BF16"):
            sizes.append(n * SAFETENSORS_BYTES.get(kind, 1))  # already packed (MXFP4 blocks, scales)
        elif quantize and len(shape) == 2:
            big = "embed" in name or "lm_head" in name
            sizes.append(math.ceil(n * QUANTIZED["int8" if big else quantize]))
        else:
            sizes.append(n * itemsize)
    return sizes


def weight_bytes(source, dtype: torch.dtype, quantize: str | None = None) -> int:
    """The bytes the loaded model's weights will hold (`source`: a path, or its opened headers)."""
    return sum(_sizes(source, dtype, quantize))


@dataclass(frozen=True)
class Footprint:
    """What a model's headers say it will take: its weights, its vocabulary once read (the
    GGUF header's array entries, or a tokenizer.json's size) and its largest weight."""
    weights: int
    vocab: int
    largest: int


def footprint(source, dtype: torch.dtype, quantize: str | None = None) -> Footprint:
    f = _opened(source)
    sizes = _sizes(f, dtype, quantize)
    if isinstance(f, GGUFFile):
        vocab = VOCAB_ENTRY * sum(len(v) for v in f.metadata.values() if isinstance(v, (list, tuple)))
    else:
        tokenizer = f.path / "tokenizer.json"
        vocab = tokenizer.stat().st_size * TOKENIZER_JSON if tokenizer.exists() else 0
    return Footprint(sum(sizes), vocab, max(sizes, default=0))


def available_memory(device: torch.device) -> int:
    """Bytes free for a new allocation: the GPU's free memory, else the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    have = _proc_bytes("/proc/meminfo", "MemAvailable:")
    return 4 << 30 if have is None else have  # no way to ask: assume 4 GiB


def check_fits(path: Path, need: int, device: torch.device, quantize: str | None) -> None:
    """Refuse, before reading the weights, a model whose weights and runtime exceed the memory available."""
    have = available_memory(device)
    if need + RUNTIME <= have:
        return
    where = "GPU memory" if device.type == "cuda" else "memory"
    hint = ("a smaller --quantize (int4)" if quantize == "int8" else "another device" if quantize else
            "--quantize int4 (or int8)") if path.is_dir() else "a smaller quant of it (OWNER/REPO:Q4_K_M, Q4_0, ...)"
    raise MinervaError(f"'{path.name}' needs about {need / 1e9:.1f} GB of {where} for its weights and "
                       f"{RUNTIME / 1e9:.1f} GB beside them, and {have / 1e9:.1f} GB is available on {device}; "
                       f"free memory, or use {hint}")


@dataclass(frozen=True)
class Estimate:
    """The resident memory of a process serving one model, in bytes: what it held before
    (`base`), the weights, the vocabulary (header arrays and tokenizer), the extra of loading
    (`load`: the largest tensor copied and freed memory not yet returned), the KV pool when
    every block is in use and the activations of the largest step. Loading ends before the
    first step, so the peak takes the larger of the two."""
    base: int
    weights: int
    vocab: int
    load: int
    kv: int
    step: int

    @property
    def peak(self) -> int:
        return self.base + self.weights + self.vocab + max(self.load, self.kv + self.step)

    def describe(self) -> str:
        mb = lambda n: f"{n / 1e6:,.0f} MB"  # noqa: E731
        return (f"about {mb(self.peak)} with every KV block in use: weights {mb(self.weights)}, KV pool "
                f"{mb(self.kv)}, vocabulary {mb(self.vocab)}, activations {mb(self.step)}, process {mb(self.base)}")


def resident() -> int:
    """This process's resident memory now (VmRSS), 0 where the OS does not say."""
    return _proc_bytes("/proc/self/status", "VmRSS:") or 0


def _proc_bytes(path: str, key: str) -> int | None:
    """A `key:  N kB` line of a /proc file, in bytes; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def step_bytes(config, tokens: int) -> int:
    """The activations of one step of `tokens` tokens in float32: the residual stream, the
    normed input, the attention's q, k, v and output (~4 hidden-wide rows) and the MLP's
    gate, up and activated rows (3 intermediate-wide) a token."""
    intermediate = config.intermediate_size
    if config.num_experts:
        intermediate = config.expert_ffn_size * config.num_experts_per_tok
    return 4 * tokens * (4 * config.hidden_size + 3 * intermediate)


def estimate(sizes: Footprint, config, kv: int, step_tokens: int, base: int | None = None) -> Estimate:
    """The memory a process will hold serving a model of these `sizes` (`footprint`) and
    `config` with a KV pool of `kv` bytes and steps of at most `step_tokens` tokens; `base`:
    what the process holds without it (default: its resident memory now)."""
    return Estimate(base=resident() if base is None else base, weights=sizes.weights, vocab=sizes.vocab,
                    load=sizes.largest + min(LOAD_SLACK, sizes.weights), kv=kv, step=step_bytes(config, step_tokens))
