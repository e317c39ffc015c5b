"""The C++ ops between the matmuls against their plain-torch references (minerva.kernels.ops)."""

from __future__ import annotations

import pytest
import torch

from minerva.kernels import native, ops

pytestmark = pytest.mark.skipif(not native.capable(),
                                reason="this CPU cannot run the native kernels")
G = torch.Generator().manual_seed(0)
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert native.load() is not None, native.unavailable_reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 640), (3, 4, 256)])
def test_rms_norm(shape, dtype):
    x = (torch.randn(shape, generator=G) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=G)
    ours = ops.rms_norm(x, w, 1e-6)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), ops.rms_norm_torch(x, w, 1e-6).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_updates_the_residual(dtype):
    h, a = torch.randn(5, 576, generator=G).to(dtype), torch.randn(5, 576, generator=G).to(dtype)
    w = torch.randn(576, generator=G)
    h_ref = h.clone()
    ref = ops.add_rms_norm(h_ref, a, w, 1e-5, impl="torch")
    ours = ops.add_rms_norm(h, a, w, 1e-5)
    assert torch.equal(h, h_ref)  # the add itself is one elementwise op either way
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])
    # one pass adds and normalizes: the norm of the stored (rounded) sums, as rms_norm gives it
    assert torch.equal(ours, ops.rms_norm(h, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dim", [(9, 64), (4, 256), (1, 32)])
def test_rope_on_a_strided_view(heads, dim, dtype):
    """Rotates q inside a fused QKV output (a view with a wider token stride), like the model does."""
    T = 6
    qkv = torch.randn(T, heads * dim + 2 * dim, generator=G).to(dtype)
    q = qkv[:, :heads * dim].view(T, heads, dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = ops.rope_cos_sin(torch.tensor([0, 1, 5, 17, 300, 4095]), inv_freq)
    ref = ops.rope_torch(q.clone(), cos, sin)
    rest = qkv[:, heads * dim:].clone()
    ours = ops.rope(q, cos, sin)
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])
    assert torch.equal(qkv[:, heads * dim:], rest)  # the rest of the row is untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_limit"])
def test_act_mul(activation, dtype):
    gu = (torch.randn(9, 2 * 1536, generator=G) * 4).to(dtype)
    gu[0, :8] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, 8.0])  # tails of exp
    gu[1, 1536:1544] = torch.tensor([-100.0, -7.5, -7.0, -6.9, 6.9, 7.0, 7.5, 100.0])  # up around GPT-OSS's limit
    limit = (7.0, 1.702) if activation == "swiglu_limit" else None
    ours = ops.act_mul(gu, activation, limit=limit)
    ref = ops.act_mul(gu, activation, impl="torch", limit=limit)
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])


@pytest.mark.skipif(not native.capable(), reason="this CPU cannot run the packed kernels")
def test_act_mul_rejects_an_unknown_activation_id():
    with pytest.raises(RuntimeError, match="unknown activation 7"):
        native.load().act_mul(torch.zeros(2, 64), 7)


def test_rows_do_not_depend_on_the_batch():
    x = torch.randn(11, 640, generator=G)
    w = torch.randn(640, generator=G)
    full = ops.rms_norm(x, w, 1e-6)
    for i in (0, 4, 10):
        assert torch.equal(ops.rms_norm(x[i:i + 1], w, 1e-6), full[i:i + 1])
    gu_in = torch.randn(11, 64, generator=G)
    full = ops.act_mul(gu_in, "gelu_tanh")
    assert torch.equal(ops.act_mul(gu_in[3:4], "gelu_tanh"), full[3:4])
