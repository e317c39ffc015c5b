"""`python -m minerva.parallel.worker SPEC`: a tensor-parallel worker that rank 0 started.

SPEC is the JSON of rank 0's `LLM` options; RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
come in the environment. It builds the same `LLM`, which loads this rank's shard and
follows rank 0's steps until rank 0 stops it. It leaves by itself when rank 0's process is
gone (killed, or exited without stopping it), whatever it is doing then.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from minerva.errors import MinervaError
from minerva.llm import LLM
from minerva.parallel.launch import PARENT

_said = threading.Lock()  # one error line, from whichever of the main thread and the watch fails first


def say(rank: str, message: str) -> None:
    if _said.acquire(timeout=5.0):
        print(f"minerva: error: tensor-parallel rank {rank}: {message}", file=sys.stderr, flush=True)


def watch(parent: int, rank: str, every: float = 0.2) -> None:
    """Exit this process when `parent` (rank 0) is no longer its parent: it died, and no one will
    stop this worker. (Polling, not PR_SET_PDEATHSIG, which fires when the *thread* that started
    the worker ends.)"""
    def poll():
        while os.getppid() == parent:
            time.sleep(every)
        say(rank, f"rank 0 (pid {parent}) is gone; this worker stops too")
        os._exit(1)

    threading.Thread(target=poll, name="minerva-watch-rank-0", daemon=True).start()


def main() -> int:
    rank = os.environ.get("RANK", "?")
    parent = os.environ.get(PARENT)
    if parent:
        watch(int(parent), rank)
    try:
        LLM(**json.loads(sys.argv[1]))
    except MinervaError as exc:  # a ParallelError too: rank 0 left or failed in a collective
        say(rank, str(exc))
        return 1
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; rank 0 reports it
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
