"""Builds one flat batch from the scheduled requests, runs the model, samples.

All scheduled tokens of all requests go through one forward: token ids, their
positions, the KV slot each new token writes, each request's block table and
key count, and which rows need logits. Prefill chunks, decode steps and
speculative verification (1 + k tokens) all take this same path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minerva.engine.sampler import TokenLogprob, sample_batch, token_logprobs
from minerva.engine.scheduler import Scheduled
from minerva.kernels.attention import EMPTY, PagedKVCache, native_kernel, paged_attention
from minerva.models.layers import AttentionContext, CausalLM


@dataclass
class PagedBackend:
    """Attention metadata of one step, handed to every layer through AttentionContext."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T] slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int64
    seq_lens: torch.Tensor  # [B] int64, keys per request after this step
    block_tables: torch.Tensor  # [B, max blocks] int64, zero-padded
    positions: torch.Tensor  # [T]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, scale: float) -> torch.Tensor:
        self.cache.write(layer, k, v, self.slot_mapping)
        return paged_attention(q, self.cache, layer, query_start_loc=self.query_start_loc,
                               seq_lens=self.seq_lens, block_tables=self.block_tables,
                               positions=self.positions, window=window, scale=scale)

    def native_args(self, layer: int, dtype: torch.dtype) -> tuple | None:
        """What a native decoder layer needs to store and attend over this step's K/V, or
        None when the C++ kernels do not cover this pool or dtype."""
        if native_kernel(dtype, self.cache) is None:
            return None
        c = self.cache
        ks, vs = c.scales["k"], c.scales["v"]
        return (c.data["k"][layer], c.data["v"][layer], EMPTY if ks is None else ks[layer],
                EMPTY if vs is None else vs[layer], self.slot_mapping, self.block_tables, self.seq_lens,
                self.query_start_loc, self.positions)

        return paged_attention(q, self.cache, layer, query_start_loc=self.query_start_loc,
                               seq_lens=self.seq_lens, block_tables=self.block_tables,
                               positions=self.positions, window=window, scale=scale)


class ModelRunner:
    def __init__(self, model: CausalLM, cache: PagedKVCache, device: torch.device):
        self.model, self.cache, self.device = model, cache, device
        self.block_size = cache.block_size

    @torch.inference_mode()
    def execute(self, batch: list[Scheduled], block_tables: list[list[int]]
                ) -> list[tuple[int, TokenLogprob | None] | None]:
        """Run the batch; for each request that samples, its token (and logprobs if asked)."""
        ids, pos, slots, starts, seq_lens, logit_rows = [], [], [], [0], [], []
        bs = self.block_size
        for s, table in zip(batch, block_tables):
            r = s.request
            lo, hi = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            ids += r.all_token_ids[lo:hi]
            pos += range(lo, hi)
            slots += [table[p // bs] * bs + p % bs for p in range(lo, hi)]
            starts.append(starts[-1] + s.num_new_tokens)
            seq_lens.append(hi)
            if s.samples:
                logit_rows.append(starts[-1] - 1)
        positions = torch.tensor(pos, dtype=torch.int64, device=self.device)
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64,
                              device=self.device)
        i64 = dict(dtype=torch.int64, device=self.device)
        backend = PagedBackend(self.cache, torch.tensor(slots, **i64), torch.tensor(starts, **i64),
                               torch.tensor(seq_lens, **i64), tables, positions)
        hidden = self.model(torch.tensor(ids, device=self.device), AttentionContext(positions, backend))
        out: list[tuple[int, TokenLogprob | None] | None] = [None] * len(batch)
        if logit_rows:
            logits = self.model.logits(hidden[torch.tensor(logit_rows, device=self.device)])
            samplers = [i for i, s in enumerate(batch) if s.samples]
            requests = [batch[i].request for i in samplers]
            tokens = sample_batch(logits, [r.sampler for r in requests])
            for i, token in zip(samplers, tokens):
                out[i] = (token, None)
            asked = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
            if asked:
                rows = torch.tensor(asked, device=self.device)
                lps = token_logprobs(logits[rows], [tokens[a] for a in asked],
                                     [requests[a].params.logprobs for a in asked])
                for a, lp in zip(asked, lps):
                    out[samplers[a]] = (tokens[a], lp)
        return out
