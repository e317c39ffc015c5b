"""Weight-only, group-wise quantization at load (`--quantize int8|int4`).

A float checkpoint (SafeTensors) is quantized into GGML's block layouts so the same
packed kernels that run GGUF files run it, with no second kernel to keep correct:

- int8: Q8_0, groups of 32 weights with one fp16 scale (8.5 bits per weight);
- int4: Q4_1, groups of 32 weights with an fp16 scale and minimum (5 bits per weight).

The arithmetic is the reference implementation's (ggml-quants.c, as the gguf package
ports it), in float32, so the bytes are identical to what `gguf.quants.quantize`
writes for the same numbers; tests compare them. Under int4 the token embedding and
the output head stay int8, as llama.cpp keeps its output tensor at higher precision:
4-bit error there moves every logit.
"""

from __future__ import annotations

import gguf
import torch

from minerva.errors import MinervaError

Q = gguf.GGMLQuantizationType
GROUP = 32
SCHEMES = {"int8": Q.Q8_0, "int4": Q.Q4_1}
ROWS_PER_SLAB = 2048  # bounds the float32 temporaries of one slab


def check_scheme(scheme: str | None) -> None:
    if scheme is not None and scheme not in SCHEMES:
        raise MinervaError(f"unknown --quantize '{scheme}'; choose int8 or int4")


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (C's roundf), as the reference quantizer does."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _fp16_bytes(x: torch.Tensor, name: str) -> torch.Tensor:
    h = x.to(torch.float16)
    if not torch.isfinite(h).all():
        raise MinervaError(f"tensor '{name}' has values too large for fp16 group scales; "
                           "load it without --quantize")
    return h.view(torch.uint8)


def _q8_0(blocks: torch.Tensor, name: str) -> torch.Tensor:
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    qs = _roundf(blocks * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([_fp16_bytes(d, name), qs], dim=1)


def _q4_1(blocks: torch.Tensor, name: str) -> torch.Tensor:
    hi = blocks.amax(dim=1, keepdim=True)
    lo = blocks.amin(dim=1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    qs = torch.trunc((blocks - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
    qs = qs[:, :GROUP // 2] | (qs[:, GROUP // 2:] << 4)  # element j low nibble, j + 16 high
    return torch.cat([_fp16_bytes(d, name), _fp16_bytes(lo, name), qs], dim=1)


_QUANTIZERS = {Q.Q8_0: _q8_0, Q.Q4_1: _q4_1}


def qtype_for(scheme: str, name: str) -> gguf.GGMLQuantizationType:
    """The block type a tensor gets under `scheme` (embedding and head stay int8)."""
    if name in ("embed_tokens", "lm_head"):
        return Q.Q8_0
    return SCHEMES[scheme]


def quantizable(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and shape[1] % GROUP == 0


def quantize(weight: torch.Tensor, qtype: gguf.GGMLQuantizationType, name: str = "weight") -> torch.Tensor:
    """A float [rows, cols] tensor as packed blocks: uint8 [rows, cols / 32 * block bytes]."""
    rows, cols = weight.shape
    if cols % GROUP:
        raise MinervaError(f"tensor '{name}' has {cols} columns, not a multiple of {GROUP}; "
                           "it cannot be quantized group-wise")
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    out = torch.empty(rows, cols // GROUP * block_bytes, dtype=torch.uint8)
    fn = _QUANTIZERS[qtype]
    for r in range(0, rows, ROWS_PER_SLAB):
        slab = weight[r:r + ROWS_PER_SLAB].to("cpu", torch.float32)
        n = slab.shape[0]
        out[r:r + n] = fn(slab.reshape(-1, GROUP), name).reshape(n, -1)
    return out
