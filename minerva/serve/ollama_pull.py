"""Ollama's /api/pull: a model fetched into the server's list (a server of several started with
`--allow-pull`), its progress streamed as Ollama streams it. A model the server serves
already answers success (after fetching what of it is missing); other servers say how to
serve one."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path
from typing import Awaitable, Callable

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

import minerva.hub as hub
from minerva.errors import MinervaError
from minerva.serve.convert import APIError, clipped
from minerva.store import KNOWN_MODELS, resolve, store_root


PROGRESS_EVERY = 1.0  # seconds between a download's progress lines
QUIET_AT_MOST = 10.0  # seconds a pull's stream goes without a line


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    name: str | None = None  # the older spelling
    stream: bool = True
    insecure: bool = False  # (Ollama's registries; the Hub is always HTTPS)


def is_path(name: str) -> bool:
    """Whether `name` is a path on the server (a name no path can have, too long, `~nobody`: not)."""
    try:
        return Path(name).expanduser().exists()
    except (OSError, RuntimeError, ValueError):
        return False


def pullable(name: str) -> None:
    """A 400 for a name that is neither a built-in model nor a Hugging Face repo: a client never
    names a path on the server's disk, and Ollama's library names are not on the Hub."""
    if is_path(name):
        raise APIError(400, f"'{clipped(name)}' is a path on the server; a client pulls built-in models "
                            f"({', '.join(KNOWN_MODELS)}) and Hugging Face repos (hf.co/OWNER/REPO[:QUANT])", "model")
    try:
        repo = hub.parse(name)
    except MinervaError as exc:
        raise APIError(400, clipped(str(exc), 400), "model") from None
    if name not in KNOWN_MODELS and repo is None:
        raise APIError(400, f"'{clipped(name)}' is neither a built-in model ({', '.join(KNOWN_MODELS)}) nor a "
                            "Hugging Face repo (hf.co/OWNER/REPO[:QUANT], e.g. "
                            "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M); this server pulls those", "model")


def canonical(name: str) -> str | None:
    """One spelling of a built-in model or a Hugging Face repo for all of its names (hf.co/,
    huggingface.co/ or none, slashes doubled, the quantization's case), None for other names:
    what a pull's download and the served list are keyed by."""
    if name in KNOWN_MODELS:
        return name
    try:
        repo = None if is_path(name) else hub.parse(name)
    except (MinervaError, OSError, RuntimeError, ValueError):
        return None
    return None if repo is None else f"{repo.repo_id}:{(repo.quant or '').upper()}"


def here(name: str) -> bool:
    """Whether `name`, a built-in model or a Hugging Face repo, is here to serve without fetching
    (`minerva list` names OWNER/REPO pulled without a quantization as OWNER/REPO:ITS_QUANT)."""
    try:
        pullable(name)
        resolve(name, auto_pull=False)
    except Exception:  # (APIError, MinervaError, OSError: not here)
        return False
    return True


def folder_of(name: str) -> Path | None:
    """Where a pull of `name` writes (the model store's folder, the repo's in the Hugging Face
    cache), whose growth is the download's progress; None where nothing is known."""
    if name in KNOWN_MODELS:
        return store_root() / name
    try:
        repo = hub.parse(name)
    except MinervaError:
        return None
    return hub.repo_folder(repo.repo_id) if repo is not None else None


def size_of(folder: Path | None) -> int:
    """The bytes of the files under `folder` (0 for none), links not followed nor counted."""
    total = 0
    for top, _, files in os.walk(folder) if folder is not None else ():
        for f in files:
            try:
                st = os.stat(os.path.join(top, f), follow_symlinks=False)
            except OSError:  # written or renamed meanwhile
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def failure(name: str, exc: BaseException) -> str:
    """What a failed pull's client is told (the server's log has it from the router)."""
    return f"'{clipped(name)}' could not be pulled: {exc if isinstance(exc, MinervaError) else repr(exc)}"


async def progress(name: str, task: asyncio.Task | None):
    """Ollama's lines: `pulling manifest`, then `downloading` with the bytes written so far (no
    digest or total), then `success` (or `error`, the stream's last line, as Ollama ends a failed pull). A client that
    leaves does not stop the download."""
    yield json.dumps({"status": "pulling manifest"}) + "\n"
    if task is not None:
        folder = folder_of(name)
        start = peak = await asyncio.to_thread(size_of, folder)
        said = time.monotonic()
        while True:
            done, _ = await asyncio.wait({task}, timeout=PROGRESS_EVERY)  # (does not cancel the task)
            now = await asyncio.to_thread(size_of, folder)
            # a line when more is written (a finished pull's temporary files go: none for the drop), and
            # one at least every QUIET_AT_MOST (a checksum being taken) for clients that time out reads
            if now > peak or time.monotonic() - said >= QUIET_AT_MOST:
                peak, said = max(peak, now), time.monotonic()
                yield json.dumps({"status": "downloading", "completed": peak - start}) + "\n"
            if done:
                break
        exc = task.exception() if not task.cancelled() else asyncio.CancelledError("the server is stopping")
        if exc is not None:
            yield json.dumps({"error": failure(name, exc)}) + "\n"
            return
    yield json.dumps({"status": "success"}) + "\n"


def register(app, prefix: str, pull: Callable[[str], Awaitable[asyncio.Task | None]]) -> None:
    """POST /api/pull on `app`; `pull(name)` starts fetching the model `name` (None: nothing to
    fetch) or raises the APIError that says why not."""

    async def api_pull(body: PullRequest):
        name = body.model or body.name
        if not name:
            raise APIError(400, "model is required: the model to pull, a built-in name or a Hugging Face repo "
                                "(hf.co/OWNER/REPO[:QUANT])", "model")
        name = name[:-len(":latest")] if name.endswith(":latest") else name
        task = await pull(name)
        if body.stream:
            return StreamingResponse(progress(name, task), media_type="application/x-ndjson")
        if task is not None:
            try:
                await asyncio.shield(task)  # a client that leaves does not stop the download
            except Exception as exc:
                raise APIError(400, failure(name, exc), "model") from None
        return {"status": "success"}

    app.post(prefix + "pull", summary="Ollama API: /api/pull")(api_pull)
