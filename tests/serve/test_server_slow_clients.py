"""Slow and excess clients against a real `minerva serve` (the tiny model, uvicorn as `serve` runs
it): a request head or body that does not arrive in time gets a 408 and its connection is
closed, an idle connection is closed, more connections than --max-connections get a 503 at
once, and a normal client is served meanwhile. The slow clients are raw sockets that send one
byte every TICK seconds and never finish."""

from __future__ import annotations

import json
import select
import socket
import statistics
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from minerva import LLM
from minerva.errors import MinervaError
from minerva.serve.app import ServerConfig
from tests.helpers.cli import assert_clean_error, run
from tests.helpers.server import running_server, wait_for

TIMEOUT = 1.0  # the server's --header-timeout and --body-timeout here
GRACE = 5.0  # how long after the timeout a slow client may still be connected, on a busy machine
TICK = 0.5
SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
SLOW_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 1000\r\n\r\n{")


def tiny_llm(tiny):
    return LLM(str(tiny), device="cpu", dtype="float32", kv_cache_memory=4e6, max_num_seqs=4)


@pytest.fixture(scope="module")
def url(tiny):
    with running_server(tiny_llm(tiny), header_timeout=TIMEOUT, body_timeout=TIMEOUT, max_connections=200) as (u, _):
        yield u


def address(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname, parsed.port


class SlowClients:
    """`n` raw connections that send `opening`, then `drip` every TICK s until answered or closed.
    `replies[i]` is what connection i got; `closed_after[i]` the seconds from the start until the
    server closed it (EOF or reset), or None while it is open."""

    def __init__(self, url: str, opening: bytes, drip: bytes | None = b"x", n: int = 1):
        self.socks = [socket.create_connection(address(url), timeout=10) for _ in range(n)]
        for s in self.socks:
            if opening:
                s.sendall(opening)
            s.setblocking(False)
        self.drip, self.start = drip, time.monotonic()
        self.replies = [b""] * n
        self.closed_after: list[float | None] = [None] * n
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        next_drip = 0.0
        while not self.stop.is_set() and None in self.closed_after:
            live = [i for i, t in enumerate(self.closed_after) if t is None]
            if self.drip and time.monotonic() >= next_drip:
                for i in live:
                    if not self.replies[i]:
                        self.send(i)
                next_drip = time.monotonic() + TICK
            readable, _, _ = select.select([self.socks[i] for i in live], [], [], 0.05)
            for s in readable:
                i = self.socks.index(s)
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                self.replies[i] += data
                if not data:
                    self.closed(i)

    def send(self, i: int) -> None:
        try:
            self.socks[i].send(self.drip)
        except BlockingIOError:
            pass
        except OSError:
            self.closed(i)

    def closed(self, i: int) -> None:
        if self.closed_after[i] is None:
            self.closed_after[i] = time.monotonic() - self.start

    def all_closed(self, within: float) -> bool:
        self.thread.join(max(0.0, self.start + within - time.monotonic()))
        return None not in self.closed_after

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks:
            s.close()


def status_and_error(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def completion(url: str, client: httpx.Client | None = None) -> float:
    """Seconds a small completion takes; it must succeed. (ignore_eos: the tiny random model
    samples its end token first now and then, 0.07% a request, which would leave no token.)"""
    start = time.monotonic()
    r = (client or httpx).post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 4, "ignore_eos": True},
                               timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    return time.monotonic() - start


def test_slow_request_head_gets_408_and_idle_connection_is_closed(url):
    with SlowClients(url, SLOW_HEAD) as slow, SlowClients(url, b"", drip=None) as idle:
        assert slow.all_closed(TIMEOUT + GRACE) and idle.all_closed(TIMEOUT + GRACE), "still connected"
        assert slow.closed_after[0] >= TIMEOUT * 0.9 and idle.closed_after[0] >= TIMEOUT * 0.9
        status, error = status_and_error(slow.replies[0])
        assert status == 408 and "--header-timeout" in error["message"] and error["code"] == 408
        assert idle.replies[0] == b""  # nothing asked, nothing answered: a pooled client finds no stale 408


def test_slow_request_body_gets_408(url):
    with SlowClients(url, SLOW_BODY) as slow:
        assert slow.all_closed(TIMEOUT + GRACE), "still connected"
        if slow.replies[0]:  # the 408 may be lost to a reset, as the client is still sending
            status, error = status_and_error(slow.replies[0])
            assert status == 408 and "--body-timeout" in error["message"]


def test_normal_clients_are_served_while_slow_ones_hang_on(url):
    before = statistics.median(completion(url) for _ in range(3))
    with SlowClients(url, SLOW_HEAD, n=25) as heads, SlowClients(url, SLOW_BODY, n=25) as bodies:
        during = completion(url)
        assert during < 10, f"a completion took {during:.1f} s beside 50 slow clients ({before:.3f} s alone)"
        assert heads.all_closed(TIMEOUT + GRACE) and bodies.all_closed(TIMEOUT + GRACE), "slow clients still connected"
    print(f"completion latency: {before * 1e3:.0f} ms alone, {during * 1e3:.0f} ms beside 50 slow clients")
    completion(url)


def test_keep_alive_gets_a_fresh_header_deadline_per_request(url):
    """Three requests on one connection over more than one header timeout, each head in time."""
    with socket.create_connection(address(url), timeout=10) as s:
        for _ in range(3):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while not reply.endswith(b"}"):
                chunk = s.recv(65536)
                assert chunk, "the server closed a keep-alive connection that asked in time"
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200"), reply
            time.sleep(TIMEOUT * 0.6)


def test_connections_beyond_the_cap_get_503(tiny):
    cap = 4
    with running_server(tiny_llm(tiny), max_connections=cap, header_timeout=60) as (url, _):
        held = [socket.create_connection(address(url), timeout=10) for _ in range(cap)]
        try:
            with socket.create_connection(address(url), timeout=10) as extra:
                extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                reply = b""
                while chunk := extra.recv(65536):  # the answer, then EOF: the server closed it
                    reply += chunk
            status, error = status_and_error(reply)
            assert status == 503 and error["type"] == "server_overloaded" and b"retry-after: 1" in reply.lower()
        finally:
            for s in held:
                s.close()
        with httpx.Client() as client:  # the held ones are gone once the server has seen them close
            wait_for(lambda: client.get(f"{url}/health", timeout=10).status_code == 200, 10, "a free connection")
            completion(url, client)


@pytest.mark.parametrize("field,value", [("header_timeout", 0), ("body_timeout", -1.0),
                                         ("body_timeout", float("nan")), ("header_timeout", float("inf")),
                                         ("max_connections", 0), ("max_connections", 2.5)])
def test_config_rejects_bad_limits(field, value):
    with pytest.raises(MinervaError, match=f"--{field.replace('_', '-')}"):
        ServerConfig("m", **{field: value})


def test_cli_serve_bad_max_connections(tiny):
    assert_clean_error(run("serve", str(tiny), "--max-connections", "0"), "--max-connections")
