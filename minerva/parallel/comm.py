"""What tensor-parallel ranks send each other: the all-reduces of a forward, the step's
batch from rank 0, and the logits gathered on rank 0.

`TorchComm` is torch.distributed (gloo between CPU processes, on one host or several).
`ShmComm` does the same between the ranks of one host through a shared memory segment
(`Exchange` in minerva/kernels/csrc/exchange.h): gloo over TCP costs about a millisecond
per all-reduce on a small VM, which at two all-reduces per layer would cost more than
the layers. The process group still sets everything up, and ranks on different hosts use
gloo. Both count the calls and seconds spent in all-reduces (`stats`).
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minerva.errors import MinervaError
from minerva.kernels import native

SLOT_BYTES = 4 << 20  # per rank and buffer: larger tensors go through in chunks
SHM_DIR = Path("/dev/shm")


class ParallelError(MinervaError):
    """A tensor-parallel peer failed or left: the engine cannot go on."""


class Comm:
    rank: int
    world: int

    def __init__(self):
        self.calls = 0
        self.seconds = 0.0
        self.broken = False  # a collective failed: the group cannot be used, nor torn down cleanly

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        self._guard("an all-reduce", self._all_reduce, t)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return t

    def broadcast(self, t: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's int64 vector `t` on every rank (the others pass None)."""
        return self._guard("a broadcast", self._broadcast, t)

    def gather(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `t` (one shape on all) stacked [world, ...] on rank 0; None elsewhere."""
        return self._guard("a gather", self._gather, t)

    def _guard(self, what: str, fn, t):
        try:
            return fn(t)
        except RuntimeError as exc:
            self.broken = True
            raise ParallelError(f"tensor parallelism failed in {what}: {exc}") from None

    def stats(self) -> dict:
        return {"all_reduce_calls": self.calls, "all_reduce_seconds": self.seconds}

    def _all_reduce(self, t):
        raise NotImplementedError

    def _broadcast(self, t):
        raise NotImplementedError

    def _gather(self, t):
        raise NotImplementedError


class TorchComm(Comm):
    name = "gloo"

    def __init__(self):
        super().__init__()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def _all_reduce(self, t):
        dist.all_reduce(t)

    def _broadcast(self, t):
        n = torch.tensor([t.numel() if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(n, 0)
        out = t if self.rank == 0 else torch.empty(int(n), dtype=torch.int64)
        dist.broadcast(out, 0)
        return out

    def _gather(self, t):
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(t, parts, dst=0)
        return torch.stack(parts) if self.rank == 0 else None


class ShmComm(Comm):
    name = "shared memory"

    def __init__(self, exchange, rank: int, world: int):
        super().__init__()
        self.exchange, self.rank, self.world = exchange, rank, world

    def _all_reduce(self, t):
        self.exchange.all_reduce_(t)

    def _broadcast(self, t):
        return self.exchange.broadcast(t.contiguous() if t is not None else torch.empty(0, dtype=torch.int64))

    def _gather(self, t):
        out = self.exchange.gather(t.contiguous())
        return out if self.rank == 0 else None


def _shared_segment(native, rank: int, world: int) -> ShmComm | None:
    """A ShmComm when every rank can map one segment (they share a host), else None.
    Collective: every rank calls it."""
    size = native.Exchange.bytes_needed(world, SLOT_BYTES)
    path, token = None, secrets.token_hex(8)
    if rank == 0 and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK):
        path = SHM_DIR / f"minerva-tp-{os.getpid()}-{token}"
        with open(path, "wb") as f:
            f.truncate(size)
            f.write(token.encode())
    info = [str(path) if path else None, token]
    dist.broadcast_object_list(info, 0)
    segment, ok = None, info[0] is not None
    if ok:
        try:
            if rank != 0:
                with open(info[0], "rb") as f:
                    ok = f.read(16) == info[1].encode()
            if ok:
                segment = torch.from_file(info[0], shared=True, size=size, dtype=torch.uint8)
        except OSError:
            ok = False
    flags = torch.tensor([int(ok)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # shared memory only if every rank has it
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 0 and path is not None:
        path.unlink(missing_ok=True)  # every rank has mapped it (or given up): the mappings stay
    if not flags.item():
        return None
    segment[:64 * world].zero_()  # the token overwrote rank 0's flag line
    dist.barrier()
    return ShmComm(native.Exchange(segment, rank, world, SLOT_BYTES, pids), rank, world)


def exchange_choice() -> str:
    """MINERVA_TP_EXCHANGE: auto (shared memory where the ranks share a host), gloo or shm."""
    choice = os.environ.get("MINERVA_TP_EXCHANGE", "auto")
    if choice not in ("auto", "gloo", "shm"):
        raise MinervaError(f"MINERVA_TP_EXCHANGE must be auto, gloo or shm, got {choice!r}")
    return choice


def connect(device: torch.device) -> Comm:
    """The Comm for this process's group: shared memory on one host unless
    MINERVA_TP_EXCHANGE=gloo, gloo otherwise. Collective."""
    if device.type != "cpu":
        raise MinervaError("tensor parallelism runs on CPUs so far; use --device cpu")
    module = native.load()
    rank, world = dist.get_rank(), dist.get_world_size()
    choice = exchange_choice()
    can = torch.tensor([int(choice != "gloo" and module is not None)])
    dist.all_reduce(can, op=dist.ReduceOp.MIN)  # one decision on every rank
    if can.item():
        comm = _shared_segment(module, rank, world)
        if comm is not None:
            return comm
    if choice == "shm":
        raise MinervaError("MINERVA_TP_EXCHANGE=shm, but the ranks cannot share a memory segment "
                           "(they run on different hosts, or /dev/shm is missing or read-only)")
    return TorchComm()
