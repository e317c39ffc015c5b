"""Q6_K regrouped in units of 16 rows (`minerva.kernels.repack`, csrc/q8_q6k.cpp) where the build has
AVX-512 VNNI: the layout round-trips, sits where the docs say, and the kernels on it give the GGML
layout's results bit for bit at one row of x, a few and many, on any number of threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from minerva.kernels import act_quant, repack
from tests.helpers.quant_blocks import realistic_blocks
from tests.kernels.test_act_quant import kernels, needs_kernels, sample_x  # noqa: F401 (kernels: a fixture)

Q6 = int(QT.Q6_K)
UNITS = Q6 | repack.REGROUPED


def needs_units(kernels):
    if not kernels.regroups_q6_k:
        pytest.skip("this build keeps Q6_K in the GGML layout (no AVX-512 VNNI)")


def blocks(rows, cols, seed):
    return torch.from_numpy(realistic_blocks(QT.Q6_K, rows, cols, np.random.default_rng(seed)))


@pytest.mark.parametrize("rows", [16, 13, 40])
def test_units_round_trip_and_pad_to_16_rows(rows):
    raw = torch.randint(0, 256, (rows, 2 * 210), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    units = repack.regroup(raw, QT.Q6_K, rows, 512)
    assert units.shape == (-(-rows // 16) * 16, 2 * 210) and repack.rows_padded(rows, QT.Q6_K) == units.shape[0]
    assert torch.equal(repack.restore(units, QT.Q6_K, rows, 512), raw)
    assert not repack.restore(units, QT.Q6_K, units.shape[0], 512)[rows:].any()  # zero rows


def test_layout_of_a_unit():
    """Super-block g of a unit at 3360 g: for part p and c = 0..7, at 1536 p + 192 c the 16 rows'
    ql bytes 64 p + 4 c .. + 3, then their ql bytes 64 p + 32 + 4 c .. + 3, then their qh bytes
    128 + 32 p + 4 c .. + 3 (row j's 4 bytes at 4 j of each 64); the scale bytes 4 k .. 4 k + 3 at
    3072 + 64 k + 4 j; d at 3328 + 2 j."""
    raw = blocks(16, 512, 1)
    out = repack.regroup(raw, QT.Q6_K, 16, 512).reshape(2, 3360)
    for g in range(2):
        u = out[g]
        for j in range(16):
            b = raw[j, 210 * g:210 * (g + 1)]
            for p in range(2):
                for c in range(8):
                    at = 1536 * p + 192 * c + 4 * j
                    assert torch.equal(u[at:at + 4], b[64 * p + 4 * c:64 * p + 4 * c + 4])
                    assert torch.equal(u[at + 64:at + 68], b[64 * p + 32 + 4 * c:64 * p + 36 + 4 * c])
                    assert torch.equal(u[at + 128:at + 132], b[128 + 32 * p + 4 * c:132 + 32 * p + 4 * c])
            for k in range(4):
                assert torch.equal(u[3072 + 64 * k + 4 * j:3076 + 64 * k + 4 * j], b[192 + 4 * k:196 + 4 * k])
            assert torch.equal(u[3328 + 2 * j:3330 + 2 * j], b[208:210])


@needs_kernels
@pytest.mark.parametrize("rows", [16, 13, 40])
def test_compiled_regroup_matches_the_torch_one_in_place(kernels, rows):
    raw = blocks(rows, 512, rows)
    work = raw.clone()
    got = repack.regroup_in_place(work, QT.Q6_K, rows, 512, kernels)
    assert torch.equal(got, repack.regroup(raw, QT.Q6_K, rows, 512))
    assert (got.data_ptr() == work.data_ptr()) == (rows % 16 == 0)  # no copy unless padding is needed


@needs_kernels
@pytest.mark.parametrize("rows, cols", [(40, 512), (37, 512), (264, 2048), (56, 1024), (60, 1024)])
def test_units_give_the_gguf_layouts_bits(kernels, rows, cols):
    """One row of x (the units' own kernel), a few and many (tile_panel's panels, decoded once
    from 128 rows): each the GGML layout's bits, whatever the batch or the threads, and within
    float32 rounding of float64. 40 rows end on a half-full unit, 37 on a short one, 264 on a
    work item of one unit; also qmatmul_q8_parts (a layer's Q/K/V in one loop),
    grouped_qmatmul_q8 (experts) and bf16 x."""
    needs_units(kernels)
    raw = blocks(rows, cols, rows)
    units = repack.regroup(raw, QT.Q6_K, rows, cols)
    x = sample_x(140, cols, seed=3)
    ggml = kernels.qmatmul_q8(x, raw, Q6, rows, cols)
    dense = torch.from_numpy(gguf_dequantize(raw.numpy(), QT.Q6_K).reshape(rows, cols)).double()
    expected = act_quant.round_trip(x, act_quant.block_for(QT.Q6_K)).double() @ dense.T
    assert (ggml.double() - expected).abs().max() / expected.abs().max() < 1e-6
    try:
        for n in (1, 2, 3):
            kernels.set_num_threads(n)
            for lo, hi in ((0, 1), (5, 6), (139, 140), (0, 2), (1, 5), (0, 8), (3, 12), (0, 127), (0, 140)):
                assert torch.equal(kernels.qmatmul_q8(x[lo:hi], units, UNITS, rows, cols), ggml[lo:hi]), (n, lo, hi)
    finally:
        kernels.set_num_threads(0)
    parts = kernels.qmatmul_q8_parts(x[4:5], [units, units], [UNITS, UNITS], [rows, rows], cols)
    assert torch.equal(parts, torch.cat([ggml[4:5]] * 2, 1))
    experts = kernels.grouped_qmatmul_q8(x[:9], [units] * 3, [0, 1, 1, 9], [torch.Tensor()] * 3, UNITS, rows, cols)
    assert torch.equal(experts, ggml[:9])
    bf = x[:3].bfloat16()
    assert torch.equal(kernels.qmatmul_q8(bf, units, UNITS, rows, cols),
                       kernels.qmatmul_q8(bf.float(), raw, Q6, rows, cols).bfloat16())


@needs_kernels
def test_units_arguments_are_checked(kernels):
    raw = blocks(13, 256, 1)
    if not kernels.regroups_q6_k:
        with pytest.raises(RuntimeError, match="no regrouped layout"):
            kernels.qmatmul_q8(torch.randn(1, 256), raw, UNITS, 13, 256)
        return
    with pytest.raises(RuntimeError, match="bytes, expected"):  # 13 rows, not padded to 16
        kernels.qmatmul_q8(torch.randn(1, 256), raw, UNITS, 13, 256)
    with pytest.raises(RuntimeError, match="a multiple of 16"):
        kernels.regroup_q6_k_(raw)


@needs_kernels
def test_packed_weight_regroups_q6_k_where_the_build_can_and_still_looks_up_rows(kernels):
    from minerva.kernels.weights import PackedWeight
    raw = blocks(21, 512, 6)
    w = PackedWeight(raw, QT.Q6_K, (21, 512), torch.float32)
    w.use_int8_activations()
    assert w.regrouped == bool(kernels.regroups_q6_k)
    x = sample_x(5, 512)
    assert torch.equal(w.matmul(x), kernels.qmatmul_q8(x, raw, Q6, 21, 512))
    ids = torch.tensor([[0, 20, 7], [8, 16, 15]])
    dense = torch.from_numpy(gguf_dequantize(raw.numpy(), QT.Q6_K).reshape(21, 512))
    assert torch.equal(w.rows(ids), dense[ids])
    w.kernel = None  # the reference path dequantizes the GGML bytes back
    w.materialize()
    assert torch.equal(w._dense, dense)
