"""One forward's batch: what every token of every scheduled sequence needs, in one int64 buffer.

The buffer is a header (kind, T tokens, B sequences, table width, L logit rows) and then, in
order: token ids [T], positions [T], the KV slot of each new token per group of the cache's
layout [G, T], the sequences' query start offsets [B + 1] and key counts [B], their block
tables per group [G, B, width] (zero-padded), and the rows that need logits [L]. One buffer,
so that a tensor-parallel leader broadcasts a step as one message and its followers unpack
the same views; a burst of decode steps advances it in place, and the tensors over it (the
model's inputs of the step before) see the next step without being made again.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

STOP, FORWARD, DRAFT = 0, 1, 2  # the kinds of step a tensor-parallel leader broadcasts
HEADER = 5  # kind, T, B, table width, logit rows
ZERO = array("q", [0])


@dataclass
class Seq:
    """One sequence's part of a forward: tokens at positions start.., its block table per
    group of the cache's layout (`BlockManager.block_tables`), and how many of its last
    rows need logits."""

    token_ids: list[int]
    start: int
    tables: list[Sequence[int]]  # int64 arrays from the block manager, or lists
    logit_rows: int = 0
    adapter: int = 0  # its LoRA adapter (minerva/models/lora.py; 0: the base model)


@dataclass
class Views:
    """The tensors over one step's buffer (on the model's device)."""

    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [G, T]
    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    tables: torch.Tensor  # [G, B, width]
    logit_rows: torch.Tensor  # [L]
    copied: bool  # views of a copy (another device): changing the buffer does not reach them


class StepBatch:
    """A step's buffer (`pack`), the views of it (`unpack`) and a burst's next step (`advance`)."""

    def __init__(self, buf: array, groups: int, seqs: list[Seq]):
        self.buf, self.groups, self.seqs = buf, groups, seqs  # the sequences: their tables, for `advance`
        self.header = list(buf[:HEADER])
        self.tensor = torch.frombuffer(buf, dtype=torch.int64)  # shares the buffer's memory

    @classmethod
    def pack(cls, seqs: list[Seq], groups: int, block_size: int, kind: int = FORWARD) -> StepBatch:
        ids, pos, starts, seq_lens, logit_rows = [], [], [0], [], []
        slots: list[list[int]] = [[] for _ in range(groups)]
        bs = block_size
        for s in seqs:
            lo, hi = s.start, s.start + len(s.token_ids)
            ids += s.token_ids
            pos += range(lo, hi)
            for g, table in enumerate(s.tables):
                slots[g] += [table[p // bs] * bs + p % bs for p in range(lo, hi)]
            starts.append(starts[-1] + len(s.token_ids))
            seq_lens.append(hi)
            logit_rows += range(starts[-1] - s.logit_rows, starts[-1])
        width = max(len(t) for s in seqs for t in s.tables)
        # filled in C: the tables copied whole from the block manager's arrays (O(context) in
        # C, not Python)
        buf = array("q", [kind, len(ids), len(seqs), width, len(logit_rows)])
        for part in (ids, pos, *slots, starts, seq_lens):
            buf.extend(part)
        for g in range(groups):
            for s in seqs:
                buf.extend(s.tables[g])
                buf.extend(ZERO * (width - len(s.tables[g])))
        buf.extend(logit_rows)
        return cls(buf, groups, seqs)

    @staticmethod
    def stop() -> torch.Tensor:
        """The message that ends a follower's loop."""
        return torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64)

    @staticmethod
    def kind_of(step: torch.Tensor) -> int:
        return int(step[0])

    @staticmethod
    def unpack(step: torch.Tensor, groups: int, device: torch.device, header: list[int] | None = None) -> Views:
        """The views of a step's buffer (`header`: its header, when the caller has it as ints)."""
        _, T, B, width, L = step[:HEADER].tolist() if header is None else header
        copied = step.device != device
        body = step[HEADER:].to(device) if copied else step[HEADER:]
        ids, pos, slots, starts, seq_lens, tables, logit_rows = body.split(
            [T, T, groups * T, B + 1, B, groups * B * width, L])
        return Views(ids, pos, slots.view(groups, T), starts, seq_lens, tables.view(groups, B, width), logit_rows,
                     copied)

    def advance(self, tokens: list[int], block_size: int) -> None:
        """A burst's next step, in place: each sequence's sampled token fed in one position
        on, with its slot and key count (one token per sequence: T == B)."""
        buf, G, bs = self.buf, self.groups, block_size
        B = self.header[2]
        pos0, slot0, len0 = HEADER + B, HEADER + 2 * B, HEADER + 2 * B + G * B + B + 1
        for b, token in enumerate(tokens):
            p = buf[pos0 + b] + 1
            buf[HEADER + b], buf[pos0 + b], buf[len0 + b] = token, p, p + 1
            for g in range(G):
                buf[slot0 + g * B + b] = self.seqs[b].tables[g][p // bs] * bs + p % bs
