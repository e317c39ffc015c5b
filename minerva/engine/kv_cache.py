"""Per-sequence contiguous KV cache (the paged pool replaces it in the batched engine)."""

from __future__ import annotations

import torch

from minerva.models.config import ModelConfig


class ContiguousKVCache:
    """K/V of one sequence for every layer: [layers, capacity, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, capacity: int, device: torch.device, dtype: torch.dtype):
        shape = (config.num_layers, capacity, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.key_positions = torch.arange(capacity, device=device)
        self.capacity = capacity
        self.length = 0  # tokens whose K/V are stored (after the current forward)

    def begin(self, end: int) -> None:
        """Announce a forward whose last new token sits at position `end` - 1."""
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens, forward needs {end}")
        self.length = end

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        self.k[layer, positions] = k.to(self.k.dtype)
        self.v[layer, positions] = v.to(self.v.dtype)
        n = self.length
        return self.k[layer, :n], self.v[layer, :n], self.key_positions[:n]
