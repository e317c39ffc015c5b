"""A contiguous KV cache for one sequence (perplexity, tests); the engine uses the paged pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minerva.models.config import ModelConfig
from minerva.models.layers import AttentionContext, CausalLM


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [T, L]: query i sees key j when j <= i (and i - j < window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


class ContiguousKVCache:
    """K/V of one sequence for every layer: [layers, capacity, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, capacity: int, device: torch.device, dtype: torch.dtype):
        shape = (config.num_layers, capacity, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.key_positions = torch.arange(capacity, device=device)
        self.capacity = capacity
        self.length = 0  # tokens whose K/V are stored (after the current forward)
        self.positions: torch.Tensor | None = None

    def begin(self, positions: torch.Tensor) -> None:
        """Announce the positions of the next forward's new tokens (contiguous, ascending)."""
        end = int(positions[-1]) + 1
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens, forward needs {end}")
        self.length, self.positions = end, positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, scale: float) -> torch.Tensor:
        self.k[layer, self.positions] = k.to(self.k.dtype)
        self.v[layer, self.positions] = v.to(self.v.dtype)
        n = self.length
        keys, values = self.k[layer, :n].to(q.dtype), self.v[layer, :n].to(q.dtype)
        mask = causal_mask(self.positions, self.key_positions[:n], window)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1),
                                             values.transpose(0, 1), attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(0, 1)


@torch.inference_mode()
def run_tokens(model: CausalLM, cache: ContiguousKVCache, ids: list[int], start: int = 0,
               chunk: int = 512) -> torch.Tensor:
    """Run tokens at positions start.. through the model in chunks; hidden states [T, hidden]."""
    device = cache.k.device
    out = []
    for i in range(0, len(ids), chunk):
        piece = ids[i:i + chunk]
        pos = torch.arange(start + i, start + i + len(piece), device=device)
        cache.begin(pos)
        out.append(model(torch.tensor(piece, device=device), AttentionContext(pos, cache)))
    return torch.cat(out) if len(out) > 1 else out[0]
