"""The 32-weight block types regrouped for the int8 kernels: 8 rows' blocks side by side.

Q4_0, Q4_1, Q5_0 and Q5_1 matrices that multiply 8-bit activations (`--activations int8`)
are regrouped once at load, as llama.cpp repacks Q4_0 for its CPU kernels: rows go in
groups of 8 (the last group padded with zero rows), and a group's block g holds its 8 rows'
block g together, in the same bytes as the 8 GGML blocks:

    d[8] (f16) | m[8] (f16; Q4_1, Q5_1) | qh[8] (u32; Q5_0, Q5_1) | qs[128]

qs chunk k (bytes 4k .. 4k + 3 of a row's 16: the low nibbles are weights 4k .. 4k + 3, the
high ones 16 + 4k .. 16 + 4k + 3) of row j sits at 32k + 4j, so one 32-byte load gives the
same 4 bytes of all 8 rows, one row per 32-bit lane, and a dot product against 4 bytes of x
broadcast to every lane sums each row in its own lane: no horizontal sums, and the 8 scales
are one load. A row's fifth bits are moved within its u32 so that for chunk k a shift puts
them at bit 4 of each byte: weight 4k + b (b = 0..3) at bit 8b + 4 + k, weight 16 + 4k + b
at bit 8b + k.

The kernels (`X8` in csrc/qmatmul_q8.cpp) take the type id with `REGROUPED` set. The
integer dot products and the float operations per output are those of the GGML layout, so
the results are bit-identical. `restore` gives the GGML bytes back (tests, and row lookups).
"""

from __future__ import annotations

import gguf
import torch

Q = gguf.GGMLQuantizationType
REGROUPED = 0x100  # added to the GGML type id of a regrouped matrix
GROUP = 8
# GGML block bytes, whether it has an f16 offset m, whether it has 32 fifth bits
TYPES = {Q.Q4_0: (18, False, False), Q.Q4_1: (20, True, False), Q.Q5_0: (22, False, True),
         Q.Q5_1: (24, True, True)}


def _bit_moves() -> list[tuple[int, int]]:
    """(bit in GGML's qh, bit in the regrouped u32) for the 32 weights of a block."""
    moves = []
    for k in range(4):
        for b in range(4):
            moves.append((4 * k + b, 8 * b + 4 + k))
            moves.append((16 + 4 * k + b, 8 * b + k))
    return moves


def _move_bits(qh: torch.Tensor, inverse: bool) -> torch.Tensor:
    """qh [..., 4] bytes (a little-endian u32 each) with every bit moved as `_bit_moves` says."""
    v = qh.to(torch.int64)
    word = v[..., 0] | (v[..., 1] << 8) | (v[..., 2] << 16) | (v[..., 3] << 24)
    out = torch.zeros_like(word)
    for src, dst in _bit_moves():
        if inverse:
            src, dst = dst, src
        out |= ((word >> src) & 1) << dst
    return torch.stack([(out >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8)


def rows_padded(rows: int) -> int:
    return -(-rows // GROUP) * GROUP


def regroup(packed: torch.Tensor, qtype, rows: int, cols: int) -> torch.Tensor:
    """GGML bytes [rows, row bytes] -> the regrouped bytes [rows rounded up to 8, row bytes]."""
    size, offset, fifth = TYPES[Q(qtype)]
    blocks = cols // 32
    b = packed.reshape(rows, blocks, size)
    if rows % GROUP:
        b = torch.cat([b, b.new_zeros(rows_padded(rows) - rows, blocks, size)])
    n = b.shape[0] // GROUP
    b = b.reshape(n, GROUP, blocks, size).transpose(1, 2)  # [group, block, row, bytes]
    parts = [b[..., 0:2]]
    at = 2
    if offset:
        parts.append(b[..., 2:4])
        at = 4
    if fifth:
        parts.append(_move_bits(b[..., at:at + 4], inverse=False))
        at += 4
    parts = [p.reshape(n, blocks, -1) for p in parts]
    qs = b[..., at:at + 16].reshape(n, blocks, GROUP, 4, 4).transpose(2, 3)  # [.., chunk, row, 4]
    parts.append(qs.reshape(n, blocks, -1))
    return torch.cat(parts, -1).reshape(n * GROUP, blocks * size)


def restore(regrouped: torch.Tensor, qtype, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `regroup`: GGML bytes [rows, row bytes]."""
    size, offset, fifth = TYPES[Q(qtype)]
    blocks = cols // 32
    n = regrouped.shape[0] // GROUP
    b = regrouped.reshape(n, blocks, GROUP * size)
    parts = [b[..., 0:16].reshape(n, blocks, GROUP, 2)]
    at = 16
    if offset:
        parts.append(b[..., at:at + 16].reshape(n, blocks, GROUP, 2))
        at += 16
    if fifth:
        parts.append(_move_bits(b[..., at:at + 32].reshape(n, blocks, GROUP, 4), inverse=True))
        at += 32
    qs = b[..., at:at + 128].reshape(n, blocks, 4, GROUP, 4).transpose(2, 3)  # [.., row, chunk, 4]
    parts.append(qs.reshape(n, blocks, GROUP, 16))
    out = torch.cat(parts, -1).transpose(1, 2).reshape(n * GROUP, blocks * size)
    return out[:rows].contiguous()
