"""Random packed GGML blocks, and float comparison by bits (for the dequantization tests)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import quantize as gguf_quantize

# Byte offsets of the fp16 scale fields inside one block (F16 itself: every value).
FP16_FIELDS = {
    QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2], QT.Q8_0: [0],
    QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208],
}


def _finite_fp16_bits(rng, n):
    """Random fp16 bit patterns (zeros, subnormals, both signs), none of them inf or NaN."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    all_ones_exp = (bits & 0x7C00) == 0x7C00
    return np.where(all_ones_exp, bits ^ 0x0400, bits).astype(np.uint16)


def random_blocks(qtype, shape, rng, finite=True):
    """Random packed bytes for a tensor of logical `shape`; fp16 fields finite unless `finite=False`."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    n_blocks = rows * shape[-1] // block_size
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if finite:
        if qtype == QT.F16:
            raw = _finite_fp16_bits(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        for off in FP16_FIELDS.get(qtype, []):
            raw[:, off:off + 2] = _finite_fp16_bits(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        if qtype == QT.MXFP4:  # E8M0 scales 2^-128 .. 2^71: products and sums stay finite
            raw[:, 0] = rng.integers(0, 200, size=n_blocks, dtype=np.uint8)
    return raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def bits(x):
    """int32 view with every NaN replaced by one canonical NaN pattern."""
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    return np.where(np.isnan(x), np.float32(np.nan), x).view(np.int32)


def realistic_blocks(qtype, rows, cols, rng):
    """Packed weights with the value ranges of real checkpoints (scales ~1e-2)."""
    if qtype in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.MXFP4):
        return gguf_quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    raw = random_blocks(qtype, (rows, cols), rng).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    for off in FP16_FIELDS[qtype]:
        raw[:, off:off + 2] = rng.uniform(1e-4, 2e-3, raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)
