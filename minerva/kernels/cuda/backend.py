"""The GPU backend: the Triton kernels of this package behind `KernelBackend`'s questions.

Registered in `dispatch.BACKENDS` as `triton`, but not yet the default on a GPU: its kernels
have run under Triton's interpreter only (tests/kernels/test_triton_backend.py runs a whole model
through them on the CPU), so `--device cuda` runs the plain-torch reference unless
`--kernels triton` asks for these. Once benchmarks/gpu_check.py has passed on a GPU, "cuda"
joins `checked` and they become the default there.
"""

from __future__ import annotations

import contextlib

import torch

from minerva.kernels import act_quant
from minerva.kernels.base import KernelBackend
from minerva.kernels.cuda import attention as triton_attention
from minerva.kernels.cuda import ops as triton_ops
from minerva.kernels.cuda import qmatmul as triton_qmatmul
from minerva.kernels.kv_quant import quantize_kv, resolve_format

ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)
POOL_DTYPES = ACTIVATIONS + (torch.int8,)  # float pools, and int8 with scales


class TritonKernels:
    """The entry points `kernels/base.py` lists, on the Triton kernels."""

    qmatmul = staticmethod(triton_qmatmul.qmatmul)
    dequantize_rows = staticmethod(triton_qmatmul.dequantize_rows)
    rms_norm = staticmethod(triton_ops.rms_norm)
    add_rms_norm = staticmethod(triton_ops.add_rms_norm)
    rope_ = staticmethod(triton_ops.rope_)
    act_mul = staticmethod(triton_ops.act_mul)
    paged_attention = staticmethod(triton_attention.paged_attention)

    @staticmethod
    def qmatmul_q8(x: torch.Tensor, packed: torch.Tensor, qtype, rows: int, cols: int) -> torch.Tensor:
        """8-bit activations: x rounded as `act_quant` does, then the float kernel (the same
        results as the reference path's round trip; no integer dot products yet)."""
        xq = act_quant.round_trip(x, act_quant.block_for(qtype)).to(x.dtype)
        return triton_qmatmul.qmatmul(xq, packed, qtype, rows, cols)

    @staticmethod
    def kv_write(x: torch.Tensor, pool: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> None:
        """Store K or V rows [T, Hkv, D] at their slots, quantizing for an int8 pool."""
        data, scale = quantize_kv(x, "int8" if pool.dtype == torch.int8 else resolve_format("auto", pool.dtype))
        pool.view(-1, *pool.shape[2:])[slots] = data
        if scale is not None:
            scales.view(-1, scales.shape[2])[slots] = scale


class TritonBackend(KernelBackend):
    """Packed matmuls (the types `triton_qmatmul.TYPES` lists), the small ops and paged attention
    (float and int8 pools) on Triton kernels; no whole-layer kernel, so layers run the
    Python `forward` over these kernels."""

    name = "triton"
    devices = ("cuda",)
    checked = ()  # not yet run on a GPU

    def __init__(self):
        self.kernels = TritonKernels()

    def matmul_kernel(self, qtype, dtype: torch.dtype):
        return self.kernels if qtype in triton_qmatmul.TYPES and dtype in ACTIVATIONS else None

    def op_kernel(self, x: torch.Tensor):
        return self.kernels if x.dtype in ACTIVATIONS else None

    def attention_kernel(self, dtype: torch.dtype, k_pool: torch.Tensor, v_pool: torch.Tensor):
        block_size = k_pool.shape[1]
        if dtype not in ACTIVATIONS or k_pool.dtype not in POOL_DTYPES or v_pool.dtype != k_pool.dtype \
                or block_size & (block_size - 1):
            return None
        return self.kernels

    def step(self):
        return contextlib.nullcontext()
