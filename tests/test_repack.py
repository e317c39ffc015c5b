"""Q4_0/Q4_1/Q5_0/Q5_1 regrouped for the int8 kernels (`minerva.kernels.repack`): the layout
round-trips, and the kernels on it give the GGML layout's results bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from minerva.kernels import native, repack
from tests.helpers.quant_blocks import realistic_blocks
from tests.test_act_quant import needs_kernels, sample_x

TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]


@pytest.fixture(scope="module")
def kernels():
    mod = native.load()
    assert mod is not None, f"the CPU supports the kernels but they did not load: {native.unavailable_reason}"
    return mod


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [8, 13, 40])
def test_regroup_round_trips_and_pads_to_groups_of_8(qtype, rows):
    size = repack.TYPES[qtype][0]
    packed = torch.randint(0, 256, (rows, 3 * size), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    regrouped = repack.regroup(packed, qtype, rows, 96)
    assert regrouped.shape == (-(-rows // 8) * 8, 3 * size)
    assert torch.equal(repack.restore(regrouped, qtype, rows, 96), packed)
    assert not repack.restore(regrouped, qtype, regrouped.shape[0], 96)[rows:].any()  # padded with zero rows


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_layout_of_a_group(qtype):
    """Block g of a group: the 8 rows' scales, then qs chunk k of row j at 32k + 4j; the fifth
    bit of weight 4k + b at bit 8b + 4 + k of the row's u32, of weight 16 + 4k + b at 8b + k."""
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(realistic_blocks(qtype, 8, 64, rng))
    size, offset, fifth = repack.TYPES[qtype]
    out = repack.regroup(raw, qtype, 8, 64).reshape(2, 8 * size)  # blocks g = 0, 1 of the group
    qs_at = 2 + 2 * offset + 4 * fifth
    for g in range(2):
        b = out[g]
        for j in range(8):
            ggml = raw[j, g * size:(g + 1) * size]
            assert torch.equal(b[2 * j:2 * j + 2], ggml[0:2])  # d
            if offset:
                assert torch.equal(b[16 + 2 * j:18 + 2 * j], ggml[2:4])  # m
            at = 16 * (1 + offset)
            if fifth:
                qh = int.from_bytes(bytes(ggml[qs_at - 4:qs_at].tolist()), "little")
                word = int.from_bytes(bytes(b[at + 4 * j:at + 4 * j + 4].tolist()), "little")
                for k in range(4):
                    for bb in range(4):
                        assert (word >> (8 * bb + 4 + k)) & 1 == (qh >> (4 * k + bb)) & 1
                        assert (word >> (8 * bb + k)) & 1 == (qh >> (16 + 4 * k + bb)) & 1
                at += 32
            for k in range(4):
                assert torch.equal(b[at + 32 * k + 4 * j:at + 32 * k + 4 * j + 4], ggml[qs_at + 4 * k:qs_at + 4 * k + 4])


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [40, 37])
def test_regrouped_kernel_gives_the_ggml_layouts_bits(kernels, qtype, rows):
    rng = np.random.default_rng(3)
    raw = torch.from_numpy(realistic_blocks(qtype, rows, 512, rng))
    regrouped = repack.regroup(raw, qtype, rows, 512)
    x = sample_x(23, 512, seed=4)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            kernels.set_num_threads(n)
            for lo, hi in [(0, 1), (5, 6), (2, 5), (0, 4), (3, 10), (0, 23)]:
                want = kernels.qmatmul_q8(x[lo:hi], raw, int(qtype), rows, 512)
                got = kernels.qmatmul_q8(x[lo:hi], regrouped, int(qtype) | repack.REGROUPED, rows, 512)
                assert torch.equal(got, want), (n, lo, hi)
    finally:
        kernels.set_num_threads(0)
        torch.set_num_threads(threads)
    bf = x[:3].bfloat16()
    assert torch.equal(kernels.qmatmul_q8(bf, regrouped, int(qtype) | repack.REGROUPED, rows, 512),
                       kernels.qmatmul_q8(bf, raw, int(qtype), rows, 512))


@needs_kernels
def test_regrouped_arguments_are_checked(kernels):
    raw = torch.from_numpy(realistic_blocks(QT.Q4_0, 13, 64, np.random.default_rng(1)))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="bytes, expected"):  # 13 rows, not padded to 16
        kernels.qmatmul_q8(x, raw, int(QT.Q4_0) | repack.REGROUPED, 13, 64)
    with pytest.raises(RuntimeError, match="no regrouped layout"):
        kernels.qmatmul_q8(x, raw, int(QT.Q8_0) | repack.REGROUPED, 13, 64)


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_weight_regroups_and_still_looks_up_rows(kernels, qtype):
    from minerva.kernels.weights import PackedWeight
    raw = torch.from_numpy(realistic_blocks(qtype, 21, 128, np.random.default_rng(6)))
    plain = PackedWeight(raw, qtype, (21, 128), torch.float32)
    plain.use_int8_activations(regroup=False)
    w = PackedWeight(raw, qtype, (21, 128), torch.float32)
    w.use_int8_activations()
    assert w.regrouped and not plain.regrouped and w.qtype_id == int(qtype) | repack.REGROUPED
    x = sample_x(5, 128)
    assert torch.equal(w.matmul(x), plain.matmul(x))
    ids = torch.tensor([[0, 20, 7], [8, 8, 15]])
    dense = torch.from_numpy(gguf_dequantize(raw.numpy(), qtype).reshape(21, 128))
    assert torch.equal(w.rows(ids), dense[ids])
    w.kernel = None  # the reference path dequantizes the GGML bytes back
    w.materialize()
    assert torch.equal(w._dense, dense)


@needs_kernels
@pytest.mark.slow
def test_model_logits_are_the_same_regrouped_or_not(smollm2_gguf, monkeypatch):
    """SmolLM2's Q4_1 layers regrouped (its tied Q8_0 embedding and head are not) give the
    same logits, bit for bit, through the fused C++ layers."""
    from minerva.kernels.weights import PackedWeight
    from minerva.models.layers import Linear
    from minerva.models.loader import load_model
    from tests.helpers.paged import paged_logits

    ids = [int(i) for i in torch.randint(1000, 40000, (40,), generator=torch.Generator().manual_seed(1))]
    model = load_model(smollm2_gguf, activations="int8").model
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, Linear)}.values()
    regrouped = [w for w in weights if isinstance(w, PackedWeight) and w.regrouped]
    assert len(regrouped) == 30 * 4  # qkv, o, gate_up, down (fused); Q4_1
    assert not model.embed.regrouped
    assert all(layer.fused is not None for layer in model.layers)
    got = paged_logits(model, ids, chunk=16)
    monkeypatch.setattr(repack, "TYPES", {})
    plain = load_model(smollm2_gguf, activations="int8").model
    assert not any(getattr(m.weight, "regrouped", False) for m in plain.modules() if isinstance(m, Linear))
    assert torch.equal(got, paged_logits(plain, ids, chunk=16))
