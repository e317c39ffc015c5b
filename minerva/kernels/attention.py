"""Paged KV cache and paged attention: the C++ kernel, and the plain-torch reference.

The pool is a set of fixed-size blocks shared by all requests; a request's keys
live in the blocks its block table lists, in order. A token's slot is
`block_id * block_size + offset`.

Attention runs one request at a time, on exactly that request's keys with its
own mask, so a request's output is bitwise the same whatever it is batched with
(no padding to another request's length, no shared reduction). The C++ kernel
(csrc/attention.cpp) keeps that property with one work item per query row and KV
head; it covers float32/bfloat16/int8 pools on CPUs that run the native kernels
(`minerva.kernels.dispatch` decides), and attends over the other pools (float16, fp8) widened
to float32 a request at a time; the torch path covers everything else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minerva.kernels import dispatch, hugepages
from minerva.kernels.kv_layout import KVLayout, single
from minerva.kernels.kv_quant import (
    SCALE_DTYPE, dequantize_kv, kv_format, quantize_kv, resolve_format, storage_dtype)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized pool tensor; on CPU in 2 MiB pages (`minerva.kernels.hugepages`), since
    attention streams long contexts' keys and values from it as decode streams weights."""
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return hugepages.pool(n).view(dtype).view(shape)


class PagedKVCache:
    """Preallocated pools k/v [num_blocks, block_size, Hkv, D] (+ scales [num_blocks,
    block_size, Hkv] float32 for quantized formats), listed per layer: `data[kind][layer]`.
    With a `layout` (`minerva.kernels.kv_layout`) several layers share a pool tensor, each
    with its own group's block table; without, every layer has its own."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, *, k_format: str, v_format: str, dtype: torch.dtype, device,
                 layout: KVLayout | None = None):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.k_format, self.v_format, self.dtype = k_format, v_format, dtype
        self.layout = layout or single(num_layers)
        if len(self.layout.layer_pool) != num_layers:
            raise ValueError(f"a KV layout for {len(self.layout.layer_pool)} layers, not {num_layers}")
        # "auto" means the compute dtype: store the resolved dtype's format name.
        self._formats = {"k": resolve_format(k_format, dtype), "v": resolve_format(v_format, dtype)}
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.data: dict[str, list[torch.Tensor]] = {}
        self.scales: dict[str, list[torch.Tensor] | None] = {}
        # Uninitialized: a slot is always written before it is read, and untouched pages of a
        # large CPU pool cost no resident memory until blocks are first used.
        pools = range(self.layout.num_pools)
        for kind, fmt in self._formats.items():
            data = [_empty(shape, storage_dtype(fmt, dtype), device) for _ in pools]
            self.data[kind] = [data[p] for p in self.layout.layer_pool]
            scales = [_empty(shape[:3], SCALE_DTYPE, device) for _ in pools] if kv_format(fmt).scaled else None
            self.scales[kind] = None if scales is None else [scales[p] for p in self.layout.layer_pool]
        self.stack_static: dict = {}  # (layers, dtype) -> what every step's stack_args shares

    @staticmethod
    def bytes_per_block(num_pools: int, block_size: int, num_kv_heads: int, head_dim: int,
                        k_format: str, v_format: str, dtype: torch.dtype) -> int:
        """Bytes one block takes over `num_pools` pools (a layout's, or one per layer), K and
        V and scales: size the pool from a budget."""
        tokens = block_size * num_kv_heads
        total = 0
        for fmt in (resolve_format(k_format, dtype), resolve_format(v_format, dtype)):
            element = torch.empty((), dtype=storage_dtype(fmt, dtype)).element_size()
            total += tokens * head_dim * element
            if kv_format(fmt).scaled:
                total += tokens * torch.empty((), dtype=SCALE_DTYPE).element_size()
        return num_pools * total

    @property
    def formats(self) -> dict[str, str]:
        """The K and V formats, "auto" resolved ({"k": "bfloat16", "v": "int8"})."""
        return dict(self._formats)

    @property
    def token_blocks(self) -> int:
        """How many blocks of block_size tokens the pool holds for every layer at once: what a
        pool of the same bytes with one table for all layers would have (a draft's pool size)."""
        return self.num_blocks // self.layout.num_groups

    @property
    def nbytes(self) -> int:
        tensors = {id(t): t for kind in ("k", "v") for t in self.data[kind] + (self.scales[kind] or [])}
        return sum(t.numel() * t.element_size() for t in tensors.values())  # shared pools once

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store K/V [T, Hkv, D] of T new tokens at their slots (int64 [T])."""
        kernel = attention_kernel(k.dtype, self)
        if kernel is not None and k.stride(2) == 1 and k.stride(1) == self.head_dim and v.stride(2) == 1 \
                and v.stride(1) == self.head_dim:
            for kind, x in (("k", k), ("v", v)):
                scales = self.scales[kind]
                kernel.kv_write(x, self.data[kind][layer], EMPTY if scales is None else scales[layer],
                                slot_mapping)
            return
        self.write_torch(layer, k, v, slot_mapping)

    def write_torch(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The plain-torch path of `write`."""
        for kind, x in (("k", k), ("v", v)):
            data, scale = quantize_kv(x, self._formats[kind])
            self.data[kind][layer].view(-1, self.num_kv_heads, self.head_dim)[slot_mapping] = data
            if scale is not None:
                self.scales[kind][layer].view(-1, self.num_kv_heads)[slot_mapping] = scale

    def gather(self, layer: int, block_table: torch.Tensor, num_tokens: int, dtype: torch.dtype,
               start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K/V [num_tokens - start, Hkv, D] of the tokens at positions start..num_tokens-1."""
        first, last = start // self.block_size, -(-num_tokens // self.block_size)
        blocks = block_table[first:last]
        lo, hi = start - first * self.block_size, num_tokens - first * self.block_size
        out = []
        for kind in ("k", "v"):
            data = self.data[kind][layer][blocks].flatten(0, 1)[lo:hi]
            scales = self.scales[kind]
            scale = None if scales is None else scales[layer][blocks].flatten(0, 1)[lo:hi]
            out.append(dequantize_kv(data, scale, dtype))
        return out[0], out[1]


def attention_kernel(dtype: torch.dtype, cache: PagedKVCache):
    """The backend's kernel for attention over `cache` with queries of `dtype`, or None."""
    return dispatch.attention_kernel(dtype, cache.data["k"][0], cache.data["v"][0])


def as_table_tensor(block_tables, device) -> torch.Tensor:
    """A list of per-request block-id tensors (or lists) as one zero-padded int64 [B, max]."""
    if isinstance(block_tables, torch.Tensor):
        return block_tables
    width = max((len(t) for t in block_tables), default=0)
    out = torch.zeros(len(block_tables), max(width, 1), dtype=torch.int64, device=device)
    for b, t in enumerate(block_tables):
        out[b, :len(t)] = torch.as_tensor(t, dtype=torch.int64)
    return out


EMPTY = torch.empty(0)


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, *, query_start_loc, seq_lens,
                    block_tables, positions: torch.Tensor, window: int | None, scale: float,
                    sinks: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """Causal (optionally sliding-window) attention of q [T, H, D] over the paged cache.

    Request b's queries are q[query_start_loc[b]:query_start_loc[b+1]], its last
    n tokens: positions seq_lens[b]-n .. seq_lens[b]-1 (chunked prefill, decode
    and speculative verification all have this shape). query_start_loc and seq_lens
    are lists or int64 tensors; block_tables a list of int64 tensors or a padded
    [B, max_blocks] tensor. sinks [H] (GPT-OSS): a logit per head in every softmax's
    denominator, with no value. impl: "auto" (the C++ kernel where it applies), "native"
    or "torch".
    """
    kernel = attention_kernel(q.dtype, cache) if impl != "torch" else None
    if kernel is None:
        if impl == "native":
            raise RuntimeError(f"no attention kernel for this case ({dispatch.backend(q.device).unavailable_reason})")
        wide = torch.empty((1, 1, cache.num_kv_heads, cache.head_dim))  # float32 pools
        native = impl == "auto" and q.device.type == "cpu" and dispatch.backend(q.device).name == "cpu"
        kernel = dispatch.attention_kernel(q.dtype, wide, wide) if native else None
        if kernel is not None:  # a pool the CPU kernel does not read (float16, fp8), widened request by request
            return _widened(kernel, q, cache, layer, list(map(int, query_start_loc)), list(map(int, seq_lens)),
                            block_tables, positions, window, scale, sinks)
        return paged_attention_torch(q, cache, layer, query_start_loc=list(map(int, query_start_loc)),
                                     seq_lens=list(map(int, seq_lens)), block_tables=block_tables,
                                     positions=positions, window=window, scale=scale, sinks=sinks)
    ks, vs = cache.scales["k"], cache.scales["v"]
    return kernel.paged_attention(
        q, cache.data["k"][layer], cache.data["v"][layer],
        EMPTY if ks is None else ks[layer], EMPTY if vs is None else vs[layer],
        as_table_tensor(block_tables, q.device), torch.as_tensor(seq_lens, dtype=torch.int64),
        torch.as_tensor(query_start_loc, dtype=torch.int64), positions, window or 0, scale,
        EMPTY if sinks is None else sinks.float().contiguous())


def _widened(kernel, q: torch.Tensor, cache: PagedKVCache, layer: int, query_start_loc: list[int],
             seq_lens: list[int], block_tables, positions: torch.Tensor, window: int | None, scale: float,
             sinks: torch.Tensor | None) -> torch.Tensor:
    """`paged_attention` over a pool whose format the kernel does not read: each request's keys
    and values (from the first its queries can reach) widened to float32 and attended by the
    kernel, positions counted from there, so that a row's result is the same in any chunk of
    its prompt and any batch (torch's attention blocks its sums by the lengths it is given)."""
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        if e == s:
            continue
        start = 0 if window is None else max(0, int(positions[s:e].min()) - window + 1)
        k, v = cache.gather(layer, block_tables[b], seq_len, torch.float32, start=start)
        out[s:e] = kernel.paged_attention(
            q[s:e], k[None], v[None], EMPTY, EMPTY, torch.zeros((1, 1), dtype=torch.int64),
            torch.tensor([seq_len - start]), torch.tensor([0, e - s]), positions[s:e] - start, window or 0, scale,
            EMPTY if sinks is None else sinks.float().contiguous())
    return out


def paged_attention_torch(q: torch.Tensor, cache: PagedKVCache, layer: int, *, query_start_loc: list[int],
                          seq_lens: list[int], block_tables, positions: torch.Tensor,
                          window: int | None, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch path of `paged_attention`: one request at a time, through
    scaled_dot_product_attention. The mask is built from `positions`; the batch layout
    is only used, on the host, to skip keys no query can reach (before the window of
    the first query) and the mask of a lone decode query, which sees every gathered key.
    """
    out = torch.empty_like(q)
    gqa = q.shape[1] != cache.num_kv_heads
    for b, seq_len in enumerate(seq_lens):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        n = e - s
        if n == 0:
            continue
        start = 0 if window is None else max(0, seq_len - n - window + 1)
        k, v = cache.gather(layer, block_tables[b], seq_len, q.dtype, start=start)
        mask = None
        if n > 1:
            key_pos = torch.arange(start, seq_len, device=q.device)
            diff = positions[s:e, None] - key_pos[None, :]
            mask = diff >= 0
            if window is not None:
                mask &= diff < window
        if sinks is None:
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            o = _attention_with_sinks(q[s:e].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask,
                                      scale, sinks)
        out[s:e] = o.transpose(0, 1)
    return out


def _attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """softmax([q.k * scale, sink]) without the sink's column, times v; q [H, n, D], k/v
    [Hkv, S, D], mask [n, S] (True: attend) or None."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0).float(), v.repeat_interleave(group, dim=0).float()
    scores = q.float() @ k.transpose(1, 2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return (probs @ v).to(q.dtype)
