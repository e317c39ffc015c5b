"""minerva.formats.quant against the reference: the gguf package's numpy `gguf.quants.dequantize`.

Results must be bit-identical (compared as int32 views, so -0.0 != 0.0). The one
exception is the payload of NaNs, which no two float implementations agree on
(torch's fp16->fp32 conversion and CUDA both canonicalize it): where a NaN shows up,
only its position has to match.
"""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from minerva.errors import MinervaError
from minerva.formats.quant import QUANT_TYPES, dequantize, dequantize_rows, row_bytes
from tests.helpers.quant_blocks import bits, random_blocks

ALL_TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
             QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.MXFP4]

# Types the gguf package can quantize: blocks built from real-valued data.
GGUF_QUANTIZABLE = [QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.MXFP4]


def assert_matches_gguf(raw_np, qtype, shape, raw_t=None):
    ref = gguf_dequantize(raw_np, qtype).reshape(shape)
    out = dequantize(torch.from_numpy(raw_np) if raw_t is None else raw_t, qtype, shape)
    assert out.dtype == torch.float32 and tuple(out.shape) == tuple(shape)
    assert np.array_equal(bits(out.cpu().numpy()), bits(ref))


def test_table_covers_the_required_types_with_gguf_sizes():
    assert set(QUANT_TYPES) == set(ALL_TYPES)
    for qtype, info in QUANT_TYPES.items():
        assert (info.block_size, info.type_size) == GGML_QUANT_SIZES[qtype]


@pytest.mark.parametrize("blocks_per_row, rows", [(1, 1), (4, 7), (2, 16)])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_random_blocks_bit_identical_to_gguf_package(qtype, blocks_per_row, rows):
    """Random bytes with finite fp16 scales: bit-identical to gguf.quants.dequantize."""
    rng = np.random.default_rng([qtype.value, blocks_per_row, rows])
    block_size = GGML_QUANT_SIZES[qtype][0]
    cols = blocks_per_row * max(block_size, 32)  # plain float types: a few values per row
    raw = random_blocks(qtype, (rows, cols), rng)
    with np.errstate(all="ignore"):
        assert_matches_gguf(raw, qtype, (rows, cols))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_any_bytes_including_inf_nan_scales_match_gguf_package(qtype):
    """Fully random bytes (inf/NaN fp16 scales included) still match gguf: same values, same NaNs."""
    rng = np.random.default_rng(1000 + qtype.value)
    block_size = GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, (64, 2 * max(block_size, 32)), rng, finite=False)
    with np.errstate(all="ignore"):
        assert_matches_gguf(raw, qtype, (64, 2 * max(block_size, 32)))


@pytest.mark.parametrize("qtype", GGUF_QUANTIZABLE, ids=lambda t: t.name)
def test_blocks_quantized_by_gguf_package_roundtrip_identically(qtype):
    """Blocks made by gguf.quants.quantize from Gaussian data dequantize exactly like the gguf package."""
    rng = np.random.default_rng(2000 + qtype.value)
    data = (rng.standard_normal((5, 256)) * rng.uniform(0.01, 3, size=(5, 1))).astype(np.float32)
    data[0, :32] = 0.0  # an all-zero block
    raw = np.ascontiguousarray(gguf_quantize(data, qtype)).view(np.uint8)
    assert_matches_gguf(raw, qtype, data.shape)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q6_K, QT.F16], ids=lambda t: t.name)
def test_three_dimensional_shape_matches_gguf_package(qtype):
    rng = np.random.default_rng(3)
    shape = (2, 3, 2 * max(GGML_QUANT_SIZES[qtype][0], 32))
    raw = random_blocks(qtype, shape, rng)
    assert_matches_gguf(raw, qtype, shape)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0, QT.F32, QT.BF16], ids=lambda t: t.name)
def test_non_contiguous_and_misaligned_input(qtype):
    """Packed rows cut out of a wider buffer (row stride != row size, odd byte offset)."""
    rng = np.random.default_rng(4)
    cols = 2 * max(GGML_QUANT_SIZES[qtype][0], 32)
    raw = random_blocks(qtype, (5, cols), rng)
    wide = np.zeros((5, raw.shape[1] + 7), dtype=np.uint8)
    wide[:, 3:3 + raw.shape[1]] = raw
    raw_t = torch.from_numpy(wide)[:, 3:3 + raw.shape[1]]
    assert not raw_t.is_contiguous()
    assert_matches_gguf(raw, qtype, (5, cols), raw_t=raw_t)
    # a flat byte tensor at an odd storage offset
    flat = torch.from_numpy(np.concatenate([np.zeros(1, np.uint8), raw.ravel()]))[1:]
    assert_matches_gguf(raw, qtype, (5, cols), raw_t=flat)


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q5_K, QT.F16], ids=lambda t: t.name)
def test_memory_mapped_input(qtype, tmp_path):
    rng = np.random.default_rng(5)
    cols = 2 * max(GGML_QUANT_SIZES[qtype][0], 32)
    raw = random_blocks(qtype, (6, cols), rng)
    path = tmp_path / "tensor.bin"
    path.write_bytes(b"\x00" * 3 + raw.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="c", offset=3, shape=raw.shape)
    assert_matches_gguf(raw, qtype, (6, cols), raw_t=torch.from_numpy(mm))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q3_K, QT.MXFP4], ids=lambda t: t.name)
def test_dequantize_rows_of_gathered_packed_rows(qtype):
    """Embedding-style lookup: gather packed rows, dequantize only them."""
    rng = np.random.default_rng(6)
    cols = 2 * GGML_QUANT_SIZES[qtype][0]
    raw = torch.from_numpy(random_blocks(qtype, (10, cols), rng))
    assert raw.shape[1] == row_bytes(qtype, cols)
    ids = torch.tensor([[7, 0], [3, 7]])
    full = dequantize(raw, qtype, (10, cols))
    rows = dequantize_rows(raw[ids], qtype, cols)
    assert rows.shape == (2, 2, cols)
    assert torch.equal(rows.view(torch.int32), full[ids].view(torch.int32))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_runs_on_the_meta_device(qtype):
    """No numpy, no .cpu(): the whole computation traces on a device without data."""
    cols = 2 * max(GGML_QUANT_SIZES[qtype][0], 32)
    raw = torch.empty((3, row_bytes(qtype, cols)), dtype=torch.uint8, device="meta")
    out = dequantize(raw, qtype, (3, cols))
    assert out.device.type == "meta" and out.shape == (3, cols) and out.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_bit_identical_to_gguf_package(qtype):
    rng = np.random.default_rng(7)
    cols = 4 * max(GGML_QUANT_SIZES[qtype][0], 32)
    raw = random_blocks(qtype, (9, cols), rng)
    assert_matches_gguf(raw, qtype, (9, cols), raw_t=torch.from_numpy(raw).cuda())


@pytest.mark.parametrize("qtype", [QT.Q8_K, QT.IQ2_XXS, QT.IQ4_NL, QT.I32, 9999], ids=str)
def test_unsupported_type_is_a_minerva_error(qtype):
    raw = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(MinervaError) as err:
        dequantize(raw, qtype, (1, 256))
    msg = str(err.value)
    assert "\n" not in msg
    assert getattr(qtype, "name", str(qtype)) in msg and "Q4_K" in msg and "MXFP4" in msg


def test_wrong_sizes_are_minerva_errors():
    with pytest.raises(MinervaError, match="block size"):
        dequantize(torch.zeros(18, dtype=torch.uint8), QT.Q4_0, (1, 16))
    with pytest.raises(MinervaError, match="needs 36 bytes"):
        dequantize(torch.zeros(18, dtype=torch.uint8), QT.Q4_0, (2, 32))
