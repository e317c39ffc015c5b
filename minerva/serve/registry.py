"""The servers running on this machine: each `minerva serve` records itself (its URL, model
and process) under MINERVA_HOME while it runs, so that `minerva ps` and `minerva bench serve`
find it on whatever port it took, as `ollama ps` finds its server. A record whose process
has gone (killed without a chance to remove it) is dropped when read."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from minerva.store import store_root

DEFAULT_URL = "http://127.0.0.1:8000"


def servers_dir() -> Path:
    return store_root().parent / "servers"


@contextlib.contextmanager
def registered(url: str, model: str):
    """While the block runs, this process is recorded as the server at `url` serving `model`."""
    path = servers_dir() / f"{os.getpid()}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"url": url, "model": model, "pid": os.getpid(), "started": time.time()}))
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
        if _alive(pid):
            out.append({**record, "pid": pid, "url": url})
        else:
            path.unlink(missing_ok=True)
    return sorted(out, key=lambda r: r.get("started", 0))


def urls(host: str | None, port: int | None) -> list[str]:
    """The servers a command means: the one at --host/--port when either is given, else every
    recorded one, else the default address."""
    if host is not None or port is not None:
        host = host or "127.0.0.1"
        shown = f"[{host}]" if ":" in host else host
        return [f"http://{shown}:{port or 8000}"]
    return [r["url"] for r in running()] or [DEFAULT_URL]
