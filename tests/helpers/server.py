"""A real `minerva serve` app under uvicorn on a free loopback port, in a background thread."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time

import httpx


@contextlib.contextmanager
def running_server(llm, **config):
    from minerva.serve.app import ServerConfig, build_app

    server_config = ServerConfig(**{"served_model_name": "test-model", **config})
    with running_app(build_app(llm, server_config), server_config) as served:
        yield served


@contextlib.contextmanager
def running_app(app, server_config):
    """`app` (`build_app`'s or `build_router_app`'s) under the server `minerva serve` runs."""
    from minerva.serve.server import make_server

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(app, server_config, log_level="warning")  # what `minerva serve` runs
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def metric(base_url: str, name: str, labels: str = "", headers: dict | None = None) -> float:
    """Sum of a metric's samples in /metrics whose labels contain `labels`; 0 if there are none
    (a labelled counter has no sample before its first count). A name /metrics does not
    declare is an error, so a wait on a renamed metric cannot pass by reading 0."""
    text = httpx.get(f"{base_url}/metrics", headers=headers or {}, timeout=10).text
    family = re.sub(r"_(total|sum|count|bucket|created)$", "", name)
    if not re.search(rf"^# TYPE ({re.escape(name)}|{re.escape(family)}) ", text, re.M):
        raise AssertionError(f"/metrics declares no metric named {name}")
    pattern = rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$"
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M) if labels in (m.group(1) or ""))


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_up(url: str) -> bool:
    """Whether a server answers /health with 200 (a short pause when it does not answer yet)."""
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        time.sleep(0.2)
        return False
