"""Paged attention over the KV pool as a Triton kernel, with the C++ kernel's entry point.

One program per (query token, head): it walks the token's request's block table from the
first block its window reaches to the block holding its own position, 16 or so keys at a
time, with an online softmax in float32 (running max, running sum, rescaled accumulator),
and a sink logit per head joining the denominator at the end where the model has them
(GPT-OSS). Each query row is computed on its own, from its own keys only, so a request's
output does not depend on its batch. The loop's bounds come from the data (`while`: the
interpreter cannot run a `for` to a bound loaded at run time).

This is the general path, right for decode and prefill alike; prefill on tensor cores
(`tl.dot` over tiles of query rows) is the next step where a GPU is at hand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minerva.errors import MinervaError


@triton.jit
def _keys(pool_ptr, scale_ptr, slot, kvh, d, valid, HKV: tl.constexpr, D: tl.constexpr, SCALED: tl.constexpr):
    """K or V rows [BS, BLOCK_D] of one KV head at `slot`s, as float32 (int8 pools times their scales)."""
    x = tl.load(pool_ptr + (slot[:, None] * HKV + kvh) * D + d[None, :], mask=valid[:, None] & (d[None, :] < D),
                other=0.0).to(tl.float32)
    if SCALED:
        x = x * tl.load(scale_ptr + slot * HKV + kvh, mask=valid, other=0.0)[:, None]
    return x


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, req_ptr, pos_ptr, sinks_ptr, o_ptr,
                            stride_qt, stride_qh, stride_ot, stride_oh, stride_table, window, scale,
                            H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                            BLOCK_D: tl.constexpr, SCALED: tl.constexpr, SINKS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kvh = h // (H // HKV)
    b = tl.load(req_ptr + t)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=d < D, other=0.0).to(tl.float32)
    first = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)  # the first key it sees
    j = first // BS
    offs = tl.arange(0, BS)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    while j <= pos // BS:  # every block in range holds a key it sees
        block = tl.load(tables_ptr + b * stride_table + j)
        key_pos = j * BS + offs
        valid = (key_pos <= pos) & (key_pos >= first)
        slot = block * BS + offs
        k = _keys(k_ptr, ks_ptr, slot, kvh, d, valid, HKV, D, SCALED)
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = _keys(v_ptr, vs_ptr, slot, kvh, d, valid, HKV, D, SCALED)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
        j += 1
    if SINKS:  # a logit in the denominator with no value
        sink = tl.load(sinks_ptr + h)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha
    o = acc / l_i
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, o.to(o_ptr.dtype.element_ty), mask=d < D)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor,
                    v_scale: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, positions: torch.Tensor, window: int, scale: float,
                    sinks: torch.Tensor) -> torch.Tensor:
    """Causal (window > 0: sliding-window) attention of q [T, H, D] over pools [blocks,
    block_size, Hkv, D] (float, or int8 with float32 scales [blocks, block_size, Hkv]);
    tables [B, max blocks] int64, query_start_loc [B + 1], positions [T]; sinks [H] float32
    or empty. seq_lens is taken for the C++ kernel's signature: a query sees the keys up to
    its own position."""
    if q.dim() != 3 or q.stride(2) != 1 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise MinervaError("paged_attention: q must be [T, H, D] with contiguous rows, the pools [blocks, size, Hkv, D]")
    T, H, D = q.shape
    _, bs, hkv, pool_d = k_pool.shape
    scaled = k_pool.dtype == torch.int8
    if pool_d != D or H % hkv or bs & (bs - 1) or (scaled and (k_scale.numel() == 0 or v_scale.numel() == 0)) \
            or k_pool.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
        raise MinervaError(f"paged_attention: no Triton kernel for pools {tuple(k_pool.shape)} {k_pool.dtype} "
                           f"and q {tuple(q.shape)} (block size a power of two, H a multiple of Hkv, int8 with scales)")
    out = torch.empty_like(q)
    if T == 0:
        return out
    counts = query_start_loc[1:] - query_start_loc[:-1]
    # output_size: no device-to-host sync to learn the length (it is T)
    request = torch.repeat_interleave(torch.arange(len(counts), device=q.device), counts.to(q.device), output_size=T)
    tables = tables.to(torch.int64).contiguous()
    has_sinks = sinks.numel() > 0
    _paged_attention_kernel[(T, H)](
        q, k_pool, v_pool, k_scale if scaled else q, v_scale if scaled else q, tables, request,
        positions.to(torch.int64).contiguous(), sinks.float().contiguous() if has_sinks else q, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0), int(window), float(scale),
        H=H, HKV=hkv, D=D, BS=bs, BLOCK_D=triton.next_power_of_2(D), SCALED=scaled, SINKS=has_sinks)
    return out
