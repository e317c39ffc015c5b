"""8-bit activations (`--activations int8`): the kernel's quantization of x against the
plain-torch one, its integer dot products against a float64 matmul of the gguf package's
dequantized weights and the quantized x, batch and thread invariance, and the flag's
plumbing through the loader, the fused layer and the reference path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from minerva.errors import MinervaError
from minerva.kernels import act_quant, native, repack
from tests.helpers.paged import paged_logits
from tests.helpers.quant_blocks import random_blocks, realistic_blocks

PACKED_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
                QT.MXFP4]

needs_kernels = pytest.mark.skipif(not native.capable(), reason="this CPU cannot run the packed kernels")


@pytest.fixture(scope="module")
def kernels():
    mod = native.load()
    assert mod is not None, f"the CPU supports the kernels but they did not load: {native.unavailable_reason}"
    return mod


def sample_x(rows, cols, seed=0):
    """Activations with the spread of real ones: most blocks ~N(0, 1), some with one large
    outlier, one all-zero block, one tiny block, and exact ties at .5 after scaling."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[:, 5] *= 40.0
    x[0, 32:64] = 0.0
    x[-1, 64:96] *= 1e-30
    x[1, 96:128] = torch.arange(32) * 0.5 - 8.0  # max 7.5: x / d has halves to round to even
    return x


def test_torch_quantization_follows_the_recipe():
    x = torch.tensor([[0.0] * 31 + [2.54], [1.0] * 16 + [-1.0] * 15 + [0.0]])
    q, d = act_quant.quantize(x)
    assert q.dtype == torch.int8 and d.shape == (2, 1)
    assert d[0, 0] == torch.tensor(2.54) / 127 and q[0, -1] == 127 and not q[0, :-1].any()
    assert q[1, :16].eq(127).all() and q[1, 16:31].eq(-127).all() and q[1, 31] == 0
    assert torch.equal(act_quant.round_trip(torch.zeros(1, 32)), torch.zeros(1, 32))


def test_k_quants_take_blocks_of_256():
    x = torch.zeros(1, 512)
    x[0, 3], x[0, 300] = 2.54, -1.0
    q, d = act_quant.quantize(x, 256)
    assert d.shape == (1, 2) and d[0, 0] == torch.tensor(2.54) / 127 and d[0, 1] == torch.tensor(1.0) / 127
    assert q[0, 3] == 127 and q[0, 300] == -127 and q.count_nonzero() == 2
    assert torch.equal(act_quant.dequantize(q, d), act_quant.round_trip(x, 256))
    assert act_quant.block_for(QT.Q4_K) == act_quant.block_for(QT.Q6_K) == 256
    assert act_quant.block_for(QT.Q4_0) == act_quant.block_for(QT.Q8_0) == 32


@needs_kernels
@pytest.mark.parametrize("block", [32, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_quantization_is_bit_identical_to_torch(kernels, dtype, block):
    x = sample_x(7, 512).to(dtype)
    q, d, s = kernels.quantize_activations(x, block)
    q_ref, d_ref = act_quant.quantize(x, block)
    assert torch.equal(q, q_ref)
    assert torch.equal(d, d_ref)
    sums = q.float().reshape(7, 512 // block, block).sum(-1)
    assert torch.equal(s, d * sums)


def reference(x, raw, qtype, rows, cols):
    """float64 (quantized x) @ (gguf-dequantized W)^T, and the same with |.| for the error bound."""
    w = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(rows, cols)).double()
    xq = act_quant.round_trip(x, act_quant.block_for(qtype)).double()
    return xq @ w.T, xq.abs() @ w.abs().T


@needs_kernels
@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_int8_matmul_matches_float64_reference(kernels, qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 37, 768  # rows not a multiple of the tiles: exercises the edges
    for raw in (realistic_blocks(qtype, rows, cols, rng), random_blocks(qtype, (rows, cols), rng)):
        x = sample_x(21, cols, seed=int(qtype))
        for m in (1, 11, 21):  # the one-row path, the tiled one, and (K-quants) decoded panels
            y = kernels.qmatmul_q8(x[:m], torch.from_numpy(raw), int(qtype), rows, cols)
            assert y.dtype == torch.float32 and y.shape == (m, rows)
            ref, mag = reference(x[:m], raw, qtype, rows, cols)
            # per 32 weights one fp32 product of scales and one fp32 accumulation
            assert ((y.double() - ref).abs() <= 2 ** -19 * mag + 1e-30).all()


@needs_kernels
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_int8_is_closer_to_quantized_x_than_float_is(kernels, qtype):
    """The kernel multiplies x̃, not x: against x @ W it is off by about the 8-bit rounding."""
    rng = np.random.default_rng(1)
    raw = realistic_blocks(qtype, 64, 1024, rng)
    x = sample_x(3, 1024)
    y = kernels.qmatmul_q8(x, torch.from_numpy(raw), int(qtype), 64, 1024).double()
    w = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(64, 1024)).double()
    exact = x.double() @ w.T
    rel = (y - exact).norm() / exact.norm()
    # a 40x outlier costs a 256-block more of its resolution than a 32-block (measured 0.036)
    assert 1e-5 < rel < (5e-2 if act_quant.block_for(qtype) == 256 else 2e-2)


@needs_kernels
@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_a_row_does_not_depend_on_the_batch_or_threads(kernels, qtype):
    rng = np.random.default_rng(5)
    raw = torch.from_numpy(realistic_blocks(qtype, 42, 512, rng))
    x = sample_x(40, 512, seed=2)  # 16 rows or more: K-quants decode their panels first
    full = kernels.qmatmul_q8(x, raw, int(qtype), 42, 512)
    for lo, hi in [(0, 1), (5, 6), (2, 5), (1, 5), (3, 10), (12, 13), (0, 13), (3, 19), (0, 16), (21, 40)]:
        assert torch.equal(kernels.qmatmul_q8(x[lo:hi], raw, int(qtype), 42, 512), full[lo:hi])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            kernels.set_num_threads(n)
            assert torch.equal(kernels.qmatmul_q8(x, raw, int(qtype), 42, 512), full)
            assert torch.equal(kernels.qmatmul_q8(x[4:5], raw, int(qtype), 42, 512), full[4:5])
    finally:
        kernels.set_num_threads(0)
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("qtype", [QT.Q3_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", [11, 17])
def test_one_row_sums_long_rows_as_the_batch_does(kernels, qtype, blocks):
    """Q3_K and Q6_K at one row of x keep up to 8 super-blocks' sums before adding them up in
    order: rows of 11 and 17 super-blocks (a partial last batch of them, one of a single
    super-block) give the batched kernel's bits, and the float64 reference within rounding."""
    rows, cols = 19, 256 * blocks
    raw = realistic_blocks(qtype, rows, cols, np.random.default_rng(blocks))
    x = sample_x(9, cols, seed=blocks)
    full = kernels.qmatmul_q8(x, torch.from_numpy(raw), int(qtype), rows, cols)  # 9 rows: the panels
    for i in (0, 4, 8):
        assert torch.equal(kernels.qmatmul_q8(x[i:i + 1], torch.from_numpy(raw), int(qtype), rows, cols), full[i:i + 1])
    ref, mag = reference(x, raw, qtype, rows, cols)
    assert ((full.double() - ref).abs() <= 2 ** -19 * mag + 1e-30).all()


@needs_kernels
@pytest.mark.parametrize("m, n", [(1, 20), (3, 16), (37, 20), (40, 75)])  # bf16 outputs past a multiple of 8
@pytest.mark.parametrize("qtype, regrouped", [(QT.Q4_K, False), (QT.Q4_K, True), (QT.Q8_0, True), (QT.Q6_K, False)],
                         ids=["Q4_K", "Q4_K-regrouped", "Q8_0-regrouped", "Q6_K"])
def test_bfloat16_activations_are_widened(kernels, m, n, qtype, regrouped):
    """bf16 x is quantized as its exact float32 widening, and the result rounded as Tensor.to
    (the regrouped kernels and Q6_K's panels, from 8 rows of x, round each work item's outputs
    as it finishes; the others the whole float32 result)."""
    rng = np.random.default_rng(2)
    raw = torch.from_numpy(realistic_blocks(qtype, n, 256, rng))
    kind = int(qtype)
    if regrouped:
        raw, kind = repack.regroup(raw, qtype, n, 256), kind | repack.REGROUPED
    x = sample_x(max(m, 2), 256)[:m].bfloat16()
    y = kernels.qmatmul_q8(x, raw, kind, n, 256)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert torch.equal(y, kernels.qmatmul_q8(x.float(), raw, kind, n, 256).bfloat16())


@needs_kernels
@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda t: t.name)
def test_float_matrices_keep_float_activations(kernels, qtype):
    w = torch.randn(24, 64)
    dt = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}[qtype]
    packed = w.to(dt).contiguous().view(torch.uint8)
    x = torch.randn(3, 64)
    assert torch.equal(kernels.qmatmul_q8(x, packed, int(qtype), 24, 64),
                       kernels.qmatmul(x, packed, int(qtype), 24, 64))
    assert not act_quant.applies(qtype) and act_quant.applies(QT.Q4_K)


@needs_kernels
def test_bad_arguments_raise(kernels):
    raw = torch.from_numpy(realistic_blocks(QT.Q4_0, 4, 64, np.random.default_rng(0)))
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.qmatmul_q8(torch.randn(2, 32), raw, int(QT.Q4_0), 4, 64)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        kernels.qmatmul_q8(torch.randn(2, 64), raw[:2], int(QT.Q4_0), 4, 64)
    with pytest.raises(RuntimeError, match="no packed kernel"):
        kernels.qmatmul_q8(torch.randn(2, 64), raw, 99, 4, 64)
    with pytest.raises(RuntimeError, match="the activation block is 32 or 256"):
        kernels.quantize_activations(torch.randn(2, 256), 64)
    with pytest.raises(RuntimeError, match="not a multiple of 256"):
        kernels.quantize_activations(torch.randn(2, 96), 256)


def test_packed_weight_reference_path_rounds_x(monkeypatch):
    """Without a kernel the weight is dequantized and x goes through the same rounding."""
    from minerva.kernels.weights import PackedWeight
    rng = np.random.default_rng(4)
    raw = torch.from_numpy(realistic_blocks(QT.Q4_K, 8, 256, rng))
    w = PackedWeight(raw, QT.Q4_K, (8, 256), torch.float32)
    w.kernel = None
    w.use_int8_activations()
    assert w.int8
    x = sample_x(2, 256)
    dense = torch.from_numpy(gguf_dequantize(raw.numpy(), QT.Q4_K).reshape(8, 256))
    expected = act_quant.round_trip(x, 256) @ dense.T  # a K-quant: x in blocks of 256
    torch.testing.assert_close(w.matmul(x), expected, rtol=1e-5, atol=1e-6)


def test_load_model_rejects_an_unknown_mode(smollm2_gguf):
    from minerva.models.loader import load_model
    with pytest.raises(MinervaError, match="--activations must be auto or one of float, int8"):
        load_model(smollm2_gguf, activations="int4")


def test_auto_is_int8_where_the_cpu_kernels_run():
    """`--activations auto` (the default) is int8 where the C++ kernels run (both builds),
    and float on the reference path and GPUs."""
    from minerva.kernels import dispatch
    from minerva.llm import resolve_activations
    cpu = torch.device("cpu")
    native.load()
    expected = "int8" if native.built is not None and dispatch.backend(cpu).unavailable_reason is None else "float"
    assert resolve_activations("auto", cpu) == expected
    assert resolve_activations("float", cpu) == "float" and resolve_activations("int8", cpu) == "int8"
    with pytest.raises(MinervaError, match="--activations must be auto or one of"):
        resolve_activations("fp8", cpu)


@pytest.mark.slow
def test_llm_default_activations_reach_every_quantized_weight(smollm2_gguf):
    from minerva import LLM
    from minerva.kernels import dispatch
    from minerva.kernels.weights import PackedWeight
    from minerva.models.layers import Linear
    llm = LLM(str(smollm2_gguf), device="cpu", kv_cache_memory=1 << 20)
    assert llm.activations == dispatch.default_activations(torch.device("cpu"))
    packed = [m.weight for m in llm.loaded.model.modules()
              if isinstance(m, Linear) and isinstance(m.weight, PackedWeight)]
    assert packed and all(w.int8 == (llm.activations == "int8" and act_quant.applies(w.qtype)) for w in packed)


@needs_kernels
@pytest.mark.slow
def test_model_with_int8_activations(smollm2_gguf):
    """Every quantized linear takes the flag; the fused C++ layers give the Python layers'
    bits; and the kernels and the reference path (dequantized weights, x rounded in torch)
    both stay near the float-activation logits.

    The two int8 paths are not compared with each other at a tight tolerance: rounding x
    to 8 bits is discontinuous, so a last-bit difference (a different summation order)
    flips a rounding now and then, and 30 layers amplify that to the size of the 8-bit
    noise itself (measured: the same distance as int8 from float)."""
    from minerva.kernels.weights import PackedWeight
    from minerva.models.layers import Linear
    from minerva.models.loader import load_model

    ids = [int(i) for i in torch.randint(1000, 40000, (96,), generator=torch.Generator().manual_seed(0))]
    float_logits = paged_logits(load_model(smollm2_gguf).model, ids, chunk=32)
    model = load_model(smollm2_gguf, activations="int8").model
    packed = {id(m.weight): m.weight for m in model.modules()
              if isinstance(m, Linear) and isinstance(m.weight, PackedWeight)}.values()
    assert packed and all(w.int8 == act_quant.applies(w.qtype) for w in packed)
    assert all(layer.fused is not None for layer in model.layers)
    fused = paged_logits(model, ids, chunk=32)
    model.stack = model.head = model.step_args = None  # (they hold the C++ layers too)
    for layer in model.layers:
        layer.fused = None
    assert torch.equal(paged_logits(model, ids, chunk=32), fused)
    for w in packed:
        w.kernel = None  # the reference path: dequantize once, round x in torch
    reference = paged_logits(model, ids, chunk=32)
    scale = float_logits.pow(2).mean().sqrt()
    for logits in (fused, reference):
        assert not torch.equal(logits, float_logits)
        assert (logits - float_logits).pow(2).mean().sqrt() < 0.05 * scale  # measured: 1.5%
        assert (logits.argmax(-1) == float_logits.argmax(-1)).float().mean() > 0.75  # measured: 0.84-0.87


def test_every_command_defaults_to_auto():
    """`minerva generate/serve/...`, `minerva bench ...` and `minerva roofline` all leave
    the choice to `auto`."""
    from minerva.cli import build_parser
    cli = build_parser()
    for argv in (["generate", "hi"], ["serve"], ["chat"], ["perplexity", "m", "f"], ["roofline"],
                 ["bench", "latency"], ["bench", "throughput"], ["bench", "sweep"]):
        assert cli.parse_args(argv).activations == "auto", argv
