"""Every op of every kernel backend that can run here, against the references (as llama.cpp's
test-backend-ops): each backend is chosen by name (`dispatch.choose`), the test checks that
it, not the reference, covered the case, and compares with an independent reference: the
`gguf` package's dequantization and a float64 matmul for the packed matrices (float and 8-bit
activations), the torch formulas of `ops.py` for the small ops, and a dense float64
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


def _covered_types(b) -> list[Q]:
    types = [q for q in tune.TYPES if b.matmul_kernel(q, torch.float32) is not None]
    assert types, f"{b.name} multiplies no packed type"
    return types


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_packed_matmuls(backend, activations):
    gen = torch.Generator().manual_seed(3)
    rows, cols = 40, 512
    for qtype in _covered_types(backend):
        packed = tune.random_blocks(qtype, rows, cols, gen)
        dense = torch.from_numpy(gguf.dequantize(packed.numpy(), qtype)).reshape(rows, cols).double()
        w = PackedWeight(packed.to(DEVICE), qtype, (rows, cols), torch.float32)
        assert w.kernel is not None, qtype.name
        x = torch.randn(5, cols, generator=gen)
        if activations == "int8":
            w.use_int8_activations()
            if not w.int8:
                continue
            x_ref = act_quant.round_trip(x, act_quant.block_for(qtype)).double()
        else:
            x_ref = x.double()
        ref = x_ref @ dense.T
        out = w.matmul(x.to(DEVICE)).double().cpu()
        err = (out - ref).abs().max() / ref.abs().max()
        assert err < 1e-4, (backend.name, qtype.name, activations, float(err))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_ops(backend, dtype):
    gen = torch.Generator().manual_seed(4)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    x = torch.randn(6, 256, generator=gen).to(dtype).to(DEVICE)
    assert backend.op_kernel(x) is not None, f"{backend.name} covers no small op for {dtype}"
    w = (torch.rand(256, generator=gen) + 0.5).to(DEVICE)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_torch(x, w, 1e-6), **tol)
    a = torch.randn(6, 256, generator=gen).to(dtype).to(DEVICE)
    h1, h2 = x.clone(), x.clone()
    got = ops.add_rms_norm(h1, a, w, 1e-6)
    want = ops.add_rms_norm(h2, a, w, 1e-6, impl="torch")
    torch.testing.assert_close(h1, h2, **tol)  # the residual stream, updated in place
    torch.testing.assert_close(got, want, **tol)
    q = torch.randn(6, 4, 64, generator=gen).to(dtype).to(DEVICE)
    cos, sin = ops.rope_cos_sin(torch.arange(10, 16, device=DEVICE), 1e4 ** -(torch.arange(32, device=DEVICE) / 32))
    want = ops.rope_torch(q, cos, sin)
    torch.testing.assert_close(ops.rope(q.clone(), cos, sin), want, **tol)
    gate_up = torch.randn(6, 512, generator=gen).to(dtype).to(DEVICE)
    for act in ("silu", "gelu_tanh"):
        torch.testing.assert_close(ops.act_mul(gate_up, act), ops.act_mul(gate_up, act, impl="torch"), **tol)
    if backend.name == "cpu":  # GPT-OSS's clamped SwiGLU: the C++ kernels' only
        torch.testing.assert_close(ops.act_mul(gate_up, "swiglu_limit", limit=(7.0, 1.702)),
                                   ops.act_mul(gate_up, "swiglu_limit", impl="torch", limit=(7.0, 1.702)), **tol)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("fmt, dtype", [("float32", torch.float32), ("int8", torch.float32),
                                        ("auto", torch.bfloat16)])
def test_paged_attention(backend, fmt, dtype, window):
    batch = Batch(MIXED_BATCH, 16, fmt, fmt, dtype=dtype, device=DEVICE)
    batch.q = batch.q.to(dtype)
    assert attention_kernel(dtype, batch.cache) is not None, f"{backend.name} does not attend over {fmt} pools"
    ours = batch.paged(window).double()
    ref = batch.reference(window)
    atol, rtol = TOLERANCE["bfloat16" if dtype == torch.bfloat16 else fmt]
    torch.testing.assert_close(ours, ref, atol=atol * 4, rtol=rtol * 4)
