"""Several models behind one server: time to first token when requests alternate between two
loaded models, against a server of one, and the first request to a model not loaded yet.

    python benchmarks/multi_model.py [--models smollm2-135m gemma3-270m] [--requests 20] [--rounds 3]

Each server is its own `minerva serve` process on a free port, the one-model server and the
two-model one in turn, round after round; requests are streamed one at a time, each read to
its end before the next (about 50 prompt tokens of prose, 8 tokens out), and the time to the
first token is read on the client. Prints medians, and the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
          "books were made, sold and read across Europe, and within a few decades presses were running in "
          "most of its larger cities. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(models: list[str], *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minerva", "serve", *models, "--port", str(port),
                             "--log-level", "warning", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"minerva serve {' '.join(models)} did not start")


def ttft(url: str, model: str, i: int) -> float:
    """The time to the first token of one streamed request, read to its end: the next request
    starts once this one has finished (a stream left early would still be decoding, on its own
    engine thread, while the next one's prompt runs)."""
    start = time.perf_counter()
    first = None
    body = {"model": model, "prompt": f"{i}. {PROMPT}", "max_tokens": 8, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if (first is None and line.startswith("data: ") and line != "data: [DONE]"
                    and json.loads(line[6:])["choices"]):
                first = time.perf_counter() - start
    if first is None:
        raise SystemExit(f"no token from {model}")
    return first


def one_server(a: str, n: int) -> float:
    proc, url = start([a])
    try:
        ttft(url, a, -1)  # warm
        return statistics.median(ttft(url, a, i) for i in range(n))
    finally:
        proc.terminate()
        proc.wait()


def two_servers(a: str, b: str, n: int) -> tuple[float, float, float, float]:
    """Median TTFT of a and of b alternating, the first request to a (not loaded) and its load."""
    proc, url = start([a, b], "--keep-alive", "-1")
    try:
        first = ttft(url, a, -1)
        load = next(float(line.split()[-1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                    if line.startswith(f'minerva:model_load_seconds{{model_name="{a}"}}'))
        ttft(url, b, -1)
        both = [ttft(url, (a, b)[i % 2], i) for i in range(2 * n)]
        return statistics.median(both[0::2]), statistics.median(both[1::2]), first, load
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs=2, default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--requests", type=int, default=20, help="requests per model per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (one server, then the other)")
    args = ap.parse_args()
    a, b = args.models
    rows = []
    for r in range(args.rounds):
        one = one_server(a, args.requests)
        rows.append((one, *two_servers(a, b, args.requests)))
        print(f"round {r + 1}: {a} alone {1e3 * one:.1f} ms, alternating {1e3 * rows[-1][1]:.1f} ms "
              f"({rows[-1][1] / one:.2f}x)", flush=True)
    med = [statistics.median(col) for col in zip(*rows)]
    ratio = statistics.median(row[1] / row[0] for row in rows)
    print(f"{a}, one model served: median time to first token {1e3 * med[0]:.1f} ms")
    print(f"{a}, alternating with {b}: median {1e3 * med[1]:.1f} ms (median of the rounds' ratios {ratio:.2f}x); "
          f"{b}: {1e3 * med[2]:.1f} ms")
    print(f"{a}, first request to the model not loaded: {1e3 * med[3]:.0f} ms, of which the load {1e3 * med[4]:.0f} ms")


if __name__ == "__main__":
    main()
