"""Models from the Hugging Face Hub, named as `OWNER/REPO[:QUANT]` or `hf.co/OWNER/REPO[:QUANT]`.

Everything goes through `huggingface_hub` and its standard cache (`HF_HUB_CACHE`, else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`), shared with every other Hugging Face tool;
`HF_TOKEN`, `HF_ENDPOINT` and `HF_HUB_OFFLINE` mean what they mean there. Only the files a
model needs are fetched (resumable, with a progress bar):

- a GGUF repo: the file(s) of one quant. `:QUANT` picks it by the tag in its name,
  case-insensitively; without one, the first of `PREFERENCE` the repo has. A split model
  (`...-00001-of-00003.gguf`) comes whole and loads from its first part.
- a SafeTensors repo: its config, tokenizer and chat-template files and `*.safetensors`
  weights, never `.bin`/`.pt` pickles.

A freshly downloaded file whose sha256 differs from the one the Hub lists is deleted
again. Offline, or when the Hub cannot be reached, a model already in the cache loads
without a network.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import logging
import os
import shutil
import time
import warnings
from pathlib import Path

from minerva.errors import MinervaError
from minerva.hub_names import (ADAPTER_FILES, PREFERENCE, PREFIXES, RepoRef, gguf_choices,  # noqa: F401 (the API)
                               model_path, parse, pick_files, pick_gguf, quant_tag)

log = logging.getLogger("minerva")
warnings.filterwarnings("ignore", message="Not enough free disk space", category=UserWarning)  # (see _room_for)

_CHUNK = 1 << 20


# ------------------------------------------------------------------ the cache


def cache_dir() -> Path:
    """huggingface_hub's cache folder, as its environment variables set it when called."""
    hub_cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if hub_cache:
        return Path(os.path.expandvars(hub_cache)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def repo_folder(repo_id: str) -> Path:
    return cache_dir() / ("models--" + repo_id.replace("/", "--"))


def cached_snapshots(repo_id: str) -> list[tuple[Path, list[str]]]:
    """The repo's cached snapshots with their files: the main branch's first, then the newest."""
    folder = repo_folder(repo_id)
    snapshots = folder / "snapshots"
    try:
        commit = (folder / "refs" / "main").read_text().strip()
        found = sorted(snapshots.iterdir(), key=lambda p: (p.name != commit, -p.stat().st_mtime))
    except OSError:
        found = []
    out = []
    for snap in found:
        try:
            files = sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file())
        except OSError:
            continue
        if files:
            out.append((snap, files))
    return out


def _from_cache(ref: RepoRef, why: str) -> Path:
    found = cached_snapshots(ref.repo_id)
    if not found:
        raise MinervaError(f"'{ref}' is not in the Hugging Face cache ({cache_dir()}) and {why}")
    for snap, files in found:
        try:
            return model_path(snap, pick_files(ref, files, where=" in the Hugging Face cache"))
        except MinervaError as exc:
            error = exc
    raise MinervaError(f"{error}; and {why}") from None


# ------------------------------------------------------------------ downloading


def fetch(ref: RepoRef, *, download: bool = True, progress: bool = True, verify: bool = False,
          adapter: bool = False) -> Path:
    """The local path of `ref`'s model (with `adapter`, of its LoRA adapter: a repo without
    PEFT's files is refused before anything downloads), downloading what is missing from the
    cache; each file downloaded (with `verify`, each cached one too) is checked against the
    Hub's checksum.

    `download=False` only looks in the cache (`minerva show`); so does HF_HUB_OFFLINE=1."""
    if offline():
        return _from_cache(ref, "HF_HUB_OFFLINE is set; unset it to download")
    if not download:
        return _from_cache(ref, f"is not downloaded here; run `minerva pull {ref}`")
    from huggingface_hub import HfApi
    try:
        info = HfApi(endpoint=_endpoint()).model_info(
            ref.repo_id, files_metadata=True, timeout=float(os.environ.get("HF_HUB_ETAG_TIMEOUT", 10)))
    except Exception as exc:
        if _unavailable(exc) and cached_snapshots(ref.repo_id):
            return _from_cache(ref, f"the Hub at {_endpoint()} is unavailable ({_first_line(exc)})")
        if _unavailable(exc):
            raise MinervaError(f"'{ref}' is not in the Hugging Face cache ({cache_dir()}) and the Hub at "
                               f"{_endpoint()} cannot be reached ({_first_line(exc)}); check the network, "
                               "HF_ENDPOINT and proxy settings") from None
        raise _hub_error(ref, exc) from None
    files = {s.rfilename: s for s in info.siblings or []}
    if adapter and not ADAPTER_FILES <= {f for f in files if "/" not in f}:
        if "adapter_config.json" in files and "adapter_model.bin" in files:
            raise MinervaError(f"'{ref.repo_id}' holds its LoRA weights as a pickle (adapter_model.bin), which is "
                               "never loaded; it needs adapter_model.safetensors (PEFT's default)")
        shown = ", ".join(sorted(files)[:8]) + (" ..." if len(files) > 8 else "") if files else "no files"
        raise MinervaError(f"'{ref.repo_id}' is not a LoRA adapter: it lacks {' and '.join(sorted(ADAPTER_FILES))} "
                           f"({shown}); give an adapter repo (or folder) as PEFT's save_pretrained writes it")
    chosen = sorted(ADAPTER_FILES) if adapter else pick_files(ref, list(files))
    snapshot = _download(ref, info.sha, chosen, {f: files[f] for f in chosen}, progress, verify)
    return model_path(snapshot, chosen)


def _download(ref: RepoRef, commit: str, files: list[str], listed: dict, progress: bool, verify: bool) -> Path:
    """Download what of `files` the cache lacks at `commit` (the main branch's, just asked),
    each with its own progress bar and checked as it arrives; returns the snapshot folder. A
    cached file of another size than the Hub lists (cut short on disk), or with `verify` one
    whose checksum differs, is deleted and downloaded again."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    snapshot = repo_folder(ref.repo_id) / "snapshots" / commit
    missing = [f for f in files if not (snapshot / f).is_file() or _wrong_size(ref, snapshot / f, listed[f])]
    if not progress:
        disable_progress_bars()
    try:
        for name in files:
            if name not in missing and verify and not _verify(ref, snapshot / name, listed[name], cached=True):
                missing.append(name)
            if name in missing:
                _room_for(name, listed[name])
                try:
                    hf_hub_download(ref.repo_id, name, revision=commit, cache_dir=cache_dir(), endpoint=_endpoint())
                except Exception as exc:
                    raise _hub_error(ref, exc) from None
                _drop_partials(snapshot / name)
                _verify(ref, snapshot / name, listed[name])
    finally:
        if not progress:
            enable_progress_bars()
    try:  # what huggingface_hub writes when it resolves `main` itself: the offline lookup reads it
        (repo_folder(ref.repo_id) / "refs").mkdir(parents=True, exist_ok=True)
        (repo_folder(ref.repo_id) / "refs" / "main").write_text(commit)
    except OSError:
        pass
    return snapshot


def _wrong_size(ref: RepoRef, path: Path, listed) -> bool:
    """Whether a cached file is not the size the Hub lists (then it is deleted, said, and
    downloaded again): a file cut short on disk, found without reading it."""
    try:
        size = path.stat().st_size
    except OSError:
        return True
    if not listed.size or size == listed.size:
        return False
    _delete_cached(ref, path)
    log.warning("'%s': the cached %s is %d bytes, but the Hub lists %d; downloading it again",
                ref, path.name, size, listed.size)
    return True


STALE_PARTIAL_SECONDS = 3600  # a partial file untouched this long is no download under way


def _drop_partials(path: Path) -> None:
    """Delete what killed downloads of a file now complete left in the cache: its blob's
    `.incomplete` files untouched for an hour (a new download never resumes another process's;
    one written more lately may be another process's download under way)."""
    blob = path.resolve()
    try:
        for partial in blob.parent.glob(glob.escape(blob.name) + "*.incomplete"):
            if time.time() - partial.stat().st_mtime > STALE_PARTIAL_SECONDS:
                partial.unlink(missing_ok=True)
    except OSError:  # (a cache shared with others: what cannot go stays)
        pass


def _room_for(name: str, listed) -> None:
    """A line where the cache has less free space than the file takes (huggingface_hub's own
    warning about it is silenced: a raw warning with its source line)."""
    try:
        free = shutil.disk_usage(_existing(cache_dir())).free
    except OSError:
        return
    if listed.size and free < listed.size:
        log.warning("%s takes %.2f GB and the Hugging Face cache (%s) has %.2f GB free; the download may fail",
                    name, listed.size / 1e9, cache_dir(), free / 1e9)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _verify(ref: RepoRef, path: Path, listed, cached: bool = False) -> bool:
    """A file against the checksum the Hub lists for it (an LFS file's sha256, else its git
    blob id); a mismatch deletes it (its cache blob too), and so does an interrupted check. A
    download that does not match is an error (the next try downloads it again); a `cached`
    one is said and False returned, for the caller to download it again."""
    if listed.lfs is not None:
        h, want, kind = hashlib.sha256(), listed.lfs.sha256, "sha256"
    elif listed.blob_id:
        h, want, kind = hashlib.sha1(), listed.blob_id, "git blob id"
        h.update(b"blob %d\0" % path.stat().st_size)
    else:
        return True
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except BaseException:
        _delete(path)
        raise
    if h.hexdigest() == want:
        return True
    if cached:
        _delete_cached(ref, path)
        log.warning("'%s': the cached %s has %s %s, but the Hub lists %s; it was damaged on disk and is "
                    "downloaded again", ref, path.name, kind, h.hexdigest(), want)
        return False
    _delete(path)
    raise MinervaError(f"'{ref}': {path.name} has {kind} {h.hexdigest()}, but the Hub lists "
                       f"{want}; the file was corrupted and is deleted; run the command again")


def _delete_cached(ref: RepoRef, path: Path) -> None:
    """Delete a damaged cached file to download it again, or say why it cannot be."""
    try:
        _delete(path)
    except OSError as exc:
        raise MinervaError(f"'{ref}': the cached {path.name} is damaged and cannot be deleted from the Hugging "
                           f"Face cache ({cache_dir()}: {exc.strerror or exc}); delete it, or set HF_HOME or "
                           "HF_HUB_CACHE to a cache that can be written") from None


def _delete(path: Path) -> None:
    blob = path.resolve()
    path.unlink(missing_ok=True)
    blob.unlink(missing_ok=True)


def _unavailable(exc: BaseException) -> bool:
    """No answer from the Hub, or a server error or rate limit: the cache may still serve."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return _network_error(exc) or (isinstance(status, int) and (status >= 500 or status == 429))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _network_error(exc: BaseException) -> bool:
    module = type(exc).__module__.split(".")[0]
    return (module in ("httpx", "httpx2", "httpcore", "requests", "urllib3") and "Status" not in type(exc).__name__) \
        or isinstance(exc, (ConnectionError, TimeoutError))


# the cache folder's own faults: full, read-only, not a folder, not ours
_CACHE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST}


def _hub_error(ref: RepoRef, exc: BaseException) -> MinervaError:
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)
    where = _endpoint()
    if isinstance(exc, GatedRepoError):
        return MinervaError(f"'{ref.repo_id}' is a gated repo: accept its conditions at {where}/{ref.repo_id} "
                            "while logged in, then set HF_TOKEN to a token of that account (or run `hf auth login`)")
    if isinstance(exc, RepositoryNotFoundError):
        token = "; HF_TOKEN is set, check that it may read it" if os.environ.get("HF_TOKEN") else \
            " (a private repo needs HF_TOKEN)"
        return MinervaError(f"no model repo '{ref.repo_id}' on {where}{token}; check the name "
                            "(and no file or folder of that name exists here)")
    if isinstance(exc, LocalEntryNotFoundError) or _network_error(exc):
        return MinervaError(f"could not download '{ref}' from {where} ({_first_line(exc)}); "
                            "check the network and run the command again")
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "an error")
        return MinervaError(f"the Hub at {where} answered {status} for '{ref}': {_first_line(exc)}")
    if isinstance(exc, OSError) and exc.errno in _CACHE_ERRNOS:
        return MinervaError(f"could not write '{ref}' into the Hugging Face cache ({cache_dir()}): "
                            f"{_first_line(exc)}; free space there, or set "
                            f"{'HF_HUB_CACHE' if os.environ.get('HF_HUB_CACHE') else 'HF_HOME (or HF_HUB_CACHE)'} "
                            "to a writable folder with room")
    if isinstance(exc, OSError):
        return MinervaError(f"could not download '{ref}': {_first_line(exc)}; run the command again")
    return MinervaError(f"could not download '{ref}' from {where}: {type(exc).__name__}: {_first_line(exc)}")


# ------------------------------------------------------------------ list and remove


def cached_models() -> list[tuple[str, Path, int]]:
    """(name to give, path the loader takes, bytes) of every model in the cache: one per quant
    of a GGUF repo (over all its cached snapshots), one per SafeTensors repo."""
    out = []
    root = cache_dir()
    try:
        folders = sorted(root.glob("models--*--*")) if root.is_dir() else []
    except OSError:
        folders = []
    for folder in folders:
        repo_id = folder.name.removeprefix("models--").replace("--", "/", 1)
        seen: set[str] = set()
        for snap, files in cached_snapshots(repo_id):
            try:
                choices = gguf_choices(files)
                if not choices and not seen:
                    chosen = pick_files(RepoRef(repo_id), files)
                    out.append((repo_id, snap, sum((snap / n).stat().st_size for n in chosen)))
                    seen.add("")
                for tag, names in choices.items():
                    name = f"{repo_id}:{tag.rsplit('/', 1)[-1]}"
                    if tag not in seen:
                        out.append((name, snap / names[0], sum((snap / n).stat().st_size for n in names)))
                        seen.add(tag)
            except (MinervaError, OSError):
                continue
    return out


def remove(ref: RepoRef) -> Path:
    """Delete a repo from the cache (with `:QUANT`, only that quant's files); returns what was removed."""
    folder = repo_folder(ref.repo_id)
    if not folder.is_dir():
        raise MinervaError(f"'{ref.repo_id}' is not in the Hugging Face cache ({cache_dir()}); "
                           "`minerva list` shows what is")
    try:
        if ref.quant is None:
            shutil.rmtree(folder)
            return folder
        return _remove_quant(ref)
    except OSError as exc:
        raise MinervaError(f"could not remove '{ref}' from {folder}: {exc.strerror or exc}") from None


def _remove_quant(ref: RepoRef) -> Path:
    """Delete one quant's files (and their blobs no other snapshot names); returns its first file."""
    snapshots = cached_snapshots(ref.repo_id)
    links = []
    for snap, files in snapshots:
        try:
            links += [snap / n for n in pick_gguf(ref, files)]
        except MinervaError:
            continue
    if not links:
        have = sorted({t for _, files in snapshots for t in gguf_choices(files)})
        raise MinervaError(f"the cached '{ref.repo_id}' has no {ref.quant.upper()} file (cached: "
                           f"{', '.join(have) or 'none'}); `minerva rm {ref.repo_id}` removes the whole repo")
    blobs = {link.resolve() for link in links}
    for link in links:
        link.unlink()
    still = {(snap / n).resolve() for snap, files in cached_snapshots(ref.repo_id) for n in files}
    for blob in blobs - still:
        if blob.parent.name == "blobs":
            blob.unlink(missing_ok=True)
    folder = repo_folder(ref.repo_id)
    if not any(p.is_file() for p in (folder / "snapshots").rglob("*")):  # its last file: no empty folders stay
        shutil.rmtree(folder)
    return links[0]
