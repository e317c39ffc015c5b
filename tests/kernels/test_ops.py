"""The C++ small ops' own promises: an unknown activation refused, rows independent of the batch.
Their results against the plain-torch references are tests/kernels/test_backend_ops.py's, for
every backend."""

from __future__ import annotations

import pytest
import torch

from minerva.kernels import native, ops

pytestmark = pytest.mark.skipif(not native.capable(),
                                reason="this CPU cannot run the native kernels")
G = torch.Generator().manual_seed(0)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert native.load() is not None, native.unavailable_reason


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
