"""The Triton packed-weight kernels' own cases (minerva/kernels/cuda/qmatmul.py): their
dequantization against the gguf package's, bit for bit, and their argument errors (their
matmuls against a float64 one are tests/kernels/test_backend_ops.py's, for every backend). Without a GPU they run under Triton's interpreter on the CPU (float16 and float32
x there: the interpreter's tl.dot is wrong on bfloat16); on a GPU, bfloat16 too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from minerva.errors import MinervaError
from tests.helpers.quant_blocks import bits, random_blocks

GPU = torch.cuda.is_available()  # without one, conftest.py has set TRITON_INTERPRET before triton's import
pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[test]')")
from minerva.kernels.cuda import qmatmul as tq  # noqa: E402

DEVICE = "cuda" if GPU else "cpu"
TYPES = sorted(tq.TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_is_the_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, (5, 512), rng)
    ours = tq.dequantize_rows(torch.from_numpy(raw).to(DEVICE), qtype, 512).cpu().numpy()
    ref = gguf_dequantize(raw, qtype).reshape(5, 512)
    if GPU:  # the GPU may fuse a multiply and an add into one rounding
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-30)
    else:
        np.testing.assert_array_equal(bits(ours), bits(ref))


def test_bad_arguments_are_one_clear_error():
    raw = torch.zeros(4, 36, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(MinervaError, match="no Triton kernel for GGML type Q2_K"):
        tq.qmatmul(torch.zeros(1, 64, device=DEVICE), raw, QT.Q2_K, 4, 64)
    with pytest.raises(MinervaError, match=r"contiguous uint8 \[4, 34\]"):
        tq.qmatmul(torch.zeros(1, 32, device=DEVICE), raw, QT.Q8_0, 4, 32)
    with pytest.raises(MinervaError, match="not a multiple of its block of 32"):
        tq.qmatmul(torch.zeros(1, 48, device=DEVICE), raw, QT.Q8_0, 4, 48)
    with pytest.raises(MinervaError, match="x must be"):
        tq.qmatmul(torch.zeros(1, 32, dtype=torch.int32, device=DEVICE), raw[:, :34].contiguous(), QT.Q8_0, 4, 32)
