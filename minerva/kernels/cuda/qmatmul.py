"""y = x W^T with W in a packed GGML format, decoded in registers (Triton).

W is the matrix's GGUF bytes as stored, [rows, row_bytes] uint8 on the device. A program
computes a BLOCK_M x BLOCK_N tile of y: for each BLOCK_K slice of the row it loads x's
tile, decodes the weights' tile from their blocks (each element from its block's bytes:
its quant bits, its scale and, for the types that have one, its min) and adds
`tl.dot(x, w^T)` to a float32 accumulator. The decoding does the float operations of the
reference (`minerva.formats.quant`) in the same order, so `dequantize_rows` here gives its
bits under the interpreter; the matmul rounds the decoded weights to x's dtype for `tl.dot`.

This is the general tiled path: every element's bytes are addressed on their own, which
is simple and right for every format, and leaves the GPU's speed (wide loads, a skinny
decode path, split-K) to be tuned where one is at hand.
"""

from __future__ import annotations

import gguf
import torch
import triton
import triton.language as tl

from minerva.errors import MinervaError

Q = gguf.GGMLQuantizationType
# the GGML types decoded here, by id (the kernels branch on it as a compile-time constant)
TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})


@triton.jit
def _f16_at(w_ptr, off):
    """The little-endian float16 at byte offsets `off`, as float32."""
    lo = tl.load(w_ptr + off).to(tl.uint16)
    hi = tl.load(w_ptr + off + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(w_ptr, off):
    return tl.load(w_ptr + off).to(tl.int32)


@triton.jit
def _nibble32(w_ptr, qs, e):
    """Blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1): element e's 4 low bits, the low nibble of byte
    e of qs for e < 16, the high nibble of byte e - 16 after."""
    b = _byte(w_ptr, qs + (e % 16))
    return tl.where(e < 16, b & 15, b >> 4)


@triton.jit
def _k_scale_min(w_ptr, sc_at, j):
    """Q4_K/Q5_K: sub-block j's 6-bit scale and min from the 12 bytes at sc_at (as
    quant._k_scale_min)."""
    lo = j % 4
    d = _byte(w_ptr, sc_at + lo)
    m = _byte(w_ptr, sc_at + 4 + lo)
    md = _byte(w_ptr, sc_at + 8 + lo)
    sc = tl.where(j < 4, d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30))
    mn = tl.where(j < 4, m & 0x3F, (md >> 4) | ((m >> 2) & 0x30))
    return sc, mn


@triton.jit
def _decode(w_ptr, row, k, QT: tl.constexpr):
    """Weights [rows, k] as float32: row the byte offsets of the rows [N, 1] (int64), k the
    element indices [1, K] within a row."""
    if QT == 2:  # Q4_0: d | qs[16]; d (q - 8)
        at = row + (k // 32) * 18
        e = k % 32
        return _f16_at(w_ptr, at) * (_nibble32(w_ptr, at + 2, e) - 8).to(tl.float32)
    elif QT == 3:  # Q4_1: d | m | qs[16]; d q + m
        at = row + (k // 32) * 20
        e = k % 32
        return _f16_at(w_ptr, at) * _nibble32(w_ptr, at + 4, e).to(tl.float32) + _f16_at(w_ptr, at + 2)
    elif QT == 6:  # Q5_0: d | qh (u32) | qs[16]; d (q - 16)
        at = row + (k // 32) * 22
        e = k % 32
        high = (_byte(w_ptr, at + 2 + e // 8) >> (e % 8)) & 1
        q = _nibble32(w_ptr, at + 6, e) | (high << 4)
        return _f16_at(w_ptr, at) * (q - 16).to(tl.float32)
    elif QT == 7:  # Q5_1: d | m | qh | qs[16]; d q + m
        at = row + (k // 32) * 24
        e = k % 32
        high = (_byte(w_ptr, at + 4 + e // 8) >> (e % 8)) & 1
        q = _nibble32(w_ptr, at + 8, e) | (high << 4)
        return _f16_at(w_ptr, at) * q.to(tl.float32) + _f16_at(w_ptr, at + 2)
    elif QT == 8:  # Q8_0: d | qs[32] (int8); q d
        at = row + (k // 32) * 34
        q = tl.load(w_ptr + at + 2 + k % 32).to(tl.int8, bitcast=True)
        return q.to(tl.float32) * _f16_at(w_ptr, at)
    elif QT == 12 or QT == 13:  # Q4_K/Q5_K: d | dmin | scales[12] | (qh[32]) | qs[128]
        size: tl.constexpr = 144 if QT == 12 else 176
        at = row + (k // 256) * size
        e = k % 256
        j = e // 32  # sub-block: its nibbles are the low (j even) or high ones of qs[32 (j // 2) ..]
        sc, mn = _k_scale_min(w_ptr, at + 4, j)
        qs_at: tl.constexpr = 16 if QT == 12 else 48
        b = _byte(w_ptr, at + qs_at + 32 * (j // 2) + e % 32)
        q = tl.where(j % 2 == 0, b & 15, b >> 4)
        if QT == 13:
            q = q | (((_byte(w_ptr, at + 16 + e % 32) >> j) & 1) << 4)
        dl = _f16_at(w_ptr, at) * sc.to(tl.float32)
        ml = _f16_at(w_ptr, at + 2) * mn.to(tl.float32)
        return dl * q.to(tl.float32) - ml
    else:  # Q6_K: ql[128] | qh[64] | scales[16] (int8) | d
        tl.static_assert(QT == 14)
        at = row + (k // 256) * 210
        e = k % 256
        h = e // 128  # a half: 64 bytes of ql (its 128 low nibbles, then high), 32 of qh (2 bits each)
        r = e % 128
        b = _byte(w_ptr, at + 64 * h + r % 64)
        low = tl.where(r < 64, b & 15, b >> 4)
        high = (_byte(w_ptr, at + 128 + 32 * h + r % 32) >> (2 * (r // 32))) & 3
        q = (low | (high << 4)) - 32
        sc = tl.load(w_ptr + at + 192 + e // 16).to(tl.int8, bitcast=True).to(tl.float32)
        return (_f16_at(w_ptr, at + 208) * sc) * q.to(tl.float32)


@triton.jit
def _qmatmul_kernel(x_ptr, w_ptr, y_ptr, M, N, RB, stride_x, stride_y, K: tl.constexpr, QT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # K (a row's length) is a compile-time constant: one compiled kernel per row length, a few
    # per model; the interpreter cannot loop to a run-time bound on this numpy
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # rows past N read row N - 1 (their outputs are not stored): no masks on the weights
    row = tl.minimum(rn, N - 1).to(tl.int64)[:, None] * RB
    x_rows = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K
        k = k0 + rk
        x = tl.load(x_rows + k[None, :])
        w = _decode(w_ptr, row, k[None, :], QT)
        if x_ptr.dtype.element_ty == tl.float32:  # float32 products, not TF32's
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(w_ptr, out_ptr, N, K, RB, QT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row = tl.minimum(rn, N - 1).to(tl.int64)[:, None] * RB
    w = _decode(w_ptr, row, rk[None, :], QT)
    tl.store(out_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :], w, mask=rn[:, None] < N)


def _check(packed: torch.Tensor, qtype, rows: int, cols: int) -> Q:
    try:
        qtype = Q(qtype)
    except ValueError:
        raise MinervaError(f"no Triton kernel for GGML type id {qtype}") from None
    if qtype not in TYPES:
        raise MinervaError(f"no Triton kernel for GGML type {qtype.name}; it has: "
                           + ", ".join(sorted(t.name for t in TYPES)))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise MinervaError(f"a {qtype.name} row of {cols} values is not a multiple of its block of {block}")
    if packed.dtype != torch.uint8 or packed.shape != (rows, cols // block * size) or not packed.is_contiguous():
        raise MinervaError(f"packed {qtype.name} weights must be contiguous uint8 [{rows}, {cols // block * size}], "
                           f"got {packed.dtype} {tuple(packed.shape)}")
    return qtype


def qmatmul(x: torch.Tensor, packed: torch.Tensor, qtype, rows: int, cols: int) -> torch.Tensor:
    """x [M, cols] (float16, bfloat16 or float32) @ W^T -> [M, rows] in x's dtype."""
    qtype = _check(packed, qtype, rows, cols)
    if x.dim() != 2 or x.shape[1] != cols or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise MinervaError(f"x must be float16, bfloat16 or float32 [M, {cols}], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    M = x.shape[0]
    y = torch.empty(M, rows, dtype=x.dtype, device=x.device)
    if M == 0 or rows == 0:
        return y
    block_m, block_n, block_k = 16 if M <= 16 else 32, 32, 64 if cols % 64 == 0 else 32
    grid = (triton.cdiv(M, block_m), triton.cdiv(rows, block_n))
    _qmatmul_kernel[grid](x, packed, y, M, rows, packed.shape[1], x.stride(0), y.stride(0), K=cols, QT=int(qtype),
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def dequantize_rows(packed: torch.Tensor, qtype, cols: int) -> torch.Tensor:
    """The rows of W as float32 [rows, cols], bit for bit the reference's under the interpreter."""
    rows = packed.shape[0]
    qtype = _check(packed, qtype, rows, cols)
    out = torch.empty(rows, cols, dtype=torch.float32, device=packed.device)
    if rows:
        block_k = gguf.GGML_QUANT_SIZES[qtype][0]
        _dequantize_kernel[(triton.cdiv(rows, 16), cols // block_k)](packed, out, rows, cols, packed.shape[1],
                                                                    QT=int(qtype), BLOCK_N=16, BLOCK_K=block_k)
    return out
