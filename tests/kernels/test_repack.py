"""Q4_0/Q4_1/Q5_0/Q5_1/MXFP4/Q3_K (and Q8_0, Q2_K, Q4_K, Q5_K) regrouped for the int8 kernels (`minerva.kernels.repack`):
the layout round-trips, and the kernels on it give the GGML layout's results bit for bit (Q8_0, Q2_K, Q4_K, Q5_K:
within float32 rounding of the exact products)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from minerva.kernels import act_quant, repack
from tests.helpers.quant_blocks import realistic_blocks
from tests.kernels.test_act_quant import kernels, needs_kernels, sample_x  # noqa: F401 (kernels: a fixture)

SMALL = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.MXFP4]  # blocks of 32: the GGML layout's bits exactly
BLOCKS_OF_32 = SMALL + [QT.Q8_0]
TYPES = BLOCKS_OF_32 + [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K]
EXACT = SMALL + [QT.Q3_K]  # the GGML layout's bits exactly


def block_size(qtype):
    return sum(width for width, _ in repack.FIELDS[qtype])


def block_weights(qtype):
    return 32 if qtype in BLOCKS_OF_32 else 256


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [8, 13, 40])
def test_regroup_round_trips_and_pads_to_groups_of_8(qtype, rows):
    size, cols = block_size(qtype), 3 * block_weights(qtype)
    assert size == GGML_QUANT_SIZES[qtype][1]
    packed = torch.randint(0, 256, (rows, 3 * size), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    regrouped = repack.regroup(packed, qtype, rows, cols)
    assert regrouped.shape == (-(-rows // 8) * 8, 3 * size)
    assert torch.equal(repack.restore(regrouped, qtype, rows, cols), packed)
    assert not repack.restore(regrouped, qtype, regrouped.shape[0], cols)[rows:].any()  # padded with zero rows


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [8, 13, 40])
def test_compiled_regroup_matches_the_torch_one_in_place(kernels, qtype, rows):
    size, cols = block_size(qtype), 3 * block_weights(qtype)
    packed = torch.randint(0, 256, (rows, 3 * size), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    expected = repack.regroup(packed, qtype, rows, cols)
    work = packed.clone()
    got = repack.regroup_in_place(work, qtype, rows, cols, kernels)
    assert torch.equal(got, expected)
    assert (got.data_ptr() == work.data_ptr()) == (rows % 8 == 0)  # no copy unless padding is needed


@pytest.mark.parametrize("qtype", BLOCKS_OF_32, ids=lambda t: t.name)
def test_layout_of_a_group(qtype):
    """Block g of a group: the 8 rows' scales (f16, or MXFP4's exponent byte), then qs chunk k
    (k < 4, Q8_0: k < 8) of row j at 32k + 4j; the fifth bit of weight 4k + b at bit 8b + 4 + k of the row's u32, of
    weight 16 + 4k + b at 8b + k."""
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(realistic_blocks(qtype, 8, 64, rng))
    size = block_size(qtype)
    offset, fifth = qtype in (QT.Q4_1, QT.Q5_1), qtype in (QT.Q5_0, QT.Q5_1)
    out = repack.regroup(raw, qtype, 8, 64).reshape(2, 8 * size)  # blocks g = 0, 1 of the group
    sw = 1 if qtype == QT.MXFP4 else 2  # bytes of a scale
    qs_at = sw + 2 * offset + 4 * fifth
    for g in range(2):
        b = out[g]
        for j in range(8):
            ggml = raw[j, g * size:(g + 1) * size]
            assert torch.equal(b[sw * j:sw * j + sw], ggml[0:sw])  # d
            if offset:
                assert torch.equal(b[16 + 2 * j:18 + 2 * j], ggml[2:4])  # m
            at = 8 * sw * (1 + offset)
            if fifth:
                qh = int.from_bytes(bytes(ggml[qs_at - 4:qs_at].tolist()), "little")
                word = int.from_bytes(bytes(b[at + 4 * j:at + 4 * j + 4].tolist()), "little")
                for k in range(4):
                    for bb in range(4):
                        assert (word >> (8 * bb + 4 + k)) & 1 == (qh >> (4 * k + bb)) & 1
                        assert (word >> (8 * bb + k)) & 1 == (qh >> (16 + 4 * k + bb)) & 1
                at += 32
            for k in range(8 if qtype == QT.Q8_0 else 4):
                assert torch.equal(b[at + 32 * k + 4 * j:at + 32 * k + 4 * j + 4], ggml[qs_at + 4 * k:qs_at + 4 * k + 4])


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K], ids=lambda t: t.name)
def test_layout_of_a_k_quant_group(qtype):
    """Per super-block: d[8], dmin[8], the scale bytes 0-3, 4-7 and 8-11 of the 8 rows, (Q5_K:
    qh chunk c of row j at 128 + 32c + 4j,) then qs chunk q of row j at 32q + 4j from 128
    (Q4_K) or 384 (Q5_K)."""
    raw = torch.from_numpy(realistic_blocks(qtype, 8, 256, np.random.default_rng(2)))
    out = repack.regroup(raw, qtype, 8, 256).reshape(-1)
    qs_at = 128 if qtype == QT.Q4_K else 384
    for j in range(8):
        row = raw[j]
        assert torch.equal(out[2 * j:2 * j + 2], row[0:2]) and torch.equal(out[16 + 2 * j:18 + 2 * j], row[2:4])
        for u in range(3):
            assert torch.equal(out[32 + 32 * u + 4 * j:36 + 32 * u + 4 * j], row[4 + 4 * u:8 + 4 * u])
        if qtype == QT.Q5_K:
            for c in range(8):
                assert torch.equal(out[128 + 32 * c + 4 * j:132 + 32 * c + 4 * j], row[16 + 4 * c:20 + 4 * c])
        for q in range(32):
            at = qs_at + 32 * q + 4 * j
            assert torch.equal(out[at:at + 4], row[qs_at // 8 + 4 * q:qs_at // 8 + 4 * q + 4])


# the panel kernel's types: block bytes, chunked fields (GGML offset, dwords, regrouped offset),
# f16 fields (GGML offset, regrouped offset of the 8 rows' values side by side)
PANEL_LAYOUTS = {
    QT.Q3_K: (110, [(0, 8, 0), (32, 16, 256), (96, 3, 768)], [(108, 864)]),
    QT.Q2_K: (84, [(0, 4, 0), (16, 16, 128)], [(80, 640), (82, 656)]),
}


@pytest.mark.parametrize("qtype", list(PANEL_LAYOUTS), ids=lambda t: t.name)
def test_layout_of_a_panel_type_group(qtype):
    """Per super-block, the GGML fields in order, each interleaved 4 bytes at a time (chunk c of
    row j at the field's place + 32c + 4j) or, for the f16 scales, side by side: Q3_K's hmask,
    qs, 12 scale bytes and d at 0, 256, 768 and 864; Q2_K's 16 scale/min bytes, qs, d and dmin
    at 0, 128, 640 and 656."""
    size, chunked, halves = PANEL_LAYOUTS[qtype]
    raw = torch.from_numpy(realistic_blocks(qtype, 8, 512, np.random.default_rng(2)))
    out = repack.regroup(raw, qtype, 8, 512).reshape(2, 8 * size)
    for g in range(2):
        b = out[g]
        for j in range(8):
            row = raw[j, size * g:size * (g + 1)]
            for at, dwords, to in chunked:
                for c in range(dwords):
                    assert torch.equal(b[to + 32 * c + 4 * j:to + 32 * c + 4 * j + 4], row[at + 4 * c:at + 4 * c + 4])
            for at, to in halves:
                assert torch.equal(b[to + 2 * j:to + 2 * j + 2], row[at:at + 2])


def run_kernel(kernels, qtype, x, packed, rows, cols, regrouped):
    qt = int(qtype) | (repack.REGROUPED if regrouped else 0)
    return kernels.qmatmul_q8(x, packed, qt, rows, cols)


INT_STEPS = 3  # cpu_choices' index of the Q4_K/Q5_K tiles' sub-block scaling: 1 in i32, 0 in float


@contextlib.contextmanager
def cpu_choice(kernels, index, value):
    """The kernels' per-CPU choice `index` set to `value`, restored afterwards."""
    was = kernels.cpu_choices()
    kernels.cpu_choices(was[:index] + [value] + was[index + 1:])
    try:
        yield
    finally:
        kernels.cpu_choices(was)


def steps_choices(qtype):
    """The sub-block scalings a type's tiles take: both for Q4_K/Q5_K, the CPU's own for the rest."""
    return (0, 1) if qtype in (QT.Q4_K, QT.Q5_K) else (None,)


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [40, 37, 48, 56, 60])
def test_regrouped_kernel_matches_the_reference_and_is_batch_invariant(kernels, qtype, rows):
    """Q4_0 .. MXFP4 and Q3_K: bit for bit the GGML layout's kernel. Q8_0, Q2_K, Q4_K, Q5_K (each output's block
    or super-block sum in one lane rather than eight): float64 x̃ @ W within float32 rounding.
    Every type: a row's result does not depend on the batch or the threads (the 32-weight block
    types' one-row path takes 2, 3 or 4 groups of 8 rows at a time where rows are long, 2048
    columns here, one at a time where they are short, 512: 40 rows end on one group, 37 on a
    short one, 48 and 56 on 2 and 3; 60 on 4 groups whose last is half full, which Q8_0's
    tiles, two groups a register with AVX-512 VNNI, take with the one before). Q4_K and
    Q5_K: with their sub-blocks scaled in float and in i32 (`cpu_choices`), each."""
    for cols in (512, 2048) if qtype in EXACT else (512,):
        for steps in steps_choices(qtype):
            if steps is None:
                check_regrouped_kernel(kernels, qtype, rows, cols)
            else:
                with cpu_choice(kernels, INT_STEPS, steps):
                    check_regrouped_kernel(kernels, qtype, rows, cols)


def check_regrouped_kernel(kernels, qtype, rows, cols):
    rng = np.random.default_rng(3)
    raw = torch.from_numpy(realistic_blocks(qtype, rows, cols, rng))
    regrouped = repack.regroup(raw, qtype, rows, cols)
    x = sample_x(23, cols, seed=4)
    full = run_kernel(kernels, qtype, x, regrouped, rows, cols, True)
    if qtype in EXACT:
        assert torch.equal(full, run_kernel(kernels, qtype, x, raw, rows, cols, False))
    dense = torch.from_numpy(gguf_dequantize(raw.numpy(), qtype).reshape(rows, cols)).double()
    expected = act_quant.round_trip(x, act_quant.block_for(qtype)).double() @ dense.T
    err = (full.double() - expected).abs().max() / expected.abs().max()
    assert err < 1e-6
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            kernels.set_num_threads(n)
            for lo, hi in [(0, 1), (5, 6), (2, 5), (0, 4), (3, 10), (0, 23)]:
                assert torch.equal(run_kernel(kernels, qtype, x[lo:hi], regrouped, rows, cols, True), full[lo:hi])
    finally:
        kernels.set_num_threads(0)
        torch.set_num_threads(threads)
    bf = x[:3].bfloat16()
    assert torch.equal(run_kernel(kernels, qtype, bf, regrouped, rows, cols, True),
                       run_kernel(kernels, qtype, bf.float(), regrouped, rows, cols, True).bfloat16())



@needs_kernels
@pytest.mark.parametrize("qtype, m, slices", [
    (QT.Q5_K, 70, [(0, 1), (69, 70), (0, 31), (0, 32), (5, 45), (33, 70)]),
    (QT.Q6_K, 140, [(0, 1), (139, 140), (0, 127), (0, 128), (5, 135), (12, 140)]),
    (QT.Q3_K, 40, [(0, 1), (39, 40), (0, 15), (0, 16), (5, 30)])], ids=["Q5_K", "Q6_K", "Q3_K"])
@pytest.mark.parametrize("rows", [56, 60])
def test_many_rows_read_decoded_weights_and_give_each_row_its_bits_alone(kernels, qtype, m, slices, rows):
    """From 32 rows of x on (Q5_K, regrouped, with the int steps or without VNNI) or 128 (Q6_K's
    panels; 16 without VNNI, as Q3_K's regrouped groups), the tiles read each work item's or
    panel's weights decoded once into a buffer (q8_repack.h's Q5_PLAIN_FROM, Q6_PLAIN_FROM,
    PANEL_PLAIN_FROM_V8) rather than decoding them per tile: a row's result is the one it has
    alone or among fewer rows, and within float32 rounding of float64. (56 weight rows end a
    work item on a lone group of 8; 60 on a pair whose second group is half full.)"""
    cols = 1024
    raw = torch.from_numpy(realistic_blocks(qtype, rows, cols, np.random.default_rng(8)))
    regrouped = qtype != QT.Q6_K
    packed = repack.regroup(raw, qtype, rows, cols) if regrouped else raw
    x = sample_x(m, cols, seed=9)
    dense = torch.from_numpy(gguf_dequantize(raw.numpy(), qtype).reshape(rows, cols)).double()
    expected = act_quant.round_trip(x, act_quant.block_for(qtype)).double() @ dense.T
    for steps in steps_choices(qtype):
        with contextlib.nullcontext() if steps is None else cpu_choice(kernels, INT_STEPS, steps):
            full = run_kernel(kernels, qtype, x, packed, rows, cols, regrouped)
            assert (full.double() - expected).abs().max() / expected.abs().max() < 1e-6
            for lo, hi in slices:
                assert torch.equal(run_kernel(kernels, qtype, x[lo:hi], packed, rows, cols, regrouped), full[lo:hi])


@needs_kernels
@pytest.mark.parametrize("qtype, regrouped", [(QT.Q4_K, True), (QT.Q5_K, True), (QT.Q6_K, False), (QT.Q3_K, True),
                                              (QT.Q3_K, False), (QT.Q2_K, True), (QT.Q2_K, False),
                                              (QT.Q4_0, True), (QT.Q5_1, True), (QT.MXFP4, True), (QT.Q8_0, True)],
                         ids=["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q3_K-gguf", "Q2_K", "Q2_K-gguf", "Q4_0", "Q5_1", "MXFP4",
                              "Q8_0"])
def test_per_cpu_choices_give_the_same_bits(kernels, qtype, regrouped):
    """The kernels make a few choices by the CPU's vendor (`cpu_choices`): one row of x takes
    regrouped Q2_K..Q5_K one or two groups at a time and prefetches into L2 or not,
    and the Q4_K/Q5_K tiles for many rows copy x per super-block or not. Every choice gives
    the same bits, whichever this CPU runs: one row (or a few) against the batched kernel's rows, the
    batch against itself under the other choices. The one choice that changes bits, Q4_K/Q5_K's
    sub-block scaling in i32 or in float, is held at each in turn. 264 rows: an odd number of
    groups, so two at a time ends on one; 2048 columns, so a thread's chunk is longer than the
    prefetch distance; 9 rows of x, tiles of 8 and 1 (6 and 3 with the int steps); 2 to 8 of
    them, which the 32-weight block types take in the one-row streams up to `few rows`."""
    rows, cols = 264, 2048
    raw = torch.from_numpy(realistic_blocks(qtype, rows, cols, np.random.default_rng(5)))
    w = repack.regroup(raw, qtype, rows, cols) if regrouped else raw
    x = sample_x(9, cols, seed=6)
    was = kernels.cpu_choices()
    try:
        for steps in (0, 1):
            kernels.cpu_choices([1, 0, 0, steps])
            batched = run_kernel(kernels, qtype, x, w, rows, cols, regrouped)
            for choice, few in (([1, 0, 0], 1), ([2, 0, 1], 8), ([1, 32768, 1], 3), ([2, 32768, 0], 8),
                                ([2, 4096, 0], 2)):
                kernels.cpu_choices(choice + [steps, few])  # every type (-1): few rows too
                assert kernels.cpu_choices() == choice + [steps]  # (-1 reports the four shared ones)
                assert kernels.cpu_choices(None, int(qtype))[4] == few
                for i in (0, 4, 8):
                    assert torch.equal(run_kernel(kernels, qtype, x[i:i + 1], w, rows, cols, regrouped),
                                       batched[i:i + 1]), choice
                for lo, hi in ((0, 2), (1, 4), (2, 7), (0, 8)):  # few rows: the one-row streams where `few` allows
                    assert torch.equal(run_kernel(kernels, qtype, x[lo:hi], w, rows, cols, regrouped),
                                       batched[lo:hi]), (choice, lo, hi)
                assert torch.equal(run_kernel(kernels, qtype, x, w, rows, cols, regrouped), batched), choice
                if qtype == QT.Q3_K and regrouped:  # the same bits as the GGML layout
                    assert torch.equal(run_kernel(kernels, qtype, x[:1], raw, rows, cols, False), batched[:1]), choice
    finally:
        kernels.cpu_choices(was)
    for bad in ([3, 0, 0, 1], [1, 0, 2, 1], [1, 0, 0, 2], [1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 9]):
        with pytest.raises(RuntimeError, match="cpu_choices takes"):
            kernels.cpu_choices(bad)


@needs_kernels
@pytest.mark.parametrize("qtype", BLOCKS_OF_32, ids=lambda t: t.name)
def test_one_row_groups_choices_give_the_same_bits(kernels, qtype):
    """The 32-weight block types' one-row path (`groups`: one group at a time, 2 to 4 streamed
    side by side, or where the build has it two groups a 512-bit register, `x8_pairs`): one row
    of x, a few (the streams' tiles where `few rows` allows, else the pairs'), and many, on 1 to 3
    threads, each the bits of the same rows among many under the first choice. 264 rows (33
    groups: work items of 4 end on one), 2048 columns (streams) and 37 x 512 (short groups, a
    last short one); qmatmul_q8_parts (a layer's Q/K/V in one loop) and grouped_qmatmul_q8 (a
    mixture of experts') the same."""
    was = kernels.cpu_choices(None, int(qtype))
    groups = [1, 2, 3, 4] + ([kernels.x8_pairs] if kernels.x8_pairs else [])
    qt = int(qtype) | repack.REGROUPED
    try:
        for rows, cols in ((264, 2048), (37, 512)):
            raw = torch.from_numpy(realistic_blocks(qtype, rows, cols, np.random.default_rng(rows)))
            w = repack.regroup(raw, qtype, rows, cols)
            x = sample_x(9, cols, seed=rows)
            kernels.cpu_choices([1] + was[1:4] + [1], int(qtype))
            batched = kernels.qmatmul_q8(x, w, qt, rows, cols)
            for g in groups:
                for few, l2 in ((8, 0), (1, 32768)):
                    kernels.cpu_choices([g, l2] + was[2:4] + [few], int(qtype))
                    for n in (1, 2, 3):
                        kernels.set_num_threads(n)
                        for lo, hi in ((0, 1), (8, 9), (0, 2), (1, 5), (0, 9)):
                            assert torch.equal(kernels.qmatmul_q8(x[lo:hi], w, qt, rows, cols), batched[lo:hi]), \
                                (g, few, n, lo, hi)
                        kernels.set_num_threads(0)
                    parts = kernels.qmatmul_q8_parts(x[4:5], [w, w], [qt, qt], [rows, rows], cols)
                    assert torch.equal(parts, torch.cat([batched[4:5]] * 2, 1)), g
                    experts = kernels.grouped_qmatmul_q8(x, [w, w, w], [0, 1, 1, 9], [torch.Tensor()] * 3, qt, rows, cols)
                    assert torch.equal(experts, batched), g  # (one row of x for the first matrix, none for the second)
    finally:
        kernels.cpu_choices(was, int(qtype))
        kernels.set_num_threads(0)
    for k_type in (QT.Q4_K, -1):  # the K-quants have no such choice; nor the shared ones
        with pytest.raises(RuntimeError, match="cpu_choices takes"):
            kernels.cpu_choices([16, 0, 0, was[3]], int(k_type))
    if not kernels.x8_pairs:
        with pytest.raises(RuntimeError, match="cpu_choices takes"):
            kernels.cpu_choices([16, 0, 0, was[3]], int(qtype))


@needs_kernels
def test_regrouped_arguments_are_checked(kernels):
    raw = torch.from_numpy(realistic_blocks(QT.Q4_0, 13, 64, np.random.default_rng(1)))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="bytes, expected"):  # 13 rows, not padded to 16
        kernels.qmatmul_q8(x, raw, int(QT.Q4_0) | repack.REGROUPED, 13, 64)
    with pytest.raises(RuntimeError, match="no regrouped layout"):  # (Q6_K's: test_repack_q6k.py)
        kernels.qmatmul_q8(x, raw, int(QT.F16) | repack.REGROUPED, 13, 64)


@needs_kernels
def test_regrouped_q8_0_at_the_extremes(kernels):
    """Q8_0's stored -128 (|w| = 128, the largest unsigned operand) and 127 against x at ±127 in
    every position: each chunk's pairs reach 2 * 128 * 127 = 32512 and must neither saturate
    nor overflow when summed. Scale 1 and x = ±127 (quantized with scale 1) make every product
    and sum an exact integer in float32."""
    rows, cols = 16, 256
    rng = np.random.default_rng(5)
    q = rng.choice(np.array([-128, 127, -127, 0], dtype=np.int8), size=(rows, cols), p=[0.45, 0.45, 0.05, 0.05])
    q[0] = -128
    blocks = np.zeros((rows, cols // 32, 34), dtype=np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    blocks[..., 2:] = q.view(np.uint8).reshape(rows, cols // 32, 32)
    raw = torch.from_numpy(blocks.reshape(rows, -1))
    x = torch.from_numpy(rng.choice(np.array([-127.0, 127.0], dtype=np.float32), size=(3, cols)))
    x[0] = -127.0
    expected = x.double() @ torch.from_numpy(q.astype(np.float64)).T
    w = repack.regroup(raw, QT.Q8_0, rows, cols)
    was = kernels.cpu_choices(None, int(QT.Q8_0))
    try:
        for few in (1, 8):  # 3 rows of x: panels, then the one-row streams (two groups a work item)
            kernels.cpu_choices([4, 0, 0, was[3], few], int(QT.Q8_0))
            got = run_kernel(kernels, QT.Q8_0, x, w, rows, cols, True)
            assert got[0, 0].item() == 256 * 128 * 127  # -127 * -128 over the whole row
            assert torch.equal(got.double(), expected), few
            assert torch.equal(run_kernel(kernels, QT.Q8_0, x[:1], w, rows, cols, True),
                               got[:1])  # one row of x: the decode kernel, two groups at a time
    finally:
        kernels.cpu_choices(was, int(QT.Q8_0))


@needs_kernels
def test_regrouped_q8_0_rows_are_the_ggml_rows(kernels):
    """`regrouped_rows` (a tied Q8_0 LM head regrouped, its embedding's lookups) gives the GGML
    bytes of each row asked for, repeats and the last, partial group's rows included; other
    types and rows past the matrix are one clear error."""
    rows, cols = 21, 96
    raw = torch.from_numpy(realistic_blocks(QT.Q8_0, rows, cols, np.random.default_rng(7)))
    w = repack.regroup(raw, QT.Q8_0, rows, cols)
    ids = torch.tensor([20, 0, 7, 8, 8, 15, 16, 3])
    assert torch.equal(kernels.regrouped_rows(w, int(QT.Q8_0) | repack.REGROUPED, ids, cols), raw[ids])
    with pytest.raises(RuntimeError, match="regrouped Q8_0"):
        kernels.regrouped_rows(w, int(QT.Q8_0), ids, cols)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.regrouped_rows(w, int(QT.Q8_0) | repack.REGROUPED, torch.tensor([24]), cols)


@needs_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_weight_regroups_and_still_looks_up_rows(kernels, qtype):
    from minerva.kernels.weights import PackedWeight
    cols = 256 * (1 if qtype in BLOCKS_OF_32 else 2)
    raw = torch.from_numpy(realistic_blocks(qtype, 21, cols, np.random.default_rng(6)))
    w = PackedWeight(raw, qtype, (21, cols), torch.float32)
    w.use_int8_activations()
    assert w.regrouped and w.qtype_id == int(qtype) | repack.REGROUPED
    x = sample_x(5, cols)
    assert torch.equal(w.matmul(x), run_kernel(kernels, qtype, x, repack.regroup(raw, qtype, 21, cols), 21, cols, True))
    ids = torch.tensor([[0, 20, 7], [8, 8, 15]])
    dense = torch.from_numpy(gguf_dequantize(raw.numpy(), qtype).reshape(21, cols))
    assert torch.equal(w.rows(ids), dense[ids])
    w.kernel = None  # the reference path dequantizes the GGML bytes back
    w.materialize()
    assert torch.equal(w._dense, dense)
    plain = PackedWeight(raw, qtype, (21, cols), torch.float32)
    plain.use_int8_activations(regroup=False)
    assert plain.int8 and not plain.regrouped and plain.qtype_id == int(qtype)


@needs_kernels
@pytest.mark.slow
def test_model_logits_are_the_same_regrouped_or_not(smollm2_gguf, monkeypatch):
    """SmolLM2's Q4_1 layers regrouped give the same logits, bit for bit, through the fused C++
    layers (its tied Q8_0 embedding and head held in the GGUF layout). By default the tied head
    is regrouped too and the embedding looks its rows up there: the same rows, and logits within
    Q8_0's regrouped rounding (one float step per block, not per 4 products) of the others."""
    from minerva.kernels.weights import PackedWeight
    from minerva.models.layers import Linear
    from minerva.models.loader import load_model
    from tests.helpers.paged import paged_logits

    ids = [int(i) for i in torch.randint(1000, 40000, (40,), generator=torch.Generator().manual_seed(1))]
    both = load_model(smollm2_gguf, activations="int8").model
    weights = {id(m.weight): m.weight for m in both.modules() if isinstance(m, Linear)}.values()
    assert len([w for w in weights if isinstance(w, PackedWeight) and w.regrouped]) == 30 * 4 + 1
    assert both.embed.regrouped and both.lm_head.weight is both.embed and both.step_args is not None
    tied_regrouped = paged_logits(both, ids, chunk=16)
    with monkeypatch.context() as m:
        m.setattr(repack, "TYPES", repack.TYPES - {QT.Q8_0})
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
    lookup = torch.tensor(ids[:8] + [0, 49151])
    assert torch.equal(both.embed.rows(lookup), plain.embed.rows(lookup))
    assert (tied_regrouped - got).abs().max() <= 1e-3 * got.abs().max()


@needs_kernels
@pytest.mark.parametrize("qtype", [QT.MXFP4, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K], ids=lambda t: t.name)
def test_grouped_matmul_is_each_matrix_alone(kernels, qtype):
    """`grouped_qmatmul_q8` (a mixture of experts' matmuls in one parallel loop): each matrix's
    rows get the bits of that matrix's own qmatmul_q8 plus its bias; a matrix without rows is
    skipped; bad row ranges and sizes are refused. (3072 columns: the 32-weight block types'
    one-row work items of four groups, as GPT-OSS's 2880-column experts; 512: of one.)"""
    rows = 37
    rng = np.random.default_rng(9)
    qt = int(qtype) | repack.REGROUPED
    starts = [0, 5, 5, 6, 12]  # matrix 1 has no rows, matrix 2 one
    for cols in (512, 3072):
        mats = [repack.regroup(torch.from_numpy(realistic_blocks(qtype, rows, cols, rng)), qtype, rows, cols)
                for _ in range(4)]
        bias = [torch.randn(rows), torch.Tensor(), torch.randn(rows), torch.Tensor()]
        x = sample_x(12, cols, seed=2)
        got = kernels.grouped_qmatmul_q8(x, mats, starts, bias, qt, rows, cols)
        for e in range(4):
            lo, hi = starts[e], starts[e + 1]
            if hi > lo:
                alone = kernels.qmatmul_q8(x[lo:hi], mats[e], qt, rows, cols)
                assert torch.equal(got[lo:hi], alone.add_(bias[e]) if bias[e].numel() else alone)
    with pytest.raises(RuntimeError, match="starts must run"):
        kernels.grouped_qmatmul_q8(x, mats, [0, 5, 5, 6, 11], bias, qt, rows, cols)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        kernels.grouped_qmatmul_q8(x, mats, starts, bias, qt, rows + 8, cols)
    with pytest.raises(RuntimeError, match="a bias must be"):
        kernels.grouped_qmatmul_q8(x, mats, starts, [torch.randn(3)] * 4, qt, rows, cols)


@needs_kernels
def test_matrices_side_by_side_are_each_matrix_alone(kernels):
    """`qmatmul_q8_parts` (a layer's Q/K/V of different types): one row of x against K-quants
    (regrouped or not), or against regrouped types of 32-weight blocks, runs them in one
    parallel loop; every output has the bits of its matrix's own qmatmul_q8, under every thread
    count and group choice. More rows of x, or matrices of both kinds, take one call per
    matrix; both give the concatenation."""
    cols = 512
    rng = np.random.default_rng(11)
    spec = [(QT.Q4_K, 37, True), (QT.Q6_K, 9, False), (QT.Q5_K, 264, True), (QT.Q3_K, 24, False),
            (QT.Q2_K, 8, False), (QT.Q4_K, 8, False), (QT.Q8_0, 40, True), (QT.Q5_0, 13, True),
            (QT.Q4_0, 8, True), (QT.Q3_K, 40, True), (QT.Q2_K, 24, True)]
    mats, qtypes, rows = [], [], []
    for qtype, n, regroup in spec:
        raw = torch.from_numpy(realistic_blocks(qtype, n, cols, rng))
        mats.append(repack.regroup(raw, qtype, n, cols) if regroup else raw)
        qtypes.append(int(qtype) | (repack.REGROUPED if regroup else 0))
        rows.append(n)
    x = sample_x(3, cols, seed=12)

    def alone(x, which):
        return torch.cat([kernels.qmatmul_q8(x, mats[i], qtypes[i], rows[i], cols) for i in which], 1)

    def parts(x, which):
        return kernels.qmatmul_q8_parts(x, [mats[i] for i in which], [qtypes[i] for i in which],
                                        [rows[i] for i in which], cols)

    was = kernels.cpu_choices()
    try:
        for choice in ([1, 0, 0, 1], [2, 0, 0, 1], [1, 0, 0, 0]):
            kernels.cpu_choices(choice)
            for n in (1, 2, 3):
                kernels.set_num_threads(n)
                for which in ([0, 1], [1, 0, 2, 3, 4, 5], [3, 2], [6, 7, 8], [7, 6], [0, 6], [9, 1, 3], [0, 9], [10, 4, 9]):
                    for xs in (x[:1], x[1:2].bfloat16(), x):
                        got = parts(xs, which)
                        assert got.dtype == xs.dtype and torch.equal(got, alone(xs, which)), (choice, n, which)
    finally:
        kernels.cpu_choices(was)
        kernels.set_num_threads(0)
    with pytest.raises(RuntimeError, match="one type and row count per matrix"):
        kernels.qmatmul_q8_parts(x[:1], mats[:2], qtypes[:1], rows[:2], cols)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        kernels.qmatmul_q8_parts(x[:1], mats[:2], qtypes[:2], [rows[0], rows[1] + 1], cols)


@needs_kernels
def test_projections_fuse_runs_of_one_format(kernels):
    """Q4_K Q and K with a Q6_K V (a Q4_K_M layer): Q and K stacked into one matmul, V alone,
    and every output bitwise what its own weight gives."""
    from minerva.kernels.weights import PackedWeight
    from minerva.models.layers import Linear, Projections
    rng = np.random.default_rng(8)
    shapes = [(QT.Q4_K, 24), (QT.Q4_K, 8), (QT.Q6_K, 8)]
    weights = [PackedWeight(torch.from_numpy(realistic_blocks(t, n, 512, rng)), t, (n, 512), torch.float32)
               for t, n in shapes]
    proj = Projections(*(Linear(w) for w in weights))
    assert [lin.weight.shape[0] for lin in proj.linears()] == [32, 8] and proj.fused is None
    assert proj.linears()[1].weight is weights[2]
    for w in [*weights, proj.linears()[0].weight]:
        w.use_int8_activations()
    x = sample_x(6, 512)
    for got, w in zip(proj(x), weights, strict=True):
        assert torch.equal(got, w.matmul(x))
