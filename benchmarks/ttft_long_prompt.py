"""Time to first token of short requests that arrive while a long prompt is prefilled.

Against a running `minerva serve` (or any OpenAI-compatible server): one completion with a
long prompt (max_tokens 1) starts; `--delay` seconds later, `--short` short streamed
requests follow one after another. Prints each short request's time to first token and
the long request's total time, as JSON.

    minerva serve gemma3-270m --port 8123 --max-num-batched-tokens 512 --kv-cache-memory 2e9
    python benchmarks/ttft_long_prompt.py http://localhost:8123 --words 2700
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base_url")
    p.add_argument("--words", type=int, default=2700, help="the long prompt: this many times 'the cat sat on the mat'")
    p.add_argument("--short", type=int, default=3, help="short requests, one after another")
    p.add_argument("--delay", type=float, default=3.0, help="seconds between the long request and the first short one")
    args = p.parse_args()
    base = args.base_url.rstrip("/")
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    long: dict[str, float] = {}

    def long_request() -> None:
        start = time.perf_counter()
        r = httpx.post(f"{base}/v1/completions", timeout=3600,
                       json={"model": model, "prompt": "the cat sat on the mat " * args.words, "max_tokens": 1})
        long["seconds"] = time.perf_counter() - start
        long["prompt_tokens"] = r.json()["usage"]["prompt_tokens"]

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(args.delay)
    ttft = []
    for i in range(args.short):
        start, first = time.perf_counter(), None
        with httpx.stream("POST", f"{base}/v1/completions", timeout=3600,
                          json={"model": model, "prompt": f"Question {i}: what is two plus two?", "max_tokens": 8,
                                "stream": True}) as r:
            for line in r.iter_lines():
                if first is None and line.startswith("data:"):
                    first = time.perf_counter() - start
        ttft.append(round(first, 3))
        time.sleep(1.0)
    thread.join()
    print(json.dumps({"short_ttft_s": ttft, "long_s": round(long["seconds"], 1),
                      "long_prompt_tokens": long["prompt_tokens"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
