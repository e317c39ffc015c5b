"""The one place that decides which kernel runs: a backend per device type.

`BACKENDS` maps a device type to its backend class (one level, no factories of
factories); a device type with none, or a backend that covers nothing for a case, runs
the plain-torch reference. A GPU backend registers under "cuda" beside the CPU's.
Callers ask the functions below with the tensors at hand and never branch on the device.
"""

from __future__ import annotations

import torch

from minerva.kernels.base import KernelBackend
from minerva.kernels.cpu import CpuBackend

BACKENDS: dict[str, type[KernelBackend]] = {"cpu": CpuBackend}
_loaded: dict[str, KernelBackend] = {}


def backend(device: torch.device | str) -> KernelBackend:
    """The backend of `device`'s type, made once per process (asked on every op: no new
    torch.device for one that is already one)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    b = _loaded.get(kind)
    if b is None:
        b = _loaded[kind] = BACKENDS.get(kind, KernelBackend)()
    return b


def matmul_kernel(device, qtype, dtype: torch.dtype):
    return backend(device).matmul_kernel(qtype, dtype)


def op_kernel(x: torch.Tensor):
    return backend(x.device).op_kernel(x)


def attention_kernel(dtype: torch.dtype, k_pool: torch.Tensor, v_pool: torch.Tensor):
    return backend(k_pool.device).attention_kernel(dtype, k_pool, v_pool)


def layer_kernel(device, dtype: torch.dtype):
    return backend(device).layer_kernel(dtype)


def default_dtype(device: torch.device) -> str:
    return backend(device).default_dtype(device)


def default_activations(device: torch.device) -> str:
    return backend(device).default_activations(device)


def step(device: torch.device):
    return backend(device).step()
