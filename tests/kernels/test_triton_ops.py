"""The Triton small ops' own cases (minerva/kernels/cuda/ops.py): widths their blocks mask, the
exact GELU formula, their argument errors; against the plain-torch references of
minerva.kernels.ops, computed in float32 and rounded once as the kernels do. The common cases,
for every backend, are tests/kernels/test_backend_ops.py's. Without a GPU
under Triton's interpreter (conftest.py sets it), with one on the GPU."""

from __future__ import annotations

import math

import pytest
import torch

from minerva.errors import MinervaError
from minerva.kernels import ops

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[test]')")
from minerva.kernels.cuda import ops as tops  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
# the interpreter casts float32 to bfloat16 by truncation (a GPU rounds to nearest even): bf16 on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if GPU else [])


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the last bit of got's dtype, float32 up to a few (a norm sums its squares in
    another order than torch)."""
    rel = {torch.float32: 2 ** -20, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[got.dtype]
    err = (got.cpu().float() - want.float()).abs()
    assert (err <= rel * want.float().abs() + 1e-6 * rel * want.float().abs().max()).all(), err.max()


def rand(*shape, dtype, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [100])  # a width the block masks (the C++ ops take multiples of 16)
def test_rms_norm_and_the_residual_add(dtype, d):
    x, a, w = rand(7, d, dtype=dtype), rand(7, d, dtype=dtype, seed=1), rand(d, dtype=torch.float32, seed=2)
    close(tops.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6), ops.rms_norm_torch(x.float(), w, 1e-6).to(dtype))
    h = x.clone().to(DEVICE)
    y = tops.add_rms_norm(h, a.to(DEVICE), w.to(DEVICE), 1e-5)
    summed = (x.float() + a.float()).to(dtype)  # h += a in h's dtype
    assert torch.equal(h.cpu(), summed)
    close(y, ops.rms_norm_torch(summed.float(), w, 1e-5).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "swiglu_limit"])
def test_act_mul(dtype, act):
    gu = rand(6, 2 * 1500, dtype=dtype)  # 1500: more than one block of a row, the last one masked
    g, u = gu.float().chunk(2, dim=-1)
    if act == "swiglu_limit":
        got = tops.act_mul(gu.to(DEVICE), tops.ACT_SWIGLU_LIMIT, 7.0, 1.702)
        g = g.clamp(max=7.0)
        want = (u.clamp(-7.0, 7.0) + 1) * (g * torch.sigmoid(g * 1.702))
    else:
        got = tops.act_mul(gu.to(DEVICE), ops.ACT_IDS[act])
        want = ops.ACTIVATIONS[act](g) * u
    assert got.shape == (6, 1500) and got.dtype == dtype
    # torch's tanh reaches -1 exactly in float32 where the sigmoid form keeps a tail of about
    # 1e-7: the tolerance tests/kernels/test_ops.py gives the C++ kernel, which computes it the same way
    tol = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.cpu().float(), want.to(dtype).float(), atol=tol, rtol=tol)


def test_gelu_tanh_is_the_formula():
    g = torch.linspace(-8, 8, 64)
    got = tops.act_mul(torch.cat([g, torch.ones(64)])[None].to(DEVICE), tops.ACT_GELU_TANH)[0].cpu()
    want = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_one_clear_error():
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(MinervaError, match=r"weight must be float32 \[64\]"):
        tops.rms_norm(x, torch.zeros(64, dtype=torch.float16, device=DEVICE), 1e-6)
    with pytest.raises(MinervaError, match="rope_: x must be"):
        tops.rope_(x, x, x)
    with pytest.raises(MinervaError, match="act_mul"):
        tops.act_mul(x, 5)
