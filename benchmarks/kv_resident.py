"""The resident memory of a run whose requests come and go: 600 requests of 200 random
prompt tokens + 16 generated, in batches of 50, on the default KV pool; the resident set
every 200 requests and the pool's blocks ever used.

    python benchmarks/kv_resident.py [MODEL]                                # the defaults
    python benchmarks/kv_resident.py [MODEL] --prefix-cache-memory 100e6    # less cache kept

`--prefix-cache-memory`: the cached blocks of finished requests kept before never-used
blocks are taken (bytes, or a fraction of the memory available; at most a quarter of the pool).
"""

from __future__ import annotations

import argparse
import random

from minerva import LLM, SamplingParams
from minerva.engine.engine import EngineConfig


def rss_mb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--prefix-cache-memory", type=float, default=EngineConfig.prefix_cache_memory)
    args = ap.parse_args()
    llm = LLM(args.model, prefix_cache_memory=args.prefix_cache_memory)
    rng = random.Random(0)
    seen = []
    for i in range(12):
        prompts = [[rng.randrange(100, 30000) for _ in range(200)] for _ in range(50)]
        llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        if i % 4 == 3:
            seen.append(f"{50 * (i + 1)} requests: {rss_mb()} MB")
    blocks = llm.engine.blocks
    pool = llm.engine.cache.nbytes
    print(f"KV pool {pool / 1e9:.1f} GB, cache kept up to {blocks.cache_bytes(pool) / 1e9:.2f} GB; "
          + "; ".join(seen) + f"; {blocks.num_touched_blocks} of {blocks.num_blocks} blocks used")


if __name__ == "__main__":
    main()
