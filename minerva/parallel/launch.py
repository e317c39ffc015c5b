"""Starting the tensor-parallel ranks, or joining them.

Two ways, one code path after the process group exists:

- `--tensor-parallel-size N` on one host: the process the user started is rank 0; it
  opens a TCPStore on a free local port and starts N - 1 workers
  (`python -m minerva.parallel.worker SPEC`) that build the same `LLM` with the same
  options and join through that store.
- `torchrun` (one host or several): every rank runs the same `minerva ...` command with
  RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; rank 0 serves, the others follow.

Every rank then loads only its own shard of the weights (`shard.plan`) and its own KV pool;
rank 0 runs the engine and broadcasts each step, the others run the same forward on their
shard (`ModelRunner.follow`) until rank 0 stops them.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from minerva.errors import MinervaError
from minerva.machine import machine
from minerva.parallel.comm import Comm, connect

log = logging.getLogger("minerva")

SPAWNED = "MINERVA_TP_SPAWNED"  # set for the workers rank 0 starts itself
PARENT = "MINERVA_TP_PARENT"  # the pid of the rank 0 that started a worker: it leaves when that one is gone


def timeout() -> float:
    """Seconds every rank has to arrive (MINERVA_TP_TIMEOUT, default 120)."""
    text = os.environ.get("MINERVA_TP_TIMEOUT", "120")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise MinervaError(f"MINERVA_TP_TIMEOUT must be a number of seconds > 0, got {text!r}")
    return value


def check_size(size) -> None:
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise MinervaError(f"--tensor-parallel-size must be an integer >= 1, got {size!r}")


@dataclass
class Group:
    rank: int
    world: int
    comm: Comm | None = None  # set once the device is known (connect)
    workers: list[subprocess.Popen] = field(default_factory=list)  # rank 0's own workers
    closed: bool = False
    weight_bytes: list[int] = field(default_factory=list)  # each rank's, for compute

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def check_workers(self) -> str | None:
        """Why the group is broken, when a worker rank 0 started has exited; else None."""
        for r, p in enumerate(self.workers, start=1):
            code = p.poll()
            if code is not None:
                return f"tensor-parallel rank {r} (pid {p.pid}) exited with status {code}"
        return None

    def close(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` s for rank 0's workers to exit (killing those that do not), then
        leave the process group, so that this process can start or join another."""
        if self.closed:
            return
        self.closed = True
        _reap(self.workers, timeout)
        # gloo can abort a process tearing down a group whose peer is gone (torchrun's, across hosts);
        # a group of workers this process started, all reaped now, tears down cleanly
        if dist.is_initialized() and (self.workers or not (self.comm is not None and self.comm.broken)):
            dist.destroy_process_group()


def _reap(workers: list[subprocess.Popen], timeout: float = 0.0) -> None:
    """Wait up to `timeout` s for `workers` to exit; kill those that do not."""
    deadline = time.monotonic() + timeout
    for p in workers:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def check_free() -> None:
    """A MinervaError when this process is still in a process group: a second tensor-parallel LLM
    needs the first one closed. Garbage-collects first, so an LLM already dropped closes now."""
    if dist.is_initialized():
        gc.collect()  # an unreachable LLM in a reference cycle: its finalizer closes its group
    if dist.is_initialized():
        raise MinervaError("another tensor-parallel LLM is still open in this process; close it first "
                           "(llm.close(), or create it with `with LLM(...) as llm:`)")


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world) when this process was started as one of several ranks (by torchrun, or
    by a rank 0 that spawned it), else None."""
    world = os.environ.get("WORLD_SIZE")
    rank = os.environ.get("RANK")
    if world is None or rank is None:
        return None
    try:
        world_n, rank_n = int(world), int(rank)
    except ValueError:
        raise MinervaError(f"RANK={rank!r} and WORLD_SIZE={world!r} must be integers") from None
    if world_n <= 1:
        return None
    if not 0 <= rank_n < world_n:
        raise MinervaError(f"RANK={rank_n} is outside WORLD_SIZE={world_n}")
    return rank_n, world_n


def threads_per_rank(threads: int | None, world: int) -> int:
    """A rank's CPU threads when the user gave none: the host's physical cores shared out."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun: the ranks on this host
    return threads if threads is not None else max(1, machine().physical_cores // local)


def join(size: int | None, spec: dict) -> Group | None:
    """Start or join the tensor-parallel group `spec` (the LLM's options) runs in; None for
    one process. Errors (a port in use, ranks that never arrive, a worker that dies while
    starting) are MinervaErrors within `timeout()` seconds."""
    check_size(size)
    launched = torchrun_rank()
    if launched is not None:
        rank, world = launched
        if size not in (None, 1, world):
            raise MinervaError(f"--tensor-parallel-size {size} differs from WORLD_SIZE={world} of the launcher")
        check_free()
        _init_from_env(rank, world)
        return Group(rank, world)
    if not size or size == 1:
        return None
    check_free()
    return _spawn(size, spec)


def _waited(start: float, limit: float) -> str:
    """How long a failed wait took, against its limit: a failure is not always a time-out."""
    return f"after {time.monotonic() - start:.1f} s (limit {limit:.0f} s)"


def _init_from_env(rank: int, world: int) -> None:
    limit, start = timeout(), time.monotonic()
    spawned = bool(os.environ.get(SPAWNED))
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
    try:
        if spawned:
            store = dist.TCPStore(addr, int(port), world, is_master=False, timeout=timedelta(seconds=limit))
            store.set(f"minerva/arrived/{rank}", "1")
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=limit))
        else:
            os.environ.setdefault("MASTER_ADDR", addr)  # env:// also reuses torchrun's own store
            os.environ.setdefault("MASTER_PORT", port)
            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=limit))
    except (RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = ("rank 0, which started this worker, stopped or failed first" if spawned else
                "check that every rank was started with the same MASTER_ADDR and MASTER_PORT "
                "and that rank 0 can listen there")
        raise MinervaError(f"rank {rank} of {world} could not join the tensor-parallel group at {addr}:{port} "
                           f"{_waited(start, limit)}: {first}; {hint}") from None


def _spawn(world: int, spec: dict) -> Group:
    limit = timeout()
    try:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=limit),
                              wait_for_workers=False)
    except RuntimeError as exc:
        raise MinervaError(f"cannot open a local port for the tensor-parallel ranks: {exc}") from None
    group = Group(0, world)
    # (the C++ warnings with stack traces a worker's store prints when rank 0 goes away: its error says it)
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world), SPAWNED: "1", PARENT: str(os.getpid())}
    for r in range(1, world):
        group.workers.append(subprocess.Popen([sys.executable, "-m", "minerva.parallel.worker", json.dumps(spec)],
                                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                              stdin=subprocess.DEVNULL))
    # the workers go with the group (the LLM's finalizer closes it first) or at exit; the list, not the group
    weakref.finalize(group, _reap, group.workers, 2.0)
    start = time.monotonic()
    keys = [f"minerva/arrived/{r}" for r in range(1, world)]
    while not store.check(keys):
        broken = group.check_workers()
        if broken is not None or time.monotonic() > start + limit:
            group.close(0.0)
            raise MinervaError(f"the tensor-parallel workers did not start: "
                               f"{broken or 'not all arrived'} {_waited(start, limit)}")
        time.sleep(0.05)
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=world, timeout=timedelta(seconds=limit))
    except (RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        why = group.check_workers() or first
        group.close(0.0)
        raise MinervaError(f"the tensor-parallel group did not form {_waited(start, limit)}: {why}") from None
    return group


def connect_group(group: Group, device, weight_bytes: int) -> None:
    """Set up the group's Comm and learn every rank's weight bytes (`weight_bytes`). Collective."""
    group.comm = connect(device)
    group.weight_bytes = [0] * group.world
    dist.all_gather_object(group.weight_bytes, weight_bytes)
    log.info("tensor parallel: rank %d of %d, exchange over %s", group.rank, group.world, group.comm.name)
