"""A model's logits over a token sequence, computed the way the engine computes them.

The reference tests (transformers, the gguf package) compare these logits: each chunk of
the sequence is one `ModelRunner.forward`, so K/V go into a `PagedKVCache` and attention
reads them back through a block table (`PagedBackend`, `paged_attention`, and the C++
decoder layers where they run). The table scatters the sequence over the pool in
descending order, with unused blocks in between, so a wrong slot or table lookup
cannot pass for the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minerva.engine.runner import ModelRunner, Seq
from minerva.kernels.attention import PagedKVCache
from minerva.models.causal_lm import CausalLM


def paged_logits(model: CausalLM, ids: list[int], *, chunk: int | Sequence[int] = 512, block_size: int = 16,
                 k_format: str = "auto", v_format: str = "auto", dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Float32 logits [len(ids), vocab]: row p is the model's prediction after ids[:p + 1].
    `chunk`: the tokens of each forward, or a list of them (its last repeated)."""
    device = torch.device(device)
    c = model.config
    blocks = -(-len(ids) // block_size)
    cache = PagedKVCache(c.num_layers, 2 * blocks, block_size, c.num_kv_heads, c.head_dim,
                         k_format=k_format, v_format=v_format, dtype=dtype, device=device)
    table = list(range(2 * blocks - 1, 0, -2))  # blocks 2n-1, 2n-3, ..., 1; the even ones unused
    runner = ModelRunner(model, cache, device)
    sizes = [chunk] if isinstance(chunk, int) else list(chunk)  # the last size repeats
    out, s = [], 0
    while s < len(ids):
        n = sizes[min(len(out), len(sizes) - 1)]
        out.append(runner.forward([Seq(ids[s:s + n], s, [table], logit_rows=len(ids[s:s + n]))]))
        s += n
    return torch.cat(out)
