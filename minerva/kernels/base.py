"""What a device's kernels must offer, and how they say what they cover.

A backend answers two kinds of question: does it cover a case (`matmul_kernel`,
`op_kernel`, `attention_kernel`, `layer_kernel` return the object that runs it, or None),
and how to run a step on its device (`step`, `default_dtype`). The object a `*_kernel`
method returns has the entry points the callers use, named as in
`minerva/kernels/csrc/kernels.h`:

- matmul: `qmatmul(x, packed, qtype, rows, cols)`, `dequantize_rows(packed, qtype, cols)`, and
  with 8-bit activations `qmatmul_q8(x, packed, qtype, rows, cols)`
- ops: `rms_norm`, `add_rms_norm`, `rope_`, `act_mul`
- attention: `paged_attention(q, k_pool, v_pool, k_scale, v_scale, tables, seq_lens,
  query_start_loc, positions, window, scale, sinks)`, `kv_write(x, pool, scales, slots)`
- layer: `Packed(bytes, qtype, rows, cols, int8)` and `DecoderLayer(...)`, a whole decoder layer
  as one call (see `minerva.models.layers.DecoderLayer.make_fused`)

Where a backend covers nothing, the plain-torch reference runs; every kernel is tested
against it.
"""

from __future__ import annotations

import contextlib

import torch


class KernelBackend:
    """The kernels of one device type. This base covers nothing: every caller then runs
    the plain-torch reference."""

    name = "reference"
    devices: tuple[str, ...] = ("cpu", "cuda")  # the device types it runs on
    checked: tuple[str, ...] = ("cpu", "cuda")  # those where it passed its tests on real hardware
    unavailable_reason: str | None = None

    def matmul_kernel(self, qtype, dtype: torch.dtype):
        """What multiplies activations of `dtype` by a packed weight of GGML type `qtype`."""
        return None

    def op_kernel(self, x: torch.Tensor):
        """What runs the small ops (norms, rotary, gating) on x."""
        return None

    def attention_kernel(self, dtype: torch.dtype, k_pool: torch.Tensor, v_pool: torch.Tensor):
        """What stores K/V into pools like these and attends over them for queries of `dtype`."""
        return None

    def layer_kernel(self, dtype: torch.dtype):
        """What runs a whole decoder layer as one call, for activations of `dtype`."""
        return None

    def default_dtype(self, device: torch.device) -> str:
        """The activation dtype `--dtype auto` stands for on this device: float32 for the
        torch reference on a CPU, the fast half-precision type on a GPU."""
        if device.type == "cuda":
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return "float32"

    def default_activations(self, device: torch.device) -> str:
        """What `--activations auto` stands for on this device: float, unless a backend's
        int8 dot products are measured to be the fast choice."""
        return "float"

    def step(self):
        """A context for one engine step (the CPU backend sets its threads here)."""
        return contextlib.nullcontext()
