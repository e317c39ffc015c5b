"""`python -m minerva.parallel.worker SPEC`: a tensor-parallel worker that rank 0 started.

SPEC is the JSON of rank 0's `LLM` options; RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
come in the environment. It builds the same `LLM`, which loads this rank's shard and
follows rank 0's steps until rank 0 stops it.
"""

from __future__ import annotations

import json
import os
import sys

from minerva.errors import MinervaError
from minerva.llm import LLM


def main() -> int:
    rank = os.environ.get("RANK", "?")
    try:
        LLM(**json.loads(sys.argv[1]))
    except MinervaError as exc:
        print(f"minerva: error: tensor-parallel rank {rank}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; rank 0 reports it
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
