"""Packed matrices regrouped for the int8 kernels: 8 rows' blocks side by side.

Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, Q8_0, Q2_K, Q3_K, Q4_K and Q5_K matrices that multiply 8-bit activations
(`--activations int8`) are regrouped once at load, as llama.cpp repacks Q4_0 and Q4_K for its
CPU kernels: rows go in groups of 8 (the last group padded with zero rows), and a group's
block g holds its 8 rows' block g together, in the same bytes as the 8 GGML blocks:

    blocks of 32:  d[8] (f16) | m[8] (f16; Q4_1, Q5_1) | qh[8] (u32; Q5_0, Q5_1) | qs[128]
    MXFP4:         e[8] (E8M0) | qs[128]
    Q8_0:          d[8] | qs[256] (signed bytes)
    Q4_K:          d[8] | dmin[8] | scales bytes 0-3 [8] | 4-7 [8] | 8-11 [8] | qs[1024]
    Q5_K:          as Q4_K, with qh[256] before qs
    Q3_K:          hmask[256] | qs[512] | scales bytes 0-11 [96] | d[8]
    Q2_K:          scale/min bytes 0-15 [128] | qs[512] | d[8] | dmin[8]

Q6_K, where the build has AVX-512 VNNI (`kernels.regroups_q6_k`), goes in units of 16 rows (the
last padded with zero rows), each super-block's bytes in the order one row of x reads them:

    Q6_K:          for part p = 0, 1 and c = 0..7: ql chunks 16p + c, 16p + 8 + c, qh chunk 8p + c
                   [64 each] | scales [256] | d[16]

a chunk being the 16 rows' 4 bytes side by side (csrc/q8_q6k.cpp). Elsewhere Q6_K stays in the
GGML layout, and for 8 or more rows of x the kernel regroups each panel of 32 rows into a
buffer of its own, in the layout Q3_K has here, before the integer dot products
(`matmul_panels`).

qs chunk k (bytes 4k .. 4k + 3 of a row's qs) of row j sits at 32k + 4j, so one 32-byte load
gives the same 4 bytes of all 8 rows, one row per 32-bit lane, and a dot product against 4
bytes of x broadcast to every lane sums each row in its own lane: no horizontal sums, and
the 8 scales are one load (Q4_K's and Q3_K's 6-bit scales unpack for 8 rows at once, Q2_K's
nibbles too). For the
blocks of 32, chunk k's low nibbles are weights 4k .. 4k + 3 and its high ones 16 + 4k ..
16 + 4k + 3 (Q8_0's chunk k is weights 4k .. 4k + 3, k = 0..7); a row's fifth bits are moved within its u32 so that for chunk k a shift puts
them at bit 4 of each byte: weight 4k + b (b = 0..3) at bit 8b + 4 + k, weight 16 + 4k + b
at bit 8b + k.

The kernels (`tile_x8` in csrc/q8_repack_x8.cpp, `tile_xk`, `tile_panel` in csrc/q8_repack_k.cpp) take the type id with
`REGROUPED` set. For Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 and Q3_K the integer dot products and the
float operations per output are those of the GGML layout, so the results are bit-identical; Q8_0, Q2_K, Q4_K and Q5_K sum a block
(super-block) of an output in one lane instead of eight, so their float rounding differs
(within float32 rounding of the exact product). Q8_0 gains the most: the GGML layout's kernel
spends a float conversion and two multiplies on every 32 products of each output, this one on
every 32 products of 8 outputs. `restore` gives the GGML bytes back (tests, and row lookups).
"""

from __future__ import annotations

import gguf
import torch

Q = gguf.GGMLQuantizationType
REGROUPED = 0x100  # added to the GGML type id of a regrouped matrix
GROUP = 8
# Each type's block as its fields in order, (bytes, how they are regrouped): "rows" puts the
# 8 rows' field side by side, "bits" does that after moving Q5's fifth bits, "chunks"
# interleaves the rows 4 bytes at a time.
FIELDS = {
    Q.Q4_0: [(2, "rows"), (16, "chunks")],
    Q.Q4_1: [(2, "rows"), (2, "rows"), (16, "chunks")],
    Q.MXFP4: [(1, "rows"), (16, "chunks")],  # the E8M0 exponent, then the nibbles
    Q.Q8_0: [(2, "rows"), (32, "chunks")],
    Q.Q5_0: [(2, "rows"), (4, "bits"), (16, "chunks")],
    Q.Q5_1: [(2, "rows"), (2, "rows"), (4, "bits"), (16, "chunks")],
    # d, dmin, the 12 bytes of 6-bit scales and mins as three u32, qs
    Q.Q4_K: [(2, "rows"), (2, "rows"), (4, "rows"), (4, "rows"), (4, "rows"), (128, "chunks")],
    # Q4_K's fields, then qh before qs
    Q.Q5_K: [(2, "rows"), (2, "rows"), (4, "rows"), (4, "rows"), (4, "rows"), (32, "chunks"), (128, "chunks")],
    # the GGML fields in their order: hmask, qs, the 12 bytes of 6-bit scales, d
    Q.Q3_K: [(32, "chunks"), (64, "chunks"), (12, "chunks"), (2, "rows")],
    # the GGML fields in their order: the 16 scale/min bytes, qs, d, dmin
    Q.Q2_K: [(16, "chunks"), (64, "chunks"), (2, "rows"), (2, "rows")],
}
TYPES = frozenset(FIELDS) | {Q.Q6_K}  # (Q6_K: regroup_q6 below)
UNIT = 16  # Q6_K's rows per unit
# regrouped types whose rows the kernels look up in place (`regrouped_rows`): a tied LM head of
# one of these is regrouped too, and the embedding reads its rows from that layout
LOOKUP_TYPES = frozenset({Q.Q8_0})


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


def group_rows(qtype) -> int:
    """The rows regrouped together: 8, or Q6_K's unit of 16."""
    return UNIT if Q(qtype) == Q.Q6_K else GROUP


def rows_padded(rows: int, qtype=None) -> int:
    n = GROUP if qtype is None else group_rows(qtype)
    return -(-rows // n) * n


def applies(kernel, qtype) -> bool:
    """Whether the compiled `kernel` module multiplies `qtype` regrouped (Q6_K: only where the
    build has AVX-512 VNNI)."""
    return (Q(qtype) in TYPES and hasattr(kernel, "regroup_")
            and (Q(qtype) != Q.Q6_K or bool(getattr(kernel, "regroups_q6_k", False))))


def _q6_parts(b: torch.Tensor) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """Q6_K blocks [unit, block, row (16), 210] as the unit's fields, each a view and the
    permutation that puts its dimensions in the regrouped order."""
    n, blocks = b.shape[:2]
    return [(b[..., :128].reshape(n, blocks, UNIT, 2, 2, 8, 4), (0, 1, 3, 5, 4, 2, 6)),  # ql: [p, c, half, row, 4]
            (b[..., 128:192].reshape(n, blocks, UNIT, 2, 8, 4), (0, 1, 3, 4, 2, 5)),  # qh: [p, c, row, 4]
            (b[..., 192:208].reshape(n, blocks, UNIT, 4, 4), (0, 1, 3, 2, 4)),  # scales: [chunk, row, 4]
            (b[..., 208:210], (0, 1, 2, 3))]  # d: [row, 2]


def regroup_q6(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Q6_K's GGML bytes [rows, row bytes] -> units of 16 rows [rows rounded up to 16, row bytes]."""
    blocks = cols // 256
    b = packed.reshape(rows, blocks, 210)
    if rows % UNIT:
        b = torch.cat([b, b.new_zeros(rows_padded(rows, Q.Q6_K) - rows, blocks, 210)])
    n = b.shape[0] // UNIT
    b = b.reshape(n, UNIT, blocks, 210).transpose(1, 2)
    ql, qh, sc, d = (f.permute(order) for f, order in _q6_parts(b))
    pc = torch.cat([ql.reshape(n, blocks, 2, 8, 2 * 64), qh.reshape(n, blocks, 2, 8, 64)], -1)
    return torch.cat([pc.reshape(n, blocks, 3072), sc.reshape(n, blocks, 256), d.reshape(n, blocks, 32)],
                     -1).reshape(n * UNIT, blocks * 210)


def restore_q6(regrouped: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `regroup_q6`."""
    blocks = cols // 256
    n = regrouped.shape[0] // UNIT
    u = regrouped.reshape(n, blocks, UNIT * 210)
    pc = u[..., :3072].reshape(n, blocks, 2, 8, 192)
    out = torch.empty(n, blocks, UNIT, 210, dtype=torch.uint8)
    sources = [pc[..., :128].reshape(n, blocks, 2, 8, 2, UNIT, 4), pc[..., 128:].reshape(n, blocks, 2, 8, UNIT, 4),
               u[..., 3072:3328].reshape(n, blocks, 4, UNIT, 4), u[..., 3328:].reshape(n, blocks, UNIT, 2)]
    for (view, order), src in zip(_q6_parts(out), sources):
        view.permute(order).copy_(src)
    return out.transpose(1, 2).reshape(n * UNIT, blocks * 210)[:rows].contiguous()


def _geometry(qtype, cols: int) -> tuple[list[tuple[int, str]], int, int]:
    fields = FIELDS[Q(qtype)]
    size = sum(w for w, _ in fields)
    return fields, size, cols // (256 if Q(qtype) in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32)


def regroup(packed: torch.Tensor, qtype, rows: int, cols: int) -> torch.Tensor:
    """GGML bytes [rows, row bytes] -> the regrouped bytes [rows rounded up to 8, row bytes]."""
    if Q(qtype) == Q.Q6_K:
        return regroup_q6(packed, rows, cols)
    fields, size, blocks = _geometry(qtype, cols)
    b = packed.reshape(rows, blocks, size)
    if rows % GROUP:
        b = torch.cat([b, b.new_zeros(rows_padded(rows) - rows, blocks, size)])
    n = b.shape[0] // GROUP
    b = b.reshape(n, GROUP, blocks, size).transpose(1, 2)  # [group, block, row, bytes]
    parts, at = [], 0
    for width, how in fields:
        f = b[..., at:at + width]
        if how == "bits":
            f = _move_bits(f, inverse=False)
        elif how == "chunks":  # [.., row, chunk, 4] -> [.., chunk, row, 4]
            f = f.reshape(n, blocks, GROUP, width // 4, 4).transpose(2, 3)
        parts.append(f.reshape(n, blocks, GROUP * width))
        at += width
    return torch.cat(parts, -1).reshape(n * GROUP, blocks * size)


_KINDS = {"rows": 0, "bits": 1, "chunks": 2}


def regroup_in_place(packed: torch.Tensor, qtype, rows: int, cols: int, kernel) -> torch.Tensor:
    """`regroup` by the compiled module (`kernel.regroup_`), in `packed`'s own memory when its
    rows are a multiple of 8 (a group's regrouped bytes fill exactly its rows' bytes), else in
    a copy padded with zero rows: no second copy of a large matrix, and a 7B model's matrices
    take well under a second instead of the seconds the torch version spends."""
    if rows % group_rows(qtype):
        packed = torch.cat([packed, packed.new_zeros(rows_padded(rows, qtype) - rows, packed.shape[1])])
    if Q(qtype) == Q.Q6_K:
        kernel.regroup_q6_k_(packed)
        return packed
    fields, size, _ = _geometry(qtype, cols)
    kernel.regroup_(packed, size, [v for w, how in fields for v in (w, _KINDS[how])],
                    [v for move in _bit_moves() for v in move])
    return packed


def restore(regrouped: torch.Tensor, qtype, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `regroup`: GGML bytes [rows, row bytes]."""
    if Q(qtype) == Q.Q6_K:
        return restore_q6(regrouped, rows, cols)
    fields, size, blocks = _geometry(qtype, cols)
    n = regrouped.shape[0] // GROUP
    b = regrouped.reshape(n, blocks, GROUP * size)
    parts, at = [], 0
    for width, how in fields:
        f = b[..., at:at + GROUP * width]
        if how == "chunks":
            f = f.reshape(n, blocks, width // 4, GROUP, 4).transpose(2, 3)
        f = f.reshape(n, blocks, GROUP, width)
        if how == "bits":
            f = _move_bits(f, inverse=True)
        parts.append(f)
        at += GROUP * width
    out = torch.cat(parts, -1).transpose(1, 2).reshape(n * GROUP, blocks * size)
    return out[:rows].contiguous()
