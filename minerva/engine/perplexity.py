"""Perplexity over a token sequence with a sliding window (the method of HF's perplexity guide).

Windows of `context` tokens advance by `stride`; each window scores only the
tokens the previous window did not, so with stride < context every scored token
sees at least context - stride tokens of history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from minerva.engine.runner import PagedBackend
from minerva.engine.sampler import check_logits
from minerva.errors import MinervaError
from minerva.kernels.attention import PagedKVCache
from minerva.models.causal_lm import CausalLM
from minerva.models.layers import AttentionContext


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, nats
    tokens: int  # tokens scored
    windows: int


@torch.inference_mode()
def window_nll(model: CausalLM, ids: list[int], num_scored: int, device: torch.device,
               dtype: torch.dtype, k_format: str = "auto", v_format: str = "auto",
               chunk: int = 512, block_size: int = 16) -> float:
    """Sum of -log p(token) over the last `num_scored` tokens of `ids`, from one fresh pass
    through a paged KV cache of the given precisions (the engine's attention path)."""
    c = model.config
    num_blocks = -(-len(ids) // block_size)
    cache = PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                         k_format=k_format, v_format=v_format, dtype=dtype, device=device)
    table = torch.arange(num_blocks, device=device)  # the sequence owns blocks 0.. in order
    tokens = torch.tensor(ids, device=device)
    hidden = []
    for s in range(0, len(ids), chunk):
        e = min(s + chunk, len(ids))
        pos = torch.arange(s, e, device=device)  # slot == position with this block table
        i64 = dict(dtype=torch.int64, device=device)
        backend = PagedBackend(cache, pos[None], torch.tensor([0, e - s], **i64), torch.tensor([e], **i64),
                               table[None, None], pos)
        hidden.append(model(tokens[s:e], AttentionContext(pos, backend)))
    h = torch.cat(hidden)
    total = torch.zeros((), dtype=torch.float64, device=device)
    # hidden at position p predicts token p + 1; score the last num_scored tokens
    for r in range(len(ids) - 1 - num_scored, len(ids) - 1, 256):
        r2 = min(r + 256, len(ids) - 1)
        logits = model.logits(h[r:r2])
        check_logits(logits, dtype)  # a NaN perplexity is no measurement
        logp = torch.log_softmax(logits, dim=-1)
        total -= logp.gather(1, tokens[r + 1:r2 + 1, None]).sum().double()
    return float(total)


def perplexity(model: CausalLM, ids: list[int], *, context: int, stride: int | None = None,
               device: torch.device, dtype: torch.dtype, k_format: str = "auto",
               v_format: str = "auto", progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    stride = stride or context
    if context < 2 or not 0 < stride <= context:
        raise MinervaError(f"perplexity needs context >= 2 and 0 < stride <= context "
                           f"(got context={context}, stride={stride})")
    if context > model.config.max_position:
        raise MinervaError(f"context {context} exceeds the model's {model.config.max_position} tokens")
    if len(ids) < 2:
        raise MinervaError("the text has fewer than 2 tokens; perplexity needs more")
    nll, scored, windows, prev_end = 0.0, 0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        window = ids[begin:end]
        num_scored = min(end - prev_end, len(window) - 1)
        nll += window_nll(model, window, num_scored, device, dtype, k_format, v_format)
        scored += num_scored
        windows += 1
        prev_end = end
        if progress:
            progress(end, len(ids))
        if end == len(ids):
            break
    mean = nll / scored
    return PerplexityResult(math.exp(mean), mean, scored, windows)
