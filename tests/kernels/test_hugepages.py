"""The 2 MiB-page pool that packed weights and the KV pool live in (minerva/kernels/hugepages.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from minerva.kernels import hugepages
from minerva.kernels.weights import PackedWeight

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_pool_copies_side_by_side_from_a_huge_page_boundary():
    tensors = [torch.randn(3, 1000), torch.randint(0, 255, (5000,), dtype=torch.uint8),
               torch.randn(700, 2048).to(torch.bfloat16), torch.arange(7, dtype=torch.int64)]
    pool = hugepages.Pool(sum(hugepages.padded(t) for t in tensors))
    copies = [pool.take(t) for t in tensors]
    assert copies[0].data_ptr() % hugepages.HUGE_PAGE == 0
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        assert c.data_ptr() % 4096 == 0
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in copies]
    assert all(end <= nxt.data_ptr() for end, nxt in zip(ends, copies[1:]))  # no overlap
    with pytest.raises(ValueError, match="bytes left"):
        pool.take(torch.zeros(1))


def test_pool_memory_outlives_the_pool_object():
    pool = hugepages.Pool(3 << 20)
    t = pool.take(torch.full((3 << 20,), 7, dtype=torch.uint8))
    del pool
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # reuse freed memory, if any was freed
    assert int(t.sum()) == 7 * (3 << 20)


def test_small_pools_are_plain_memory():
    t = hugepages.pool(1000)
    assert t.numel() == 1000 and t.dtype == torch.uint8


def _huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            current = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif current and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are off on this machine")
def test_loaded_weights_sit_in_huge_pages(smollm2_llm):
    weights = [m.weight for m in smollm2_llm.loaded.model.modules()
               if isinstance(getattr(m, "weight", None), PackedWeight) and m.weight.kernel is not None]
    assert weights
    starts = sorted(w.packed.data_ptr() for w in weights)
    assert starts[0] % hugepages.HUGE_PAGE == 0  # one pool, from a 2 MiB boundary
    assert _huge_kib_at(starts[0]) >= 2048, "the kernel gave the weights' pool no 2 MiB pages"
