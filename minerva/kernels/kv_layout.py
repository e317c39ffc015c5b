"""Which pool tensor and which block table each layer's K/V use.

A sliding-window layer only ever reads the last `window` keys, so the blocks behind its
window can go back to the pool while its sequence goes on; a global layer keeps them all.
Layers are put in groups of equal size, each group of one kind (global, or one window),
and each group gets its own block table per request. All groups draw their blocks from
one shared pool: a block id addresses one block in each of `num_pools` pool tensors, and
layer j of every group uses pool tensor j, so a block holds the K/V of one group's layers
for `block_size` tokens whichever group it was handed to. Short sequences take as much
memory as with one table for all layers; long ones keep only the windows of their
sliding-window layers. (vLLM's hybrid KV-cache allocator shares its pool the same way.)

Gemma 3 270M (15 sliding-window layers of 512 tokens, 3 global, equal K/V shapes) gets
groups of 3 layers: one global group and five windowed ones. At 32K tokens of context a
sequence then holds its 3 global layers' K/V for every token and the others' for about
their window: about five times less than all 18 layers for every token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    group_windows: tuple[int | None, ...]  # per group: its layers' window, None for global layers
    layer_group: tuple[int, ...]  # per layer: its group (its block table)
    layer_pool: tuple[int, ...]  # per layer: its pool tensor (its place in its group)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_pools(self) -> int:
        return max(self.layer_pool) + 1

    def blocks_for(self, num_tokens: int, block_size: int, step_tokens: int | None = None) -> int:
        """The most blocks one sequence of num_tokens tokens holds at once, computed in steps
        of at most step_tokens new tokens (None: any): a windowed group's table spans the
        window of a step's first query up to the step's last token."""
        full = -(-num_tokens // block_size)
        total = 0
        for window in self.group_windows:
            if window is None:
                total += full
            else:
                span = window - 1 + (num_tokens if step_tokens is None else step_tokens)
                total += min(full, -(-span // block_size) + 1)
        return total

    def max_tokens(self, num_blocks: int, block_size: int, step_tokens: int | None, limit: int) -> int:
        """The longest sequence (at most limit tokens) whose blocks fit in num_blocks."""
        lo, hi = 0, limit
        while lo < hi:  # blocks_for grows with num_tokens
            mid = (lo + hi + 1) // 2
            if self.blocks_for(mid, block_size, step_tokens) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


def single(num_layers: int) -> KVLayout:
    """One block table for every layer, one pool tensor each: nothing is freed before the end."""
    return KVLayout((None,), (0,) * num_layers, tuple(range(num_layers)))


def kv_layout(layer_windows: Sequence[int | None], max_len: int) -> KVLayout:
    """The layout for layers with these windows (None: global attention). A window of at
    least max_len tokens frees nothing and counts as global. Groups have gcd-many layers of
    each kind's count, so every group fills the same pool tensors."""
    windows = [w if w and w < max_len else None for w in layer_windows]
    kinds = list(dict.fromkeys(windows))  # in order of first appearance
    if len(kinds) == 1:
        return KVLayout((kinds[0],), (0,) * len(windows), tuple(range(len(windows))))
    size = math.gcd(*(windows.count(k) for k in kinds))
    group_windows: list[int | None] = []
    layer_group, layer_pool = [0] * len(windows), [0] * len(windows)
    for kind in kinds:
        for n, layer in enumerate(i for i, w in enumerate(windows) if w == kind):
            if n % size == 0:
                group_windows.append(kind)
            layer_group[layer], layer_pool[layer] = len(group_windows) - 1, n % size
    return KVLayout(tuple(group_windows), tuple(layer_group), tuple(layer_pool))
