"""Whether a model fits before it loads, as llama.cpp's `--fit` asks: the bytes its weights
will take, read from the file's header (GGUF tensor infos, SafeTensors headers), against the
memory available on the device. A model that cannot fit is refused with the numbers and
what to change, instead of being read until the system kills the process.
"""

from __future__ import annotations

import math
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
SAFETENSORS_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8,
                     "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


def weight_bytes(path: str | Path, dtype: torch.dtype, quantize: str | None = None) -> int:
    """The bytes the loaded model's weights will hold: a GGUF file's packed tensors as they
    are and its float tensors in `dtype`; a SafeTensors model's in `dtype`, or at the bytes
    per weight of `quantize` for its matmul weights."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    path = Path(path)
    if path.is_dir():
        d = SafeTensorsDir(path)
        total = 0
        for name in d.tensor_names():
            kind, shape = d.dtype_and_shape(name)
            n = math.prod(shape)
            if kind not in ("F32", "F16", "BF16"):
                total += n * SAFETENSORS_BYTES.get(kind, 1)  # already packed (MXFP4 blocks, scales)
            elif quantize and len(shape) == 2:
                big = "embed" in name or "lm_head" in name
                total += math.ceil(n * QUANTIZED["int8" if big else quantize])
            else:
                total += n * itemsize
        return total
    f = GGUFFile(path)
    return sum(math.prod(t.shape) * itemsize if t.qtype in FLOATS else t.data.nbytes for t in f.tensors.values())


def available_memory(device: torch.device) -> int:
    """Bytes free for a new allocation: the GPU's free memory, else the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30  # no way to ask: assume 4 GiB


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
