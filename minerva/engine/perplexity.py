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

from minerva.engine.kv_cache import ContiguousKVCache, run_tokens
from minerva.errors import MinervaError
from minerva.models.layers import CausalLM


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, nats
    tokens: int  # tokens scored
    windows: int


@torch.inference_mode()
def window_nll(model: CausalLM, ids: list[int], num_scored: int, device: torch.device,
               dtype: torch.dtype, chunk: int = 512) -> float:
    """Sum of -log p(token) over the last `num_scored` tokens of `ids`, from one fresh pass."""
    cache = ContiguousKVCache(model.config, len(ids), device, dtype)
    hidden = run_tokens(model, cache, ids, 0, chunk)
    targets = torch.tensor(ids, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    # hidden at position p predicts token p + 1; score the last num_scored tokens
    for r in range(len(ids) - 1 - num_scored, len(ids) - 1, 256):
        r2 = min(r + 256, len(ids) - 1)
        logp = torch.log_softmax(model.logits(hidden[r:r2]), dim=-1)
        total -= logp.gather(1, targets[r + 1:r2 + 1, None]).sum().double()
    return float(total)


def perplexity(model: CausalLM, ids: list[int], *, context: int, stride: int | None = None,
               device: torch.device, dtype: torch.dtype,
               progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
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
        nll += window_nll(model, window, num_scored, device, dtype)
        scored += num_scored
        windows += 1
        prev_end = end
        if progress:
            progress(end, len(ids))
        if end == len(ids):
            break
    mean = nll / scored
    return PerplexityResult(math.exp(mean), mean, scored, windows)
