"""The servers running on this machine: each `minerva serve` records itself (its URL, model
and process) under MINERVA_HOME while it runs, so that `minerva ps` and `minerva bench serve`
find it on whatever port it took, as `ollama ps` finds its server. A record whose process
has gone (killed without a chance to remove it) is dropped when read."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from pathlib import Path

from minerva.store import store_root

DEFAULT_URL = "http://127.0.0.1:8000"
_serial = itertools.count()


def servers_dir() -> Path:
    return store_root().parent / "servers"


def _process_start(pid: int) -> str | None:
    """When process `pid` started (/proc's clock ticks since boot), so that a record outlived
    by its process is not taken for another that reused the number; None where unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def local_url(host: str, port: int) -> str:
    """The URL a client here reaches a server bound to host:port by (a wildcard bind: loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.contextmanager
def registered(url: str, model: str):
    """While the block runs, this process is recorded as the server at `url` serving `model`
    (one record a server: several in one process count apart)."""
    path = servers_dir() / f"{os.getpid()}-{next(_serial)}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"url": url, "model": model, "pid": os.getpid(),
                                    "process_start": _process_start(os.getpid()), "started": time.time()}))
    except OSError:  # a read-only home: the server runs, unlisted
        path = None
    try:
        yield
    finally:
        if path is not None:
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def running() -> list[dict]:
    """The recorded servers whose process still runs, oldest first."""
    out = []
    for path in sorted(servers_dir().glob("*.json")) if servers_dir().is_dir() else []:
        try:
            record = json.loads(path.read_text())
            pid, url = int(record["pid"]), str(record["url"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(pid) and record.get("process_start") in (None, _process_start(pid)):
            out.append({**record, "pid": pid, "url": url})
        else:
            path.unlink(missing_ok=True)
    return sorted(out, key=lambda r: r.get("started", 0))


def urls(host: str | None, port: int | None) -> list[str]:
    """The servers a command means: the one at --host/--port when either is given, else every
    recorded one, else the default address."""
    if host is not None or port is not None:
        return [local_url(host or "127.0.0.1", port or 8000)]
    return [r["url"] for r in running()] or [DEFAULT_URL]
