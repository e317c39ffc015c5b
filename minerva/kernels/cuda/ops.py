"""The small ops between the matmuls as Triton kernels, with the CPU kernels' entry points
(`minerva/kernels/base.py`): `rms_norm`, `add_rms_norm`, `rope_` and `act_mul`.

Each computes in float32 and rounds once to x's dtype, as the C++ kernels do; one program
per row (per token and head for the rotary embedding). tests/kernels/test_triton_ops.py holds them
to the plain-torch references in `minerva.kernels.ops`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minerva.errors import MinervaError

ACT_SILU, ACT_GELU_TANH, ACT_SWIGLU_LIMIT = 0, 1, 2  # ops.ACT_IDS and ops.SWIGLU_LIMIT_ID


@triton.jit
def _norm_kernel(x_ptr, a_ptr, w_ptr, y_ptr, D, stride_x, stride_a, stride_y, eps,
                 ADD: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(x_ptr + r * stride_x + cols, mask=m, other=0.0)
    if ADD:  # the residual stream: h += a, rounded to h's dtype, then normed
        x = (x.to(tl.float32) + tl.load(a_ptr + r * stride_a + cols, mask=m, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + r * stride_x + cols, x, mask=m)
    h = x.to(tl.float32)
    h = h * (1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps))
    y = tl.load(w_ptr + cols, mask=m, other=0.0) * h
    tl.store(y_ptr + r * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, H, HALF, stride_t, stride_h, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    p = x_ptr + t * stride_t + h * stride_h + i
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * HALF + i, mask=m, other=0.0)
    s = tl.load(sin_ptr + t * HALF + i, mask=m, other=0.0)
    dt = x_ptr.dtype.element_ty
    tl.store(p, (x1 * c + (-x2) * s).to(dt), mask=m)
    tl.store(p + HALF, (x2 * c + x1 * s).to(dt), mask=m)


@triton.jit
def _sigmoid(z):
    e = tl.exp(-tl.abs(z))  # never overflows
    return tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _act_kernel(gu_ptr, y_ptr, I, stride_gu, stride_y, limit, alpha, ACT: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(gu_ptr + r * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * stride_gu + I + cols, mask=m, other=0.0).to(tl.float32)
    if ACT == 0:  # SiLU
        y = g * _sigmoid(g) * u
    elif ACT == 1:  # GELU, tanh approximation: 0.5 g (1 + tanh(z)) = g sigmoid(2 z), as the C++ kernel
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        y = g * _sigmoid(2.0 * z) * u
    else:  # GPT-OSS: gate clamped above at limit, up to +-limit, (up + 1) gate sigmoid(alpha gate)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = (u + 1.0) * (g * _sigmoid(alpha * g))
    tl.store(y_ptr + r * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.stride(-1) != 1:
        raise MinervaError(f"{what} must be float16, bfloat16 or float32 with contiguous rows, got {x.dtype}")
    return x.reshape(-1, x.shape[-1])


def _norm(x: torch.Tensor, a: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x, "x")
    D = rows.shape[1]
    if w.dtype != torch.float32 or w.shape != (D,):
        raise MinervaError(f"the norm's weight must be float32 [{D}], got {w.dtype} {tuple(w.shape)}")
    y = torch.empty_like(rows)
    if rows.shape[0]:
        a_rows = rows if a is None else _rows(a, "a")
        _norm_kernel[(rows.shape[0],)](rows, a_rows, w, y, D, rows.stride(0), a_rows.stride(0), y.stride(0), eps,
                                       ADD=a is not None, BLOCK=triton.next_power_of_2(D))
    return y.view(x.shape)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim."""
    return _norm(x, None, w, eps)


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """h += a in place (h contiguous), then RMSNorm(h)."""
    if not h.is_contiguous() or a.shape != h.shape or a.dtype != h.dtype:
        raise MinervaError("add_rms_norm: h must be contiguous and a of h's shape and dtype")
    return _norm(h, a.contiguous(), w, eps)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding of x [T, heads, D] in place; cos, sin float32 [T, D / 2]."""
    if x.dim() != 3 or x.stride(2) != 1 or x.shape[2] % 2:
        raise MinervaError(f"rope_: x must be [T, heads, D] with D even and contiguous, got {tuple(x.shape)}")
    T, H, D = x.shape
    if cos.shape != (T, D // 2) or sin.shape != cos.shape or cos.dtype != torch.float32:
        raise MinervaError(f"rope_: cos and sin must be float32 [{T}, {D // 2}]")
    if T and H:
        _rope_kernel[(T, H)](x, cos.contiguous(), sin.contiguous(), H, D // 2, x.stride(0), x.stride(1),
                             BLOCK=triton.next_power_of_2(D // 2))
    return x


def act_mul(gu: torch.Tensor, act: int, limit: float = 0.0, alpha: float = 0.0) -> torch.Tensor:
    """act(gate) * up for gu [T, 2I] holding gate then up (act: ACT_SILU, ACT_GELU_TANH, or
    ACT_SWIGLU_LIMIT with limit and alpha)."""
    if gu.dim() != 2 or gu.shape[1] % 2 or act not in (ACT_SILU, ACT_GELU_TANH, ACT_SWIGLU_LIMIT):
        raise MinervaError(f"act_mul: gate_up must be [T, 2I] and act one of 0, 1, 2, got {tuple(gu.shape)}, {act}")
    rows = _rows(gu, "gate_up")
    I = rows.shape[1] // 2
    y = torch.empty(rows.shape[0], I, dtype=gu.dtype, device=gu.device)
    if rows.shape[0] and I:
        block = min(1024, triton.next_power_of_2(I))
        _act_kernel[(rows.shape[0], triton.cdiv(I, block))](rows, y, I, rows.stride(0), y.stride(0), limit, alpha,
                                                            ACT=act, BLOCK=block)
    return y
