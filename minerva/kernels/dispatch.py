"""The one place that decides which kernel runs: backends by name, one chosen per device type.

`BACKENDS` names every backend: `reference` (plain torch, every device; what all kernels are
tested against), `cpu` (Minerva's C++ kernels) and `triton` (the GPU kernels, loaded only
when asked for). Each says on which device types it runs (`devices`) and on which it has
passed its tests on real hardware (`checked`). A device type runs the backend chosen for it
(`choose`, from `--kernels NAME`), else the first of `PREFERRED` that is checked there, else
the reference; a backend that covers nothing for a case sends that case to the reference.
Callers ask the functions below with the tensors at hand and never branch on the device.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from minerva.errors import MinervaError
from minerva.kernels.base import KernelBackend
from minerva.kernels.cpu import CpuBackend


# a backend class, or its qualified name where importing it needs a package only some have
# (the Triton kernels import triton), imported when that backend is first asked for
BACKENDS: dict[str, type[KernelBackend] | str] = {
    "reference": KernelBackend, "cpu": CpuBackend, "triton": "minerva.kernels.cuda.backend.TritonBackend"}
PREFERRED = {"cpu": ("cpu",), "cuda": ("triton",)}  # by device type, the backends `auto` tries in order
NEEDS = {"triton": "triton"}  # the package a backend imports
_chosen: dict[str, str] = {}  # device type -> the backend --kernels named
_loaded: dict[str, KernelBackend] = {}


def backend_class(name: str) -> type[KernelBackend]:
    entry = BACKENDS[name]
    if isinstance(entry, str):
        module, _, cls = entry.rpartition(".")
        entry = getattr(importlib.import_module(module), cls)
    return entry


def available(name: str) -> bool:
    """Whether the backend can be imported here (not whether it covers anything)."""
    return name in BACKENDS and (name not in NEEDS or importlib.util.find_spec(NEEDS[name]) is not None)


def _checked(name: str, kind: str) -> bool:
    return available(name) and kind in backend_class(name).checked


def auto_name(kind: str) -> str:
    """The backend `--kernels auto` runs on a device type."""
    return next((n for n in PREFERRED.get(kind, ()) if _checked(n, kind)), "reference")


def gpu_ready() -> bool:
    """Whether a GPU is present and a backend that passed its GPU tests would run on it: only
    then is a GPU the default device (the reference path on a GPU is slower than the CPU's
    kernels on most machines)."""
    return torch.cuda.is_available() and auto_name("cuda") != "reference"


def choose(kind: str, name: str | None) -> str:
    """Run backend `name` (None or "auto": the default) on device type `kind`; returns the
    name that runs. A name the device cannot run, or whose package is missing, is an error."""
    name = name or "auto"
    if name == "auto":
        _chosen.pop(kind, None)
        name = auto_name(kind)
    else:
        if name not in BACKENDS:
            raise MinervaError(f"unknown --kernels '{name}'; choose auto, {', '.join(BACKENDS)}")
        if not available(name):
            raise MinervaError(f"--kernels {name} needs the {NEEDS[name]} package: pip install {NEEDS[name]}")
        devices = backend_class(name).devices
        if kind not in devices:
            raise MinervaError(f"--kernels {name} runs on {' or '.join(devices)}, not on --device {kind}; "
                               f"use --kernels auto or reference")
        _chosen[kind] = name
    if kind in _loaded and type(_loaded[kind]) is not backend_class(name):
        del _loaded[kind]
    return name


def backend(device: torch.device | str) -> KernelBackend:
    """The backend of `device`'s type, made once per process (asked on every op: no new
    torch.device for one that is already one)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    b = _loaded.get(kind)
    if b is None:
        name = _chosen.get(kind) or auto_name(kind)
        b = _loaded[kind] = backend_class(name)()
    return b


def describe() -> list[str]:
    """A line per backend: where it runs and whether it is the default there (for --version)."""
    lines = []
    for name in BACKENDS:
        if not available(name):
            lines.append(f"{name}: not installed (pip install {NEEDS[name]})")
            continue
        cls = backend_class(name)
        unchecked = [d for d in cls.devices if d not in cls.checked]
        defaults = [d for d in cls.devices if auto_name(d) == name]
        parts = [f"runs on {', '.join(cls.devices)}"]
        if defaults:
            parts.append(f"default on {', '.join(defaults)}")
        if unchecked:
            parts.append(f"not yet checked on {', '.join(unchecked)}: only with --kernels {name}")
        lines.append(f"{name}: {'; '.join(parts)}")
    return lines


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
