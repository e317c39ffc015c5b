"""8-bit activations (`--activations int8`): what the integer-dot-product matmul does to x.

Each row of x is quantized on its own, in blocks as llama.cpp quantizes activations for
its dot products: 32 values against the 32-weight block types (its Q8_0), 256 against the
K-quants' super-blocks (its Q8_K, so a super-block's integer sums need one float scale).
Per block d = max|x| / 127, q = round(x / d) (x times the float32 reciprocal 1 / d, rounded
to nearest even), x̃ = d * q. The packed kernels
(csrc/q8_matmul.cpp and the q8_* files beside it) multiply the weights by x̃ with exact integer dot products per
block; this module is their plain-torch counterpart: the tests' reference, and what the
reference path runs when no kernel covers a weight, so a flag means the same numbers on
every path.

Weights in float formats (F32, F16, BF16) keep float activations: an int8 path gains
nothing there.
"""

from __future__ import annotations

import gguf
import torch

from minerva.errors import MinervaError

BLOCK = 32
K_BLOCK = 256
MODES = ("float", "int8")
Q = gguf.GGMLQuantizationType
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
K_TYPES = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise MinervaError(f"--activations must be auto or one of {', '.join(MODES)}, got {mode!r}")


def applies(qtype) -> bool:
    """Whether `--activations int8` changes a weight of this GGML type (quantized ones)."""
    return qtype not in FLOAT_TYPES


def block_for(qtype) -> int:
    """The activation block a weight of this GGML type multiplies: 256 for K-quants, else 32."""
    return K_BLOCK if qtype in K_TYPES else BLOCK


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of block) -> (q int8 [..., K], d float32 [..., K / block])."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp_(-127, 127)
    return q.to(torch.int8).reshape(x.shape), d


def dequantize(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x̃ = d * q in float32 (the block is K / d's last dimension)."""
    block = q.shape[-1] // d.shape[-1]
    blocks = q.float().reshape(*q.shape[:-1], d.shape[-1], block)
    return (blocks * d.unsqueeze(-1)).reshape(q.shape)


def round_trip(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """x̃ as float32: the activations an int8 matmul multiplies."""
    return dequantize(*quantize(x, block))
