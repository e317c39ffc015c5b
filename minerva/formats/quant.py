"""Reference dequantization of GGML tensor types, in plain vectorized torch.

Every function here is bit-identical to the numpy reference in the `gguf` package
(`gguf.quants.dequantize`): the float32 operations are done in the same order,
with the same operands, so that a fast kernel can be tested against this module
with `torch.equal`. Integer unpacking is exact, so only the float ops
(scale products, `d * q - m`) need to follow the reference.

Formats are data: `QUANT_TYPES` maps each supported `gguf.GGMLQuantizationType`
to its block size, its byte size per block and its block dequantizer. A block
dequantizer takes a uint8 tensor (n_blocks, type_size) and returns float32
(n_blocks, block_size). Nothing here leaves the input's device, and there is no
Python loop over blocks. Byte fields are read as little-endian (like GGUF files
and every platform torch runs on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import gguf
import torch

from minerva.errors import MinervaError

QT = gguf.GGMLQuantizationType
QK_K = gguf.QK_K  # 256, the K-quant super-block size


# --- helpers -------------------------------------------------------------------


def _view(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the bytes of `x` (last dim) as `dtype`; copies when the layout demands it."""
    x = x.contiguous()
    ratio = dtype.itemsize // x.dtype.itemsize
    if ratio > 1 and x.storage_offset() % ratio:
        x = x.clone()  # fresh storage, offset 0
    return x.view(dtype)


def _f16(field: torch.Tensor) -> torch.Tensor:
    """A 2-byte fp16 field (n, 2) -> float32 (n, 1)."""
    return _view(field, torch.float16).float()


def _bits(x: torch.Tensor, shifts: range | tuple[int, ...], mask: int) -> torch.Tensor:
    """(..., k) uint8 -> (..., len(shifts), k): `(x >> s) & mask` for each shift `s`."""
    return torch.stack([(x >> s) & mask for s in shifts], dim=-2)


def _nibbles(x: torch.Tensor) -> torch.Tensor:
    """(..., k) uint8 -> (..., 2k): all low nibbles, then all high nibbles."""
    return _bits(x, (0, 4), 0x0F).flatten(-2)


def _split(blocks: torch.Tensor, *sizes: int) -> list[torch.Tensor]:
    """Split (n, type_size) blocks into fields of the given byte sizes (last one takes the rest)."""
    return list(torch.split(blocks, [*sizes, blocks.shape[-1] - sum(sizes)], dim=-1))


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes of packed 6-bit (scale, min) pairs -> two (n, 8) uint8 tensors."""
    d, m, m_d = scales.reshape(-1, 3, 4).unbind(-2)
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


# --- one function per format: (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32 ---


def _dq_f32(blocks: torch.Tensor) -> torch.Tensor:
    return _view(blocks, torch.float32).clone()  # clone: never alias the (maybe read-only) input


def _dq_f16(blocks: torch.Tensor) -> torch.Tensor:
    return _view(blocks, torch.float16).float()


def _dq_bf16(blocks: torch.Tensor) -> torch.Tensor:
    return (_view(blocks, torch.int16).to(torch.int32) << 16).view(torch.float32)


def _dq_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = _split(blocks, 2)
    q = _nibbles(qs).to(torch.int8) - 8
    return _f16(d) * q.float()


def _dq_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, qs = _split(blocks, 2, 2)
    return (_f16(d) * _nibbles(qs).float()) + _f16(m)


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: 4 bytes of high bits (little-endian uint32) + 16 bytes of nibbles -> (n, 32) in 0..31."""
    high = _bits(qh, range(8), 1).transpose(-1, -2).flatten(-2)  # bit i of the uint32, i = 0..31
    return _nibbles(qs) | (high << 4)


def _dq_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qh, qs = _split(blocks, 2, 4)
    q = _q5_values(qh, qs).to(torch.int8) - 16
    return _f16(d) * q.float()


def _dq_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, qh, qs = _split(blocks, 2, 2, 4)
    return (_f16(d) * _q5_values(qh, qs).float()) + _f16(m)


def _dq_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = _split(blocks, 2)
    return qs.view(torch.int8).float() * _f16(d)


def _dq_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs, d, dmin = _split(blocks, QK_K // 16, QK_K // 4, 2)
    dl = (_f16(d) * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (_f16(dmin) * (scales >> 4).float()).reshape(n, 16, 1)
    q = _bits(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _dq_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales, d = _split(blocks, QK_K // 8, QK_K // 4, 12)
    low = _nibbles(scales[:, :8])  # (n, 16)
    high = _bits(scales[:, 8:], (0, 2, 4, 6), 3).reshape(n, 16)
    sc = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_f16(d) * sc).reshape(n, 16, 1)
    ql = _bits(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16)
    qh = _bits(hmask, range(8), 1).reshape(n, 16, 16) ^ 1  # the -4 offset applies when the bit is 0
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _k_scales(d: torch.Tensor, dmin: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: per-sub-block scale and min, (n, 8, 1) float32 each."""
    sc, mn = _k_scale_min(scales)
    return (_f16(d) * sc.float()).unsqueeze(-1), (_f16(dmin) * mn.float()).unsqueeze(-1)


def _dq_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, scales, qs = _split(blocks, 2, 2, 12)
    dl, ml = _k_scales(d, dmin, scales)
    q = _nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (dl * q - ml).reshape(n, QK_K)


def _dq_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, scales, qh, qs = _split(blocks, 2, 2, 12, QK_K // 8)
    dl, ml = _k_scales(d, dmin, scales)
    ql = _nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32)
    high = _bits(qh, range(8), 1)  # (n, 8, 32)
    q = (ql | (high << 4)).float()
    return (dl * q - ml).reshape(n, QK_K)


def _dq_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales, d = _split(blocks, QK_K // 2, QK_K // 4, QK_K // 16)
    dl = (_f16(d) * scales.view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(ql.reshape(n, 2, 64)).reshape(n, 8, 32)
    high = _bits(qh.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (dl * q).reshape(n, QK_K)


_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled


def _dq_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    e, qs = _split(blocks, 1)
    # e8m0 exponent -> float32 scale, halved (ggml_e8m0_to_fp32_half)
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    kvalues = torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=blocks.device)
    return d * kvalues[_nibbles(qs).long()]


# --- the table and the entry points ------------------------------------------


@dataclass(frozen=True)
class QuantType:
    """One GGML tensor type: `block_size` values are stored in `type_size` bytes."""

    block_size: int
    type_size: int
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]


def _entry(qtype: QT, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[QT, QuantType]:
    return qtype, QuantType(*gguf.GGML_QUANT_SIZES[qtype], fn)


QUANT_TYPES: dict[QT, QuantType] = dict([
    _entry(QT.F32, _dq_f32),
    _entry(QT.F16, _dq_f16),
    _entry(QT.BF16, _dq_bf16),
    _entry(QT.Q4_0, _dq_q4_0),
    _entry(QT.Q4_1, _dq_q4_1),
    _entry(QT.Q5_0, _dq_q5_0),
    _entry(QT.Q5_1, _dq_q5_1),
    _entry(QT.Q8_0, _dq_q8_0),
    _entry(QT.Q2_K, _dq_q2_k),
    _entry(QT.Q3_K, _dq_q3_k),
    _entry(QT.Q4_K, _dq_q4_k),
    _entry(QT.Q5_K, _dq_q5_k),
    _entry(QT.Q6_K, _dq_q6_k),
    _entry(QT.MXFP4, _dq_mxfp4),
])


def quant_type(qtype: QT | int) -> QuantType:
    """The table entry for `qtype`, or a MinervaError naming it and the supported types."""
    try:
        qtype = QT(qtype)
        return QUANT_TYPES[qtype]
    except (ValueError, KeyError):
        name = getattr(qtype, "name", f"type id {qtype}")
        supported = ", ".join(t.name for t in QUANT_TYPES)
        raise MinervaError(f"unsupported GGML tensor type {name}; supported: {supported}") from None


def row_bytes(qtype: QT | int, cols: int) -> int:
    """Bytes taken by one row of `cols` values of type `qtype`."""
    qt = quant_type(qtype)
    if cols % qt.block_size:
        raise MinervaError(
            f"row of {cols} values is not a multiple of the {QT(qtype).name} block size ({qt.block_size})"
        )
    return cols // qt.block_size * qt.type_size


def dequantize(raw: torch.Tensor, qtype: QT | int, shape: tuple[int, ...]) -> torch.Tensor:
    """Dequantize the packed bytes `raw` of a tensor of logical `shape` (torch order) to float32.

    `raw` is a uint8 tensor of any shape holding exactly the tensor's bytes (e.g. rows x
    bytes_per_row; non-contiguous and memory-mapped inputs are fine). The result is a new
    float32 tensor of `shape` on `raw`'s device, bit-identical to `gguf.quants.dequantize`.
    """
    if raw.dtype != torch.uint8:
        raise TypeError(f"dequantize expects a uint8 tensor of packed bytes, got {raw.dtype}")
    qt = quant_type(qtype)
    shape = tuple(int(s) for s in shape)
    rows = math.prod(shape[:-1])
    expected = rows * row_bytes(qtype, shape[-1]) if shape else -1
    if raw.numel() != expected:
        raise MinervaError(
            f"{QT(qtype).name} tensor of shape {shape} needs {expected} bytes, got {raw.numel()}"
        )
    blocks = raw.reshape(-1, qt.type_size)
    return qt.dequantize_blocks(blocks).reshape(shape)


def dequantize_rows(raw_rows: torch.Tensor, qtype: QT | int, cols: int) -> torch.Tensor:
    """Dequantize packed rows (..., row_bytes) to float32 (..., cols).

    Handy for embedding lookups: gather the packed rows first (`raw[token_ids]`), then
    dequantize only those.
    """
    return dequantize(raw_rows, qtype, (*raw_rows.shape[:-1], cols))


def mxfp4_from_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as the published SafeTensors checkpoints store it (GPT-OSS's `*_blocks`
    [..., groups, 16] and `*_scales` [..., groups], uint8) -> GGML MXFP4 rows [..., groups * 17].

    Both hold 32 E2M1 values per block with one E8M0 exponent byte, and mean the same numbers:
    the checkpoints put elements 2j and 2j + 1 in the low and high nibble of byte j and scale
    by 2^(e - 127); GGML puts elements j and j + 16 there and scales its doubled values by
    2^(e - 128). Only the nibbles move.
    """
    low, high = blocks & 0x0F, blocks >> 4
    values = torch.stack([low, high], dim=-1).flatten(-2)  # element i of each block of 32
    ggml = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), ggml], dim=-1).flatten(-2)
