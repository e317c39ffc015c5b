"""The small ops between the matmuls, each with its plain-torch reference.

Where the device's backend covers them (on CPU: the C++ kernels, float32 or bfloat16
activations), RMSNorm, the residual add fused into the next norm, rotary embedding and
the gated activations each take one kernel call instead of several torch ops; elsewhere
the torch code below runs. tests/kernels/test_ops.py holds the two to each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minerva.kernels import dispatch

ACT_IDS = {"silu": 0, "gelu_tanh": 1}
SWIGLU_LIMIT_ID = 2  # csrc/kernels.h ACT_SWIGLU_LIMIT: the native act_mul for "swiglu_limit", with (limit, alpha)
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * h).to(x.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, impl: str = "auto") -> torch.Tensor:
    k = dispatch.op_kernel(x) if impl == "auto" and w.dtype == torch.float32 else None
    return k.rms_norm(x, w, eps) if k is not None else rms_norm_torch(x, w, eps)


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float,
                 impl: str = "auto") -> torch.Tensor:
    """h += a in place (the residual stream), then RMSNorm(h)."""
    k = (dispatch.op_kernel(h) if impl == "auto" and w.dtype == torch.float32 and h.is_contiguous()
         and a.dtype == h.dtype else None)
    if k is not None:
        return k.add_rms_norm(h, a.contiguous(), w, eps)
    h.add_(a)
    return rms_norm_torch(h, w, eps)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [T, D/2] of positions * inv_freq."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split ("neox") rotary embedding of x [T, heads, D]."""
    cos, sin = torch.cat((cos, cos), -1)[:, None, :], torch.cat((sin, sin), -1)[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Rotary embedding of x [T, heads, D]; the native path rotates x in place."""
    k = dispatch.op_kernel(x) if impl == "auto" and (x.shape[-1] // 2) % 16 == 0 else None
    if k is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        k.rope_(x, cos, sin)
        return x
    return rope_torch(x, cos, sin)


def act_mul(gate_up: torch.Tensor, activation: str, impl: str = "auto",
            limit: tuple[float, float] | None = None) -> torch.Tensor:
    """act(gate) * up for gate_up [T, 2I] holding gate then up. "swiglu_limit" is GPT-OSS's,
    with limit = (L, alpha): gate clamped above at L, up to ±L, and (up + 1) · gate · σ(alpha gate)."""
    k = dispatch.op_kernel(gate_up) if impl == "auto" and gate_up.dim() == 2 and (gate_up.shape[-1] // 2) % 16 == 0 else None
    if activation == "swiglu_limit":
        bound, alpha = limit
        if k is not None:  # computed in float32, rounded once
            return k.act_mul(gate_up, SWIGLU_LIMIT_ID, bound, alpha)
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=bound)
        return (up.clamp(-bound, bound) + 1) * (gate * torch.sigmoid(gate * alpha))
    if k is not None:
        return k.act_mul(gate_up, ACT_IDS[activation])
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up
