"""Every op of every kernel backend that can run here, against the references (as llama.cpp's
test-backend-ops): each backend is chosen by name (`dispatch.choose`), the test checks that
it, not the reference, covered the case, and compares with an independent reference: the
`gguf` package's dequantization and a float64 matmul for the packed matrices (float and 8-bit
activations), the torch formulas of `ops.py` for the small ops (each kernel's own edge
cases and errors stay in tests/kernels/test_ops.py and test_triton_ops.py), and a dense float64
attention for the paged attention. The Triton backend runs through Triton's interpreter where
there is no GPU (conftest.py sets TRITON_INTERPRET)."""

from __future__ import annotations

import gguf
import pytest
import torch

from minerva.kernels import act_quant, dispatch, native, ops, tune
from minerva.kernels.attention import attention_kernel
from minerva.kernels.weights import PackedWeight
from tests.kernels.test_paged_attention import MIXED_BATCH, TOLERANCE, Batch

Q = gguf.GGMLQuantizationType
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _names() -> list:
    names = []
    if DEVICE == "cpu":
        names.append(pytest.param("cpu", marks=pytest.mark.skipif(
            not native.capable(), reason="CPU lacks the native kernels")))
    names.append(pytest.param("triton", marks=pytest.mark.skipif(
        not dispatch.available("triton"), reason="Triton is not installed (pip install -e '.[test]')")))
    return names


@pytest.fixture(params=_names())
def backend(request, monkeypatch):
    """The backend of this name running on DEVICE (the Triton one under the interpreter on a CPU)."""
    name = request.param
    monkeypatch.setattr(dispatch, "_chosen", {})
    monkeypatch.setattr(dispatch, "_loaded", {})
    cls = dispatch.backend_class(name)
    if DEVICE not in cls.devices:
        monkeypatch.setattr(cls, "devices", (*cls.devices, DEVICE))
    dispatch.choose(DEVICE, name)
    b = dispatch.backend(DEVICE)
    assert type(b) is cls
    return b


def _covered_types(b, dtype: torch.dtype) -> list[Q]:
    types = [q for q in tune.TYPES if b.matmul_kernel(q, dtype) is not None]
    assert types, f"{b.name} multiplies no packed type by {dtype}"
    return types


# the activation dtypes of a backend's float matmuls here (Triton's interpreter's tl.dot is
# wrong on bfloat16: bf16 on a GPU only)
MATMUL_DTYPES = {"cpu": (torch.float32, torch.bfloat16),
                 "triton": (torch.float32, torch.float16) + ((torch.bfloat16,) if DEVICE == "cuda" else ())}
EPS = {torch.float32: 2 ** -20, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_packed_matmuls_with_float_activations(backend, dtype):
    """Each packed type the backend takes against x @ W in float64, W from gguf's dequantization:
    within the rounding of x's type (float32: products and sums in float32; half types: the
    weights rounded to x's type, the output rounded once more), at 1, 5 and 40 rows of x."""
    if dtype not in MATMUL_DTYPES[backend.name]:
        pytest.skip(f"{backend.name} multiplies {', '.join(map(str, MATMUL_DTYPES[backend.name]))} here")
    gen = torch.Generator().manual_seed(3)
    rows, cols = 37, 512  # rows past a tile, more than one slice of the row
    for qtype in _covered_types(backend, dtype):
        packed = tune.random_blocks(qtype, rows, cols, gen)
        dense = torch.from_numpy(gguf.dequantize(packed.numpy(), qtype)).reshape(rows, cols).double()
        w = PackedWeight(packed.to(DEVICE), qtype, (rows, cols), dtype)
        assert w.kernel is not None, qtype.name
        for m in (1, 5, 40):  # one row (decode), a few, past a tile of rows
            x = torch.randn(m, cols, generator=gen).to(dtype)
            y = w.matmul(x.to(DEVICE))
            assert y.dtype == dtype and y.shape == (m, rows)
            ref, mag = x.double() @ dense.T, x.double().abs() @ dense.abs().T
            assert ((y.cpu().double() - ref).abs() <= EPS[dtype] * mag + 1e-6).all(), (backend.name, qtype.name, m)


def test_packed_matmuls_with_int8_activations(backend):
    """The 8-bit activation path: x rounded to 8 bits a block as `act_quant` does, against
    that rounded x @ W in float64."""
    gen = torch.Generator().manual_seed(5)
    rows, cols = 40, 512
    for qtype in _covered_types(backend, torch.float32):
        packed = tune.random_blocks(qtype, rows, cols, gen)
        dense = torch.from_numpy(gguf.dequantize(packed.numpy(), qtype)).reshape(rows, cols).double()
        w = PackedWeight(packed.to(DEVICE), qtype, (rows, cols), torch.float32)
        w.use_int8_activations()
        if not w.int8:
            continue
        x = torch.randn(5, cols, generator=gen)
        ref = act_quant.round_trip(x, act_quant.block_for(qtype)).double() @ dense.T
        out = w.matmul(x.to(DEVICE)).double().cpu()
        err = (out - ref).abs().max() / ref.abs().max()
        assert err < 1e-4, (backend.name, qtype.name, float(err))


# the small ops' activation dtypes a backend takes here (Triton's interpreter casts float32 to
# bfloat16 by truncation, where a GPU rounds to nearest even: bf16 on a GPU only)
OP_DTYPES = {"cpu": (torch.float32, torch.bfloat16),
             "triton": (torch.float32, torch.float16) + ((torch.bfloat16,) if DEVICE == "cuda" else ())}
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
G = torch.Generator().manual_seed(0)


def _op_input(backend, dtype, *shape, scale=3.0):
    if dtype not in OP_DTYPES[backend.name]:
        pytest.skip(f"{backend.name} runs its small ops in {', '.join(map(str, OP_DTYPES[backend.name]))} here")
    x = (torch.randn(*shape, generator=G) * scale).to(dtype).to(DEVICE)
    assert backend.op_kernel(x) is not None, f"{backend.name} covers no small op for {dtype}"
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 576), (7, 640), (3, 4, 256)])
def test_rms_norm(backend, shape, dtype):
    x = _op_input(backend, dtype, *shape)
    w = torch.randn(shape[-1], generator=G).to(DEVICE)
    ours = ops.rms_norm(x, w, 1e-6)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float().cpu(), ops.rms_norm_torch(x, w, 1e-6).float().cpu(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_add_rms_norm_updates_the_residual(backend, dtype):
    h, a = _op_input(backend, dtype, 5, 576, scale=1.0), _op_input(backend, dtype, 5, 576, scale=1.0)
    w = torch.randn(576, generator=G).to(DEVICE)
    h_ref = h.clone()
    ref = ops.add_rms_norm(h_ref, a, w, 1e-5, impl="torch")
    ours = ops.add_rms_norm(h, a, w, 1e-5)
    assert torch.equal(h, h_ref)  # the add itself is one elementwise op either way, in h's dtype
    torch.testing.assert_close(ours.float().cpu(), ref.float().cpu(), **TOL[dtype])
    # one pass adds and normalizes: the norm of the stored (rounded) sums, as rms_norm gives it
    torch.testing.assert_close(ours, ops.rms_norm(h, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,dim", [(9, 64), (4, 256), (1, 32)])
def test_rope_on_a_strided_view(backend, heads, dim, dtype):
    """Rotates q inside a fused QKV output (a view with a wider token stride), like the model
    does, in place; the rest of the row is untouched."""
    T = 6
    qkv = _op_input(backend, dtype, T, heads * dim + 2 * dim)
    q = qkv[:, :heads * dim].view(T, heads, dim)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))).to(DEVICE)
    cos, sin = ops.rope_cos_sin(torch.tensor([0, 1, 5, 17, 300, 4095], device=DEVICE), inv_freq)
    ref = ops.rope_torch(q.clone(), cos, sin)
    rest = qkv[:, heads * dim:].clone()
    ours = ops.rope(q, cos, sin)
    assert ours.data_ptr() == q.data_ptr()
    torch.testing.assert_close(ours.float().cpu(), ref.float().cpu(), **TOL[dtype])
    assert torch.equal(qkv[:, heads * dim:], rest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_limit"])
def test_act_mul(backend, activation, dtype):
    gu = _op_input(backend, dtype, 9, 2 * 1536, scale=4.0)
    gu[0, :8] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, 8.0])  # tails of exp
    gu[1, 1536:1544] = torch.tensor([-100.0, -7.5, -7.0, -6.9, 6.9, 7.0, 7.5, 100.0])  # up around GPT-OSS's limit
    limit = (7.0, 1.702) if activation == "swiglu_limit" else None
    ours = ops.act_mul(gu, activation, limit=limit)
    ref = ops.act_mul(gu.float(), activation, impl="torch", limit=limit).to(dtype)  # in float32, rounded once
    # gelu_tanh's kernels take the sigmoid form of tanh, whose float32 tail torch's tanh rounds
    # to -1: a few ulps apart
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(ours.float().cpu(), ref.float().cpu(), **tol)


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("fmt, dtype", [("float32", torch.float32), ("int8", torch.float32),
                                        ("auto", torch.bfloat16)])
def test_paged_attention(backend, fmt, dtype, window, block_size):
    """Prefill from 0, chunks after a cached prefix and decodes, over a pool whose blocks are
    shuffled across requests, against a dense float64 attention."""
    batch = Batch(MIXED_BATCH, block_size, fmt, fmt, dtype=dtype, device=DEVICE)
    batch.q = batch.q.to(dtype)
    assert attention_kernel(dtype, batch.cache) is not None, f"{backend.name} does not attend over {fmt} pools"
    ours = batch.paged(window).double()
    ref = batch.reference(window)
    atol, rtol = TOLERANCE["bfloat16" if dtype == torch.bfloat16 else fmt]
    torch.testing.assert_close(ours, ref, atol=atol * 4, rtol=rtol * 4)


@pytest.mark.parametrize("fmt", ["fp8", "float16"])
def test_paged_attention_over_pools_the_kernel_does_not_read(backend, fmt):
    """fp8 and float16 pools: the CPU backend widens each request's K/V to float32 for its
    kernel, any other backend takes the torch path (a Triton pool must have a power-of-two
    block size, which a request's length need not be)."""
    batch = Batch(MIXED_BATCH, 16, fmt, fmt, device=DEVICE)
    ours = batch.paged(5).double()
    atol, rtol = TOLERANCE[fmt]
    torch.testing.assert_close(ours, batch.reference(5), atol=atol * 4, rtol=rtol * 4)
