"""The resident memory of a run whose requests come and go: 600 requests of 200 random
prompt tokens + 16 generated, in batches of 50, on the default KV pool; the resident set
every 200 requests and the pool's blocks ever used.

    python benchmarks/kv_resident.py [MODEL]              # the block policy as it is
    python benchmarks/kv_resident.py [MODEL] --share 1    # every never-used block first

`--share` is the block manager's `cache_share`: the part of the pool cached blocks may hold
before a never-used block is taken (1: never-used blocks always first).
"""

from __future__ import annotations

import argparse
import functools
import random

from minerva import LLM, SamplingParams
from minerva.engine import block_manager


def rss_mb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--share", type=float, default=None, help="cache_share (default: the block manager's)")
    args = ap.parse_args()
    if args.share is not None:
        block_manager.BlockManager.__init__ = functools.partialmethod(block_manager.BlockManager.__init__,
                                                                      cache_share=args.share)
    llm = LLM(args.model)
    rng = random.Random(0)
    seen = []
    for i in range(12):
        prompts = [[rng.randrange(100, 30000) for _ in range(200)] for _ in range(50)]
        llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        if i % 4 == 3:
            seen.append(f"{50 * (i + 1)} requests: {rss_mb()} MB")
    blocks = llm.engine.blocks
    print("; ".join(seen) + f"; {blocks.num_touched_blocks} of {blocks.num_blocks} blocks used")


if __name__ == "__main__":
    main()
