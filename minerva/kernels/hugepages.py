"""Memory in 2 MiB pages for what the CPU kernels stream: packed weights and the KV pool.

Decode reads every weight once a token. With 4 KiB pages a 2048 x 2048 Q4_K matrix
(2.4 MB) spans 576 pages: a TLB miss and a page walk on each, and the hardware prefetchers
stop at every page boundary. Measured on an AMD EPYC (Zen 4), one row of x, 120 such
matrices in turn from memory: 29 GB/s with 4 KiB pages against 33 in 2 MiB pages on 2
threads, 19 against 27 on one. Large allocations do not get 2 MiB pages by themselves where
transparent huge pages are `madvise` only (the common default) or where the block is not
2 MiB-aligned, and small matrices (K and V) never fill one alone; so the loader moves every
packed matrix into one pool, 2 MiB-aligned and advised (`MADV_HUGEPAGE`), back to back.

Where the OS has no transparent huge pages the pool is plain anonymous memory: the same
bytes, the same results.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each tensor starts on a page of its own: 64-byte alignment for the kernels, and more


def pool(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` (uninitialized: zero pages until written) at a 2 MiB
    boundary, advised for transparent huge pages on Linux. Its memory lives as long as any
    view of it. Below one huge page it is plain `torch.empty`: the page would be mostly waste."""
    if nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    size = nbytes + HUGE_PAGE
    if sys.platform.startswith("linux"):
        mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advise = getattr(mmap, "MADV_HUGEPAGE", None)
        if advise is not None:
            try:
                mem.madvise(advise)
            except OSError:  # a kernel built without transparent huge pages
                pass
        whole = torch.frombuffer(mem, dtype=torch.uint8)  # holds `mem` alive
    else:
        whole = torch.empty(size, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def padded(t: torch.Tensor) -> int:
    """Bytes `t` takes in a `Pool`."""
    n = t.numel() * t.element_size()
    return n + -n % _ALIGN


class Pool:
    """`pool(nbytes)` filled front to back: `take(t)` returns a copy of `t` in the next free
    bytes. Taking tensors one at a time, each original dropped as its copy is made, keeps
    memory at the pool plus one tensor, not twice the whole."""

    def __init__(self, nbytes: int):
        self.memory, self.used = pool(nbytes), 0

    def take(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        if self.used + padded(t) > self.memory.numel():
            raise ValueError(f"the pool has {self.memory.numel() - self.used} bytes left, {n} asked")
        dst = self.memory[self.used:self.used + n].view(t.dtype).view(t.shape)
        # Touched first by zero_, then copied: copying straight into untouched pages ran at
        # 1.4 GB/s here, zero_ then copy_ at 3-10 GB/s (4 GB in 1-256 MB pieces, 2 threads)
        dst.zero_()
        dst.copy_(t)
        self.used += padded(t)
        return dst


TRIM_EVERY = 16 << 20  # bytes moved into a pool between calls of give_back_freed


def _libc_trim():
    """glibc's malloc_trim, or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def give_back_freed(trim=_libc_trim()) -> None:
    """Return memory freed inside malloc's heap to the OS. Once a large block has been freed,
    glibc serves later large blocks from its heap instead of mapping each one, and memory
    freed there stays resident: without this, the weights' originals freed while they move
    into a pool stayed in the resident set (GPT-OSS-20B-shaped file: peak RSS 19.0 GB against
    11.9 before the pool)."""
    if trim is not None:
        trim(0)
