"""The Triton paged attention (minerva/kernels/cuda/attention.py) against the float64 dense
reference of tests/kernels/test_paged_attention.py, over pools whose blocks are shuffled across
requests: prefill from position 0, prefill chunks after a cached prefix, decode; GQA,
sliding windows, sinks, half and int8 pools. Without a GPU under Triton's interpreter. (The
float32 pools at block sizes 16 and 4 are tests/kernels/test_backend_ops.py's, for every backend.)"""

from __future__ import annotations

import pytest
import torch

from minerva.errors import MinervaError
from minerva.kernels.attention import as_table_tensor
from tests.kernels.test_paged_attention import HKV, SCALE, Batch, H

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[test]')")
from minerva.kernels.cuda import attention as tattn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (keys after this step, queries this step): a prompt from 0, a chunk after a prefix, decodes
SPECS = [(21, 21), (40, 6), (1, 1), (33, 1)]


def triton_attention(batch: Batch, window, sinks=None) -> torch.Tensor:
    c, layer = batch.cache, batch.layer
    scales = c.scales["k"] is not None
    empty = torch.empty(0, device=DEVICE)
    return tattn.paged_attention(
        batch.q, c.data["k"][layer], c.data["v"][layer], c.scales["k"][layer] if scales else empty,
        c.scales["v"][layer] if scales else empty, as_table_tensor(batch.tables, DEVICE),
        torch.tensor([L for L, _ in batch.specs], device=DEVICE), torch.tensor(batch.query_start_loc, device=DEVICE),
        batch.positions, window or 0, SCALE, empty if sinks is None else sinks)


def test_sinks_join_the_denominator():
    b = Batch(SPECS, 16, device=DEVICE, seed=3)
    sinks = torch.linspace(-2.0, 3.0, H, device=DEVICE)
    for window in (None, 4):
        out = triton_attention(b, window, sinks)
        torch.testing.assert_close(out.cpu().double(), b.reference(window, sinks.cpu()).cpu(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []), ids=str)
def test_half_pools_and_queries(dtype):
    b = Batch(SPECS, 16, k_format="auto", v_format="auto", dtype=dtype, device=DEVICE, seed=1)
    b.q = b.q.to(dtype)
    out = triton_attention(b, None)
    assert out.dtype == dtype
    ref = b.reference(None)  # from the float32 K/V: the pool and q rounded to dtype
    torch.testing.assert_close(out.cpu().double(), ref.cpu(), atol=2e-2, rtol=2e-2)


def test_int8_pool_matches_the_torch_path_on_the_same_pool():
    b = Batch(SPECS, 16, k_format="int8", v_format="int8", device=DEVICE, seed=2)
    out = triton_attention(b, 7)
    ref = b.paged(7, impl="torch")  # scaled_dot_product_attention over the dequantized pool
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_a_request_does_not_depend_on_its_batch():
    b = Batch(SPECS, 16, device=DEVICE, seed=4)
    full = triton_attention(b, None)
    s, e = b.query_start_loc[1], b.query_start_loc[2]
    c = b.cache
    empty = torch.empty(0, device=DEVICE)
    one = tattn.paged_attention(b.q[s:e], c.data["k"][b.layer], c.data["v"][b.layer], empty, empty,
                                as_table_tensor([b.tables[1]], DEVICE), torch.tensor([SPECS[1][0]]),
                                torch.tensor([0, e - s]), b.positions[s:e], 0, SCALE, empty)
    assert torch.equal(one, full[s:e])  # request 1 alone: bit for bit what it got in the batch


def test_bad_pools_are_one_clear_error():
    q = torch.zeros(1, H, 64, device=DEVICE)
    pool = torch.zeros(2, 6, HKV, 64, device=DEVICE)  # a block size that is not a power of two
    empty = torch.empty(0, device=DEVICE)
    with pytest.raises(MinervaError, match="no Triton kernel for pools"):
        tattn.paged_attention(q, pool, pool, empty, empty, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([1]),
                              torch.tensor([0, 1]), torch.tensor([0]), 0, 1.0, empty)
