"""The CPU backend: Minerva's C++ kernels (csrc/), where the CPU can run them."""

from __future__ import annotations

import contextlib

import gguf
import torch

from minerva.kernels import native, tune
from minerva.kernels.base import KernelBackend

Q = gguf.GGMLQuantizationType
# GGML types qmatmul.cpp multiplies straight from their blocks
MATMUL_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4,
                          Q.F32, Q.F16, Q.BF16})
ACTIVATIONS = (torch.float32, torch.bfloat16)
KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


class CpuBackend(KernelBackend):
    """Packed matmuls, the small ops, paged attention and whole decoder layers in C++, for
    float32 or bfloat16 activations; the compiled module is loaded once (`native.load`)."""

    name = "cpu"
    devices = checked = ("cpu",)

    def __init__(self):
        self.module = native.load()
        self.unavailable_reason = native.unavailable_reason
        tune.ensure(self.module)  # the kernel choices measured for this build (planned on its first use)

    def matmul_kernel(self, qtype, dtype: torch.dtype):
        return self.module if qtype in MATMUL_TYPES and dtype in ACTIVATIONS else None

    def op_kernel(self, x: torch.Tensor):
        return self.module if x.dtype in ACTIVATIONS and x.shape[-1] % 16 == 0 else None

    def attention_kernel(self, dtype: torch.dtype, k_pool: torch.Tensor, v_pool: torch.Tensor):
        if dtype not in ACTIVATIONS or k_pool.shape[-1] % 16 or k_pool.dtype not in KV_DTYPES \
                or v_pool.dtype not in KV_DTYPES:
            return None
        return self.module

    def layer_kernel(self, dtype: torch.dtype):
        return self.module if dtype in ACTIVATIONS else None

    def default_dtype(self, device: torch.device) -> str:
        # with AVX-512 BF16, bf16 activations are the fast choice (bf16 dot products); the
        # AVX2 build widens bf16 to float32 for its FMAs, so float32 loses nothing there
        return "bfloat16" if self.module is not None and native.built == "avx512" else "float32"

    def default_activations(self, device: torch.device) -> str:
        # both builds: integer dot products on 8-bit activations (32 multiply-adds an
        # instruction, VNNI where the CPU has it) against the float path's decoding of every
        # weight to float32 (AVX2) or bf16 (AVX-512): 1.5-3x the decode speed on AVX2, and on
        # AVX-512 1.3-1.6x on the pulled models and 2.6x on a 1.1B Q4_K_M shape, prefill the
        # same or faster (docs/models.md, `--activations`)
        return "int8" if self.module is not None else "float"

    @contextlib.contextmanager
    def step(self):
        """Run torch's own ops on one thread while the kernels keep torch's thread count.

        With the kernels doing the heavy work, what torch does in an engine step is glue and
        vocabulary-sized sampling ops: too small to gain from threads, but fork-join
        parallel, so on a machine where other processes take cores each one can stall for a
        scheduler time slice (measured: 13.7 tokens/s on two threads against 58 with this).
        """
        threads = torch.get_num_threads()
        if self.module is None or threads == 1:
            yield
            return
        self.module.set_num_threads(threads)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            self.module.set_num_threads(0)
