"""A small Hugging Face Hub on 127.0.0.1 for the tests (`HF_ENDPOINT`), speaking the routes
`huggingface_hub` uses to find and download a model:

    GET  /api/models/OWNER/REPO[/revision/REV]   the repo: its commit and files (`?blobs=true`: sizes, sha256)
    GET  /api/models/OWNER/REPO/tree/REV[/PATH]  the file listing
    HEAD /OWNER/REPO/resolve/REV/FILE            a file's commit, etag (its sha256) and size
    GET  /OWNER/REPO/resolve/REV/FILE            its bytes, `Range` honoured

Errors as the Hub sends them (`X-Error-Code` RepoNotFound, EntryNotFound, GatedRepo). Faults
on demand: `cut` a file's first download after some bytes (the connection drops), serve a
file `corrupt` (other bytes than its listed checksum), `gate` a repo behind a token, answer
everything with one `status` (an outage). Files are LFS files unless `plain`. Every
request is in `log` as (method, path, Range header).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, Path | bytes]
    gated_token: str | None = None  # requests without `Authorization: Bearer <it>` get 401 GatedRepo
    corrupt: set[str] = field(default_factory=set)  # served with the first byte changed
    plain: set[str] = field(default_factory=set)  # kept in git, not LFS: listed by their git blob id
    _sha: dict[str, str] = field(default_factory=dict)

    def data(self, name: str) -> bytes:
        f = self.files[name]
        data = f if isinstance(f, bytes) else f.read_bytes()
        if name in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    def size(self, name: str) -> int:
        f = self.files[name]
        return len(f) if isinstance(f, bytes) else f.stat().st_size

    def sha256(self, name: str) -> str:
        if name not in self._sha:
            f = self.files[name]
            self._sha[name] = hashlib.sha256(f if isinstance(f, bytes) else f.read_bytes()).hexdigest()
        return self._sha[name]

    def put(self, name: str, data: Path | bytes) -> None:
        """Add or change a file: a new commit."""
        self.files[name] = data
        self._sha.pop(name, None)

    def blob_id(self, name: str) -> str:
        f = self.files[name]
        data = f if isinstance(f, bytes) else f.read_bytes()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def entry(self, name: str) -> dict:
        """What the Hub lists of a file: size, blob id and, for an LFS file, its sha256."""
        if name in self.plain:
            return {"size": self.size(name), "blobId": self.blob_id(name)}
        return {"size": self.size(name), "blobId": self.sha256(name)[:40],
                "lfs": {"sha256": self.sha256(name), "size": self.size(name), "pointerSize": 134}}

    def etag(self, name: str) -> str:
        return self.blob_id(name) if name in self.plain else self.sha256(name)

    @property
    def commit(self) -> str:
        listing = "".join(f"{n}:{self.sha256(n)}\n" for n in sorted(self.files))
        return hashlib.sha1(listing.encode()).hexdigest()


class Hub:
    """The server; `with Hub() as hub:` runs it on a free port (`hub.url`)."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.cut: dict[str, int] = {}  # "OWNER/REPO/FILE" -> bytes sent before the first GET drops
        self.status: int | None = None  # when set, every request is answered with it (a Hub outage)
        self.log: list[tuple[str, str, str | None]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> Hub:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, repo_id: str, files: dict[str, Path | bytes], **kw) -> Repo:
        self.repos[repo_id] = Repo(dict(files), **kw)
        return self.repos[repo_id]

    def use(self, monkeypatch, cache: Path) -> Hub:
        """This hub as the endpoint, `cache` as a fresh Hugging Face cache, no token, online; the
        request log cleared."""
        for var in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HOME"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("HF_ENDPOINT", self.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
        self.log.clear()
        return self

    def downloads(self, name: str) -> list[str | None]:
        """The Range headers of the GETs of one file (None: the whole file)."""
        return [rng for method, path, rng in self.log if method == "GET" and "/resolve/" in path
                and path.endswith("/" + name)]


def _handler(hub: Hub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._route(head=True)

        def do_GET(self):
            self._route(head=False)

        def _route(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.log.append((self.command, path, self.headers.get("Range")))
            if hub.status is not None:
                return self._error(hub.status, "", "Service unavailable")
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api(parts[2] + "/" + parts[3], parts[4:], "blobs=true" in self.path)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._file(parts[0] + "/" + parts[1], "/".join(parts[4:]), head)
            self._error(404, "EntryNotFound", "no such route")

        def _repo(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if repo.gated_token and self.headers.get("Authorization") != f"Bearer {repo.gated_token}":
                self._error(401, "GatedRepo", "Access to this model is restricted")
                return None
            return repo

        def _api(self, repo_id: str, rest: list[str], blobs: bool) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            if rest[:1] == ["tree"]:
                prefix = "/".join(rest[2:])
                entries = []
                for n in sorted(repo.files):
                    if n.startswith(prefix):
                        e = repo.entry(n)
                        lfs = e.get("lfs")
                        entries.append({"type": "file", "path": n, "size": e["size"], "oid": e["blobId"],
                                        **({"lfs": {"oid": lfs["sha256"], "size": lfs["size"],
                                                    "pointerSize": lfs["pointerSize"]}} if lfs else {})})
                return self._json(entries)
            siblings = [{"rfilename": n, **(repo.entry(n) if blobs else {})} for n in sorted(repo.files)]
            self._json({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                        "gated": bool(repo.gated_token), "siblings": siblings})

        def _file(self, repo_id: str, name: str, head: bool) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            if name not in repo.files:
                return self._error(404, "EntryNotFound", "Entry not found", commit=repo.commit)
            size, start = repo.size(name), 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and not head:
                start = int(rng[6:].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("ETag", f'"{repo.etag(name)}"')
            if name not in repo.plain:
                self.send_header("X-Linked-Etag", f'"{repo.etag(name)}"')
                self.send_header("X-Linked-Size", str(size))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(size - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            self.end_headers()
            if head:
                return
            body = repo.data(name)[start:]
            key = f"{repo_id}/{name}"
            if key in hub.cut:
                body = body[:hub.cut.pop(key)]
                self.wfile.write(body)
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

        def _json(self, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler
