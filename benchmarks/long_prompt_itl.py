"""What a long prompt arriving at a server does to the streams it runs and to a short request.

For each --prefill-chunk-seconds value, alternating over --rounds, starts `minerva serve MODEL`
with it (a process of its own), streams one completion, sends a --tokens-token prompt
(max_tokens 1) a second later and an 8-token request 2 s after that. Prints the longest and
the median gap between the stream's chunks while the long prompt ran, the short request's
time and the long prompt's time. With --stream-tokens 0 nothing streams: the long prompt runs
alone until the short request arrives.

    python benchmarks/long_prompt_itl.py smollm2-135m --tokens 6000
    python benchmarks/long_prompt_itl.py smollm2-135m --tokens 7600 --stream-tokens 0 --short-after 8
    python benchmarks/long_prompt_itl.py ~/.cache/minerva/synthetic/tinyllama-1.1b-Q4_0.gguf \\
        --tokens 1900 --stream-tokens 1000

Flags this script does not know go to `minerva serve`.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, seconds: float, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minerva", "serve", model, "--port", str(port),
                             "--prefill-chunk-seconds", str(seconds), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"minerva serve {model} exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start in 5 minutes")


def one_round(url: str, tokens: int, stream_tokens: int, short_after: float) -> dict:
    arrivals: list[float] = []
    spans: dict[str, tuple[float, float]] = {}
    client = httpx.Client(base_url=url, timeout=1200)

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": stream_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0}
        with client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())

    def timed(name: str, body: dict) -> None:
        start = time.perf_counter()
        client.post("/v1/completions", json=body).raise_for_status()
        spans[name] = (start, time.perf_counter())

    threads = [threading.Thread(target=stream)] if stream_tokens else []
    for t in threads:
        t.start()
    time.sleep(1.0)
    threads.append(threading.Thread(target=timed, args=("long", {"prompt": [33] * tokens, "max_tokens": 1})))
    threads[-1].start()
    time.sleep(short_after)
    timed("short", {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True, "temperature": 0})
    for t in threads:
        t.join()
    begin, end = spans["long"]
    if spans["short"][0] > end:
        raise SystemExit("the long prompt ended before the short request came: give more --tokens")
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > begin and a < end]
    if stream_tokens and not during:
        raise SystemExit("the stream ended before the long prompt did: give more --stream-tokens")
    return {"max_gap": max(during, default=float("nan")), "median_gap": statistics.median(during or [float("nan")]),
            "short": spans["short"][1] - spans["short"][0], "long": end - begin}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=6000, help="the long prompt's tokens (default 6000)")
    p.add_argument("--stream-tokens", type=int, default=2500,
                   help="the stream's max_tokens: it must outlast the long prompt (default 2500; 0: no stream)")
    p.add_argument("--short-after", type=float, default=2.0,
                   help="seconds from the long prompt to the 8-token request (default 2)")
    p.add_argument("--seconds", default="0,0.25", help="--prefill-chunk-seconds values (default 0,0.25)")
    p.add_argument("--rounds", type=int, default=2)
    args, extra = p.parse_known_args()  # the rest: `minerva serve` flags
    if args.tokens < 1 or args.stream_tokens < 0 or args.rounds < 1 or not 0 <= args.short_after < 3600:
        p.error("--tokens and --rounds must be >= 1, --stream-tokens >= 0, --short-after from 0 to 3600 seconds")
    print("prefill-chunk-seconds | longest gap | median gap | 8-token request | long prompt")
    for _ in range(args.rounds):
        for seconds in [float(s) for s in args.seconds.split(",")]:
            proc, url = start(args.model, seconds, extra)
            try:
                r = one_round(url, args.tokens, args.stream_tokens, args.short_after)
            finally:
                proc.terminate()
                proc.wait()
            gaps = f"{r['max_gap']:.2f} s | {r['median_gap']:.3f} s" if args.stream_tokens else "- | -"
            print(f"{seconds:g} | {gaps} | {r['short']:.2f} s | {r['long']:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
