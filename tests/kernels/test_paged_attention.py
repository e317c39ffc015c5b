"""Paged KV cache and paged attention against a dense float64 reference.

The reference (`dense_attention`) takes each request's full K/V as contiguous
tensors, builds the causal / sliding-window mask explicitly and computes
softmax(q k^T * scale) v in float64: it shares no code with the paged path and
does not use scaled_dot_product_attention.
"""

from __future__ import annotations

import math

import pytest
import torch

from minerva.errors import MinervaError
from minerva.kernels import native
from minerva.kernels.attention import PagedKVCache, paged_attention
from minerva.kernels.kv_quant import KV_FORMATS, dequantize_kv, quantize_kv

H, HKV, D = 8, 2, 64
SCALE = D ** -0.5
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# "auto" takes the C++ kernel where it covers the case (CPU; float32/bfloat16/int8 pools)
IMPLS = ["torch", "auto"]

# (seq_len after this step, queries this step): a whole prompt from position 0,
# prefill chunks starting at a nonzero position, a first token, and decodes.
MIXED_BATCH = [(37, 37), (50, 7), (1, 1), (64, 1), (20, 12), (33, 1), (96, 3)]


def dense_attention(q, k, v, positions, window, scale, sinks=None):
    """Float64 reference for one request: q [n, H, D] at `positions`, keys at 0..L-1; sinks [H]:
    a logit per head appended to each row's scores, its probability then dropped."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    diff = positions[:, None] - torch.arange(k.shape[0], device=q.device)[None, :]
    visible = diff >= 0
    if window is not None:
        visible &= diff < window
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


class Batch:
    """Requests with random K/V in a shared pool whose blocks are shuffled across requests.

    Earlier tokens are written first, then this step's tokens of all requests in
    one `write`, as the runner does.
    """

    def __init__(self, specs, block_size, k_format="float32", v_format="float32",
                 dtype=torch.float32, device="cpu", seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.specs = specs
        blocks_per_req = [math.ceil(L / block_size) for L, _ in specs]
        num_blocks = sum(blocks_per_req) + 5  # a few blocks nobody owns
        order = torch.randperm(num_blocks, generator=gen)
        tables, need, free = [[] for _ in specs], list(blocks_per_req), iter(order.tolist())
        while any(need):  # deal shuffled blocks round-robin: every request's blocks are scattered
            for i in range(len(specs)):
                if need[i]:
                    tables[i].append(next(free))
                    need[i] -= 1
        self.tables = [torch.tensor(t, device=device) for t in tables]
        self.cache = PagedKVCache(2, num_blocks, block_size, HKV, D, k_format=k_format,
                                  v_format=v_format, dtype=dtype, device=device)
        for kind in ("k", "v"):  # the pool starts uninitialized; zeros make stray writes visible
            for t in self.cache.data[kind] + (self.cache.scales[kind] or []):
                t.zero_()
        self.k = [torch.randn(L, HKV, D, generator=gen).to(device) for L, _ in specs]
        self.v = [torch.randn(L, HKV, D, generator=gen).to(device) for L, _ in specs]
        self.q = torch.randn(sum(n for _, n in specs), H, D, generator=gen).to(device)
        self.positions = torch.cat([torch.arange(L - n, L) for L, n in specs]).to(device)
        self.query_start_loc = [0]
        for _, n in specs:
            self.query_start_loc.append(self.query_start_loc[-1] + n)
        self.layer = 1
        for b, (L, n) in enumerate(specs):  # context computed in earlier steps
            if L > n:
                self.cache.write(self.layer, self.k[b][:L - n], self.v[b][:L - n], self.slots(b, 0, L - n))
        new = range(len(specs))
        self.cache.write(self.layer, torch.cat([self.k[b][L - n:] for b, (L, n) in enumerate(specs)]),
                         torch.cat([self.v[b][L - n:] for b, (L, n) in enumerate(specs)]),
                         torch.cat([self.slots(b, specs[b][0] - specs[b][1], specs[b][0]) for b in new]))

    def slots(self, b, start, end):
        pos = torch.arange(start, end, device=self.tables[b].device)
        bs = self.cache.block_size
        return self.tables[b][pos // bs] * bs + pos % bs

    def paged(self, window, requests=None, block_tables=None, impl="auto", sinks=None):
        """Paged attention over `requests` (indices, default all), in that order."""
        requests = range(len(self.specs)) if requests is None else requests
        qsl, q, pos = [0], [], []
        for b in requests:
            s, e = self.query_start_loc[b], self.query_start_loc[b + 1]
            q.append(self.q[s:e])
            pos.append(self.positions[s:e])
            qsl.append(qsl[-1] + e - s)
        tables = [self.tables[b] for b in requests] if block_tables is None else block_tables
        return paged_attention(torch.cat(q), self.cache, self.layer, query_start_loc=qsl,
                               seq_lens=[self.specs[b][0] for b in requests], block_tables=tables,
                               positions=torch.cat(pos), window=window, scale=SCALE, impl=impl, sinks=sinks)

    def reference(self, window, sinks=None):
        out = []
        for b in range(len(self.specs)):
            s, e = self.query_start_loc[b], self.query_start_loc[b + 1]
            out.append(dense_attention(self.q[s:e], self.k[b], self.v[b], self.positions[s:e], window, SCALE,
                                       sinks))
        return torch.cat(out)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [16, 1, 32])
def test_float32_pool_matches_dense_reference(block_size, window, device, impl):
    batch = Batch(MIXED_BATCH, block_size, device=device)
    out = batch.paged(window, impl=impl)
    assert out.shape == (batch.q.shape[0], H, D) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), batch.reference(window), atol=1e-5, rtol=0)


# GPT-OSS's sinks: per head, one far above every score (it takes most of the probability
# and sets the softmax max), one far below (no effect), and ordinary ones
SINKS = torch.tensor([8.0, -30.0, 0.0, 1.5, -1.0, 0.3, 4.0, -2.5])
# the same mixed batch with two rows of two parts (more than 1024 keys), merged with the sink
SINK_BATCH = MIXED_BATCH + [(1100, 2), (1030, 1)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
def test_sinks_match_dense_reference(fmt, window, impl):
    batch = Batch(SINK_BATCH, 16, fmt, fmt)
    out = batch.paged(window, impl=impl, sinks=SINKS)
    ref = batch.reference(window, SINKS)
    if fmt != "float32":  # the reference on the values the pool holds
        batch.k = [k.bfloat16().float() for k in batch.k]
        batch.v = [v.bfloat16().float() for v in batch.v]
        ref = batch.reference(window, SINKS)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    plain = batch.paged(window, impl=impl)
    assert (out - plain).abs().max() > 0.1  # the sinks changed the result
    for b in (0, len(SINK_BATCH) - 1):  # batch invariant with sinks too
        s, e = batch.query_start_loc[b], batch.query_start_loc[b + 1]
        assert torch.equal(batch.paged(window, requests=[b], impl=impl, sinks=SINKS), out[s:e])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_sliding_window_reads_only_keys_in_reach(block_size, impl):
    """Keys before the first query's window are poisoned with NaN in the pool: a
    masked NaN key still turns the output into NaN, so a finite, correct result
    shows they were never gathered."""
    window = 5
    batch = Batch(MIXED_BATCH, block_size)
    for b, (L, n) in enumerate(MIXED_BATCH):
        first = L - n - window + 1
        if first > 0:
            nan = torch.full((first, HKV, D), float("nan"))
            batch.cache.write(batch.layer, nan, nan, batch.slots(b, 0, first))
    out = batch.paged(window, impl=impl)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), batch.reference(window), atol=1e-5, rtol=0)


def test_padded_block_table_tensor_same_as_list():
    batch = Batch(MIXED_BATCH, 16)
    width = max(len(t) for t in batch.tables)
    padded = torch.zeros(len(batch.tables), width, dtype=torch.int64)
    for b, t in enumerate(batch.tables):
        padded[b, :len(t)] = t
    assert torch.equal(batch.paged(5, block_tables=padded), batch.paged(5))


# (max abs, rms) error of the output against the reference on unquantized K/V,
# for K/V ~ N(0, 1) (absmax per token-head about 3) and outputs of magnitude
# about 1. int8 stores each element within absmax/254 (~0.012), fp8 e4m3 within
# 2^-4 relative; the worst output is a query with one or two visible keys, where
# the score error moves the softmax too. Measured worst over 8 seeds: int8
# 0.024 / 0.0044, fp8 0.14 / 0.018, bf16 0.015 / 0.0012, fp16 0.0013 / 0.00015;
# the bounds leave about 1.7x room. A mixed pair uses the looser of its two.
TOLERANCE = {"float32": (1e-5, 1e-6), "bfloat16": (3e-2, 2.5e-3), "float16": (4e-3, 4e-4),
             "int8": (4e-2, 8e-3), "fp8": (2.5e-1, 3e-2)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k_format,v_format", [
    ("int8", "int8"), ("fp8", "fp8"), ("bfloat16", "bfloat16"), ("float16", "float16"),
    ("int8", "fp8"), ("fp8", "int8"), ("float32", "int8"), ("bfloat16", "fp8"), ("int8", "auto"),
])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("impl", IMPLS)
def test_quantized_pools_within_tolerance(k_format, v_format, window, device, impl):
    batch = Batch(MIXED_BATCH, 16, k_format, v_format, device=device)
    max_tol, rms_tol = max(TOLERANCE[f if f != "auto" else "float32"] for f in (k_format, v_format))
    err = batch.paged(window, impl=impl).double() - batch.reference(window)
    max_err, rms_err = err.abs().max().item(), err.pow(2).mean().sqrt().item()
    assert max_err <= max_tol, f"{k_format}/{v_format}: max error {max_err:.3g} > {max_tol}"
    assert rms_err <= rms_tol, f"{k_format}/{v_format}: rms error {rms_err:.3g} > {rms_tol}"


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_compute_with_auto_pool(impl):
    """dtype bfloat16, format auto: the pool stores bf16 and attention runs in bf16."""
    batch = Batch(MIXED_BATCH, 16, "auto", "auto", dtype=torch.bfloat16)
    assert batch.cache.data["k"][0].dtype == torch.bfloat16 and batch.cache.scales["k"] is None
    batch.q = batch.q.bfloat16()
    out = batch.paged(None, impl=impl)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), batch.reference(None), atol=3e-2, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("fmt", ["float32", "int8", "bfloat16"])
def test_batch_invariance(fmt, window, impl):
    """A request's output is bitwise the same alone and inside batches of other lengths."""
    check_batch_invariance(Batch(MIXED_BATCH, 16, fmt, fmt), window, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 5])
def test_batch_invariance_bfloat16_compute(window, impl):
    """bf16 q against a bf16 pool (the C++ kernel's bf16 dot products): bitwise the same too."""
    batch = Batch(MIXED_BATCH, 16, "auto", "auto", dtype=torch.bfloat16)
    batch.q = batch.q.bfloat16()
    check_batch_invariance(batch, window, impl)


def check_batch_invariance(batch, window, impl):
    full = batch.paged(window, impl=impl)
    for b in range(len(MIXED_BATCH)):
        s, e = batch.query_start_loc[b], batch.query_start_loc[b + 1]
        alone = batch.paged(window, requests=[b], impl=impl)
        assert torch.equal(alone, full[s:e]), f"request {b} differs alone vs in the batch"
        others = [i for i in reversed(range(len(MIXED_BATCH))) if i != b][:3]
        mixed = batch.paged(window, requests=others[:1] + [b] + others[1:], impl=impl)
        start = batch.specs[others[0]][1]
        assert torch.equal(mixed[start:start + e - s], alone)



@pytest.mark.skipif(not native.capable(), reason="CPU lacks the native kernels")
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "float32"), (torch.bfloat16, "auto"),
                                       (torch.bfloat16, "fp8"), (torch.bfloat16, "float16"), (torch.float32, "fp8")])
def test_a_row_is_the_same_alone_as_among_its_requests_rows(dtype, fmt, window, impl="auto"):
    """Each row of a request's several (a verification step, a prefill chunk) bitwise equals
    that row asked alone, as the one-row decode step at its position asks it (the bf16 kernel
    takes a request's rows together). The native kernel's promise, over the pools it widens
    (fp8, float16) too: the torch path multiplies a request's rows as one matrix."""
    batch = Batch([(40, 9), (96, 3), (37, 37), (200, 70)], 16, fmt, fmt, dtype=dtype)
    batch.q = batch.q.to(dtype)
    full = batch.paged(window, impl=impl)
    for b, (L, n) in enumerate(batch.specs):
        s = batch.query_start_loc[b]
        for i in range(n):
            alone = paged_attention(batch.q[s + i:s + i + 1], batch.cache, batch.layer, query_start_loc=[0, 1],
                                    seq_lens=[L], block_tables=[batch.tables[b]],
                                    positions=batch.positions[s + i:s + i + 1], window=window, scale=SCALE,
                                    impl=impl)
            assert torch.equal(alone[0], full[s + i]), f"request {b} row {i} differs alone"

# Rows longer than the kernel's part (1024 keys) are split into parts that run on different
# threads and are merged; request 0 has enough long rows that their partial results are
# held in two waves.
LONG_BATCH = [(6000, 2000), (2500, 1), (1100, 3), (70, 1)]


@pytest.mark.slow
@pytest.mark.skipif(not native.capable(), reason="CPU lacks the native kernels")
@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [None, 1500])
def test_long_rows_in_parts(fmt, window):
    batch = Batch(LONG_BATCH, 16, fmt, fmt)
    full = batch.paged(window)
    tol = 1e-5 if fmt == "float32" else TOLERANCE[fmt][0]
    for b, (L, n) in enumerate(LONG_BATCH):
        s = batch.query_start_loc[b]
        rows = sorted({0, n // 2, n - 1})
        ref = dense_attention(batch.q[s:s + n][rows], batch.k[b], batch.v[b],
                              batch.positions[s:s + n][rows], window, SCALE)
        torch.testing.assert_close(full[s:s + n][rows].double(), ref, atol=tol, rtol=0)
    for b in (1, 2, 3):  # alone: one wave and no other rows; in the batch: after request 0
        s, e = batch.query_start_loc[b], batch.query_start_loc[b + 1]
        assert torch.equal(batch.paged(window, requests=[b]), full[s:e])


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_float32_write_gather_round_trip_exact(block_size):
    batch = Batch(MIXED_BATCH, block_size)
    for b, (L, _) in enumerate(MIXED_BATCH):
        k, v = batch.cache.gather(batch.layer, batch.tables[b], L, torch.float32)
        assert torch.equal(k, batch.k[b]) and torch.equal(v, batch.v[b])
        for start in {0, L // 3, L - 1}:  # what a sliding window gathers
            k, v = batch.cache.gather(batch.layer, batch.tables[b], L, torch.float32, start=start)
            assert torch.equal(k, batch.k[b][start:]) and torch.equal(v, batch.v[b][start:])
    untouched = batch.cache.data["k"][0]
    assert not untouched.any(), "a write to layer 1 reached layer 0"


def test_quantized_pool_gather_equals_per_token_quantization():
    """The pool stores exactly quantize_kv of each token (scales are per token, per head)."""
    batch = Batch(MIXED_BATCH, 16, "int8", "fp8")
    for b, (L, _) in enumerate(MIXED_BATCH):
        k, v = batch.cache.gather(batch.layer, batch.tables[b], L, torch.float32)
        assert torch.equal(k, dequantize_kv(*quantize_kv(batch.k[b], "int8"), torch.float32))
        assert torch.equal(v, dequantize_kv(*quantize_kv(batch.v[b], "fp8"), torch.float32))


def test_int8_error_at_most_half_a_step():
    x = torch.randn(300, HKV, D) * torch.logspace(-3, 3, 300)[:, None, None]
    x[7] = 0  # an all-zero token: scale 0, dequantizes to 0
    data, scale = quantize_kv(x, "int8")
    assert data.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (300, HKV)
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127, atol=0, rtol=0)
    assert data.abs().max() <= 127
    err = (dequantize_kv(data, scale, torch.float32) - x).abs()
    assert (err <= scale[..., None] / 2 * (1 + 1e-5)).all()
    assert not dequantize_kv(data, scale, torch.float32)[7].any()


def test_fp8_error_bound():
    """e4m3: 3 mantissa bits, so rounding is within 2^-4 relative, or half the
    smallest subnormal step (2^-10 in scaled units) near zero."""
    x = torch.randn(300, HKV, D) * torch.logspace(-3, 3, 300)[:, None, None]
    data, scale = quantize_kv(x, "fp8")
    assert data.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(scale, x.abs().amax(-1) / 448, atol=0, rtol=0)
    err = (dequantize_kv(data, scale, torch.float32) - x).abs()
    bound = (2 ** -4 * x.abs() + 2 ** -10 * scale[..., None]) * (1 + 1e-5)
    assert (err <= bound).all()


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "float32"])
def test_float_formats_are_plain_casts(fmt):
    x = torch.randn(5, HKV, D)
    data, scale = quantize_kv(x, fmt)
    assert scale is None and torch.equal(data, x.to(getattr(torch, fmt)))


def test_unknown_format_is_a_minerva_error():
    with pytest.raises(MinervaError, match="int4.*auto, bfloat16, float16, float32, int8, fp8"):
        quantize_kv(torch.zeros(1, 1, 4), "int4")
    with pytest.raises(MinervaError, match="'q8_0'"):
        PagedKVCache(1, 2, 16, HKV, D, k_format="int8", v_format="q8_0", dtype=torch.float32, device="cpu")
    with pytest.raises(MinervaError, match="'e5m2'"):
        PagedKVCache.bytes_per_block(1, 16, HKV, D, "e5m2", "int8", torch.float32)
    with pytest.raises(MinervaError, match="auto"):
        PagedKVCache(1, 2, 16, HKV, D, k_format="auto", v_format="auto", dtype=torch.float64, device="cpu")


@pytest.mark.parametrize("k_format", list(KV_FORMATS))
@pytest.mark.parametrize("v_format", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bytes_per_block_matches_allocation(k_format, v_format, dtype):
    layers, blocks, block_size = 3, 7, 16
    cache = PagedKVCache(layers, blocks, block_size, HKV, D, k_format=k_format, v_format=v_format,
                         dtype=dtype, device="cpu")
    tensors = [t for kind in ("k", "v") for t in cache.data[kind] + (cache.scales[kind] or [])]
    allocated = sum(t.untyped_storage().nbytes() for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    per_block = PagedKVCache.bytes_per_block(layers, block_size, HKV, D, k_format, v_format, dtype)
    assert allocated == blocks * per_block == cache.nbytes


@pytest.mark.skipif(not native.capable(), reason="CPU lacks the native kernels")
def test_native_kernel_covers_the_common_formats():
    """On a capable CPU, "auto" must really take the C++ path for float32/bf16/int8 pools."""
    for fmt in ("float32", "bfloat16", "int8"):
        batch = Batch(MIXED_BATCH, 16, fmt, fmt)
        torch.testing.assert_close(batch.paged(5, impl="native"), batch.paged(5, impl="auto"), atol=0, rtol=0)


@pytest.mark.skipif(not native.capable(), reason="CPU lacks the native kernels")
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_write_equals_torch_write(fmt, dtype):
    """The C++ store (and int8 quantization) is bit-identical to the torch path, from a
    strided view (K and V are slices of the fused QKV output)."""
    g = torch.Generator().manual_seed(4)
    T = 9
    qkv = (torch.randn(T, (H + 2 * HKV) * D, generator=g) * 3).to(dtype)
    qkv[2, H * D:(H + 1) * D] = 0  # an all-zero K row: scale 0
    k = qkv[:, H * D:(H + HKV) * D].view(T, HKV, D)
    v = qkv[:, (H + HKV) * D:].view(T, HKV, D)
    slots = torch.randperm(6 * 16, generator=g)[:T]
    caches = [PagedKVCache(2, 6, 16, HKV, D, k_format=fmt, v_format=fmt, dtype=dtype, device="cpu") for _ in range(2)]
    for c in caches:
        for kind in ("k", "v"):
            for t in c.data[kind] + (c.scales[kind] or []):
                t.zero_()
    caches[0].write(1, k, v, slots)
    caches[1].write_torch(1, k, v, slots)
    for kind in ("k", "v"):
        assert torch.equal(caches[0].data[kind][1], caches[1].data[kind][1]), kind
        if caches[0].scales[kind] is not None:
            assert torch.equal(caches[0].scales[kind][1], caches[1].scales[kind][1])
