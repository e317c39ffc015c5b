"""How much do huge prompts arriving at a server stall the streams it is already running?

Starts `minerva serve MODEL` (or uses --url), runs --streams streaming completions and measures
their inter-token latency (the gaps between chunks) and /health's latency, first alone, then while
--big concurrent requests arrive whose prompts are --big-chars characters long (3.9 MB by default,
past any context: the server must refuse them without stalling anyone), and then while prompts
just under the server's cheap character bound arrive (those are tokenized, on a worker thread).

    python benchmarks/stall.py                      # smollm2-135m, 8 streams, 3 big prompts
    python benchmarks/stall.py --url http://127.0.0.1:8000 --model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time

import httpx


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def stream(client: httpx.AsyncClient, model: str, tokens: int, gaps: list[float]) -> None:
    body = {"model": model, "prompt": "Tell me a story.", "max_tokens": tokens, "ignore_eos": True,
            "stream": True}
    last = None
    async with client.stream("POST", "/v1/completions", json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now


async def big(client: httpx.AsyncClient, model: str, chars: int, out: list) -> None:
    start = time.perf_counter()
    r = await client.post("/v1/completions", json={"model": model, "prompt": "a " * (chars // 2), "max_tokens": 4},
                          timeout=600)
    out.append((r.status_code, time.perf_counter() - start))


async def health(client: httpx.AsyncClient, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await client.get("/health", timeout=600)
        out.append(time.perf_counter() - start)
        await asyncio.sleep(0.05)


async def phase(url: str, model: str, args, big_chars: int | None) -> dict:
    gaps: list[float] = []
    pings: list[float] = []
    bigs: list = []
    limits = httpx.Limits(max_connections=args.streams + args.big + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        stop = asyncio.Event()
        pinger = asyncio.create_task(health(client, stop, pings))
        streams = [asyncio.create_task(stream(client, model, args.tokens, gaps)) for _ in range(args.streams)]
        await asyncio.sleep(args.warmup)
        gaps.clear()
        pings.clear()
        if big_chars:
            await asyncio.gather(*(big(client, model, big_chars, bigs) for _ in range(args.big)))
        await asyncio.gather(*streams)
        stop.set()
        await pinger
    return {"itl_p50_ms": 1e3 * statistics.median(gaps), "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
            "itl_max_ms": 1e3 * max(gaps), "health_max_ms": 1e3 * max(pings),
            "big": [(code, round(t, 2)) for code, t in bigs]}


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "minerva", "serve", args.model_path, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_path", nargs="?", default="smollm2-135m")
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--model", default=None, help="model name to send (default: the served one)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256, help="tokens each stream generates")
    p.add_argument("--big", type=int, default=3, help="concurrent huge-prompt requests")
    p.add_argument("--big-chars", type=int, default=3_900_000)
    p.add_argument("--warmup", type=float, default=1.0, help="seconds the streams run before measuring")
    args = p.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        model = args.model or card["id"]
        tokenize = httpx.post(f"{url}/tokenize", json={"prompt": "a " * 1000}).json()
        print(f"model {model}, max_model_len {card['max_model_len']}; 'a ' x 1000 is {tokenize['count']} tokens")
        for name, chars in (("streams alone", None), (f"{args.big} x {args.big_chars} chars", args.big_chars),
                            (f"{args.big} x 200000 chars", 200_000)):
            r = asyncio.run(phase(url, model, args, chars))
            print(f"{name:>28}: ITL p50 {r['itl_p50_ms']:.1f} ms, p99 {r['itl_p99_ms']:.1f} ms, "
                  f"max {r['itl_max_ms']:.1f} ms; /health max {r['health_max_ms']:.1f} ms; big: {r['big']}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
