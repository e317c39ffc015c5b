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

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from minerva.errors import MinervaError
from minerva.formats.gguf import split_parts

PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/")
# Without `:QUANT`, the first of these the repo has (the 4-bit mixes most people run first,
# then more bits, then fewer, then the float files); else the first tag in sorted order.
PREFERENCE = ("Q4_K_M", "Q4_K_S", "Q4_0", "MXFP4", "Q4_1", "Q5_K_M", "Q5_K_S", "Q5_0", "Q5_1", "Q6_K",
              "Q8_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "BF16", "F16", "F32")
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_QUANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TAG = re.compile(r"(?<![A-Za-z0-9])(I?Q[1-8](?:_[A-Z0-9]+)*|BF16|F16|F32|MXFP4(?:_MOE)?|TQ[12]_0)(?![A-Za-z0-9])",
                  re.IGNORECASE)
# What a SafeTensors model directory needs: config, tokenizer, chat template, weights.
_HF_FILES = re.compile(r"[^/]+\.(json|safetensors|jinja|tiktoken)|tokenizer\.model|merges\.txt|vocab\.txt")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class RepoRef:
    """A model on the Hub: a repo and, for a GGUF repo, the quant wanted (None: the default)."""

    repo_id: str
    quant: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f":{self.quant}" if self.quant else "")


def parse(name: str) -> RepoRef | None:
    """The repo a model argument names, or None when it does not look like one.

    `hf.co/...` and `huggingface.co/...` always mean the Hub (a malformed one is an error);
    a bare `OWNER/REPO[:QUANT]` does when no file or folder of that name exists, which the
    caller checks first."""
    lowered = name.lower()
    prefix = next((p for p in PREFIXES if lowered.startswith(p)), None)
    rest = name[len(prefix):] if prefix else name
    repo, _, quant = rest.partition(":")
    repo = repo.strip("/")
    if _REPO.fullmatch(repo) and (not quant or _QUANT.fullmatch(quant)) and ".." not in repo:
        if prefix or not repo.lower().endswith((".gguf", ".safetensors", ".bin", ".pt", ".pth")):
            return RepoRef(repo, quant or None)
    if prefix:
        raise MinervaError(f"'{name}' does not name a Hugging Face repo; write hf.co/OWNER/REPO or "
                           "hf.co/OWNER/REPO:QUANT (e.g. hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M)")
    return None


# ------------------------------------------------------------------ which files


def quant_tag(path: str) -> str | None:
    """The quant a GGUF file's name (else its folder's) carries, upper-cased: Q4_K_M, IQ4_XS, BF16..."""
    parts = path.split("/")
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", re.sub(r"\.gguf$", "", parts[-1], flags=re.IGNORECASE))
    for where in (stem, *reversed(parts[:-1])):
        tags = _TAG.findall(where)
        if tags:
            return tags[-1].upper()
    return None


def gguf_choices(files: list[str]) -> dict[str, list[str]]:
    """The GGUF models among a repo's files, by quant tag (a file with none under its name):
    each the file, or every part of a split model in order. Vision projectors (`mmproj`) and
    split models missing a part are left out."""
    found: dict[str, list[str]] = {}
    present = set(files)
    for f in sorted(files):
        if not f.lower().endswith(".gguf") or "mmproj" in f.lower():
            continue
        parts = split_parts(Path(f))
        if parts is not None:
            names = [str(p) for p in parts]
            if f != names[0] or not present.issuperset(names):
                continue
        else:
            names = [f]
        key = quant_tag(f) or f
        if key not in found or len(names[0]) < len(found[key][0]):  # the plainest name of a tag
            found[key] = names
    return found


def pick_gguf(ref: RepoRef, files: list[str], where: str = "") -> list[str]:
    """The file(s) of the quant `ref` asks for, else of the preferred one the repo has."""
    choices = gguf_choices(files)
    if ref.quant:
        for tag, names in choices.items():
            if tag.upper() == ref.quant.upper() or names[0] == ref.quant:
                return names
        have = ", ".join(sorted(choices)) or "none"
        raise MinervaError(f"'{ref.repo_id}'{where} has no {ref.quant.upper()} file; its quants: {have}; "
                           f"name one as {ref.repo_id}:QUANT")
    for tag in PREFERENCE:
        if tag in choices:
            return choices[tag]
    if choices:
        return choices[min(choices)]
    raise MinervaError(f"'{ref.repo_id}' has no GGUF file")


def pick_files(ref: RepoRef, files: list[str], where: str = "") -> list[str]:
    """What to download for `ref`: one GGUF model's file(s), or a SafeTensors model's files
    (`where` says where the files are, for the errors)."""
    if ref.quant or gguf_choices(files):
        return pick_gguf(ref, files, where)
    top = [f for f in files if "/" not in f]
    if "config.json" in top and any(f.endswith(".safetensors") for f in top):
        chosen = [f for f in top if _HF_FILES.fullmatch(f)]
        if any(f.startswith("model") and f.endswith(".safetensors") for f in chosen):
            chosen = [f for f in chosen if not f.startswith("consolidated")]  # Mistral's second copy
        return chosen
    shown = ", ".join(sorted(files)[:8]) + (" ..." if len(files) > 8 else "") if files else "no files"
    pickles = " (pickled weights are never loaded)" if any(f.endswith((".bin", ".pt", ".pth")) for f in files) else ""
    raise MinervaError(f"'{ref.repo_id}'{where} holds no GGUF file and no config.json with .safetensors weights "
                       f"({shown}){pickles}; Minerva loads GGUF or SafeTensors models")


def model_path(snapshot: Path, files: list[str]) -> Path:
    """What the loader takes: the GGUF file (the first part of a split one) or the folder."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    return snapshot / ggufs[0] if ggufs else snapshot


# ------------------------------------------------------------------ the cache


def cache_dir() -> Path:
    """huggingface_hub's cache folder, as its environment variables set it when called."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def repo_folder(repo_id: str) -> Path:
    return cache_dir() / ("models--" + repo_id.replace("/", "--"))


def cached_snapshot(repo_id: str) -> tuple[Path, list[str]] | None:
    """The cached snapshot of the repo's main branch (else its newest) and its files."""
    folder = repo_folder(repo_id)
    snapshots = folder / "snapshots"
    try:
        commit = (folder / "refs" / "main").read_text().strip()
    except OSError:
        commit = None
    candidates = [snapshots / commit] if commit else []
    if snapshots.is_dir():
        candidates += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    for snap in candidates:
        if snap.is_dir():
            files = sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file())
            if files:
                return snap, files
    return None


def _from_cache(ref: RepoRef, why: str) -> Path:
    found = cached_snapshot(ref.repo_id)
    if found is None:
        raise MinervaError(f"'{ref}' is not in the Hugging Face cache ({cache_dir()}) and {why}")
    snap, files = found
    try:
        chosen = pick_files(ref, files, where=" in the Hugging Face cache")
    except MinervaError as exc:
        raise MinervaError(f"{exc}; and {why}") from None
    return model_path(snap, chosen)


# ------------------------------------------------------------------ downloading


def fetch(ref: RepoRef, *, download: bool = True, progress: bool = True) -> Path:
    """The local path of `ref`'s model, downloading what is missing from the cache.

    `download=False` only looks in the cache (`minerva show`); so does HF_HUB_OFFLINE=1."""
    if offline():
        return _from_cache(ref, "HF_HUB_OFFLINE is set; unset it to download")
    if not download:
        return _from_cache(ref, f"is not downloaded here; run `minerva pull {ref}`")
    from huggingface_hub import HfApi
    api = HfApi(endpoint=_endpoint())
    try:
        info = api.model_info(ref.repo_id, files_metadata=True)
    except Exception as exc:
        if _network_error(exc):
            return _from_cache(ref, f"the Hub at {_endpoint()} cannot be reached ({_first_line(exc)}); "
                               "check the network, HF_ENDPOINT and proxy settings")
        raise _hub_error(ref, exc) from None
    files = {s.rfilename: s for s in info.siblings or []}
    chosen = pick_files(ref, list(files))
    snapshot, fresh = _download(ref, info.sha, chosen, progress)
    for name in fresh:
        lfs = files[name].lfs
        if lfs is not None:
            _verify(ref, snapshot / name, lfs.sha256)
    return model_path(snapshot, chosen)


def _download(ref: RepoRef, commit: str, files: list[str], progress: bool) -> tuple[Path, list[str]]:
    """Download what of `files` the cache lacks at `commit` (the main branch's, just asked),
    each with its own progress bar; returns the snapshot folder and the files new in it."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    snapshot = repo_folder(ref.repo_id) / "snapshots" / commit
    missing = [f for f in files if not (snapshot / f).is_file()]
    if missing and not progress:
        disable_progress_bars()
    try:
        for name in missing:
            got = Path(hf_hub_download(ref.repo_id, name, cache_dir=cache_dir(), endpoint=_endpoint()))
            snapshot = got.parents[len(Path(name).parts) - 1]
    except Exception as exc:
        raise _hub_error(ref, exc) from None
    finally:
        if missing and not progress:
            enable_progress_bars()
    lacking = [f for f in files if not (snapshot / f).is_file()]
    if lacking:
        raise MinervaError(f"'{ref}': {lacking[0]} did not arrive from {_endpoint()}; run the command again")
    return snapshot, missing


def _verify(ref: RepoRef, path: Path, sha256: str) -> None:
    """A file just downloaded, against the sha256 the Hub lists for it; a mismatch deletes it
    (its cache blob too), so the next try downloads it again."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    if h.hexdigest() != sha256:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise MinervaError(f"'{ref}': {path.name} arrived with sha256 {h.hexdigest()}, but the Hub lists "
                           f"{sha256}; the download was corrupted and is deleted; run the command again")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _network_error(exc: BaseException) -> bool:
    module = type(exc).__module__.split(".")[0]
    return (module in ("httpx", "httpx2", "httpcore", "requests", "urllib3") and "Status" not in type(exc).__name__) \
        or isinstance(exc, (ConnectionError, TimeoutError))


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
                            "check the network and run the command again (a partial download resumes)")
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "an error")
        return MinervaError(f"the Hub at {where} answered {status} for '{ref}': {_first_line(exc)}")
    if isinstance(exc, OSError):
        return MinervaError(f"could not download '{ref}': {_first_line(exc)}; run the command again")
    return MinervaError(f"could not download '{ref}' from {where}: {type(exc).__name__}: {_first_line(exc)}")


# ------------------------------------------------------------------ list and remove


def cached_models() -> list[tuple[str, Path, int]]:
    """(name to give, path the loader takes, bytes) of every model in the cache: one per quant
    of a GGUF repo, one per SafeTensors repo."""
    out = []
    root = cache_dir()
    for folder in sorted(root.glob("models--*--*")) if root.is_dir() else []:
        repo_id = folder.name.removeprefix("models--").replace("--", "/", 1)
        found = cached_snapshot(repo_id)
        if found is None:
            continue
        snap, files = found
        choices = gguf_choices(files)
        if choices:
            for tag, names in choices.items():
                name = f"{repo_id}:{tag}" if len(choices) > 1 or quant_tag(names[0]) else repo_id
                out.append((name, snap / names[0], sum((snap / n).stat().st_size for n in names)))
            continue
        try:
            chosen = pick_files(RepoRef(repo_id), files)
        except MinervaError:
            continue
        out.append((repo_id, snap, sum((snap / n).stat().st_size for n in chosen)))
    return out


def remove(ref: RepoRef) -> Path:
    """Delete a repo from the cache (with `:QUANT`, only that quant's files); returns what was removed."""
    folder = repo_folder(ref.repo_id)
    if not folder.is_dir():
        raise MinervaError(f"'{ref.repo_id}' is not in the Hugging Face cache ({cache_dir()}); "
                           "`minerva list` shows what is")
    if ref.quant is None:
        shutil.rmtree(folder)
        return folder
    snapshots = [p for p in (folder / "snapshots").iterdir() if p.is_dir()]
    links = []
    for snap in snapshots:
        files = sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file())
        if ref.quant.upper() in gguf_choices(files):
            links += [snap / n for n in pick_gguf(ref, files)]
    if not links:
        have = sorted({t for s in snapshots for t in gguf_choices(
            [str(p.relative_to(s)) for p in s.rglob("*") if p.is_file()])})
        raise MinervaError(f"the cached '{ref.repo_id}' has no {ref.quant.upper()} file (cached: "
                           f"{', '.join(have) or 'none'}); `minerva rm {ref.repo_id}` removes the whole repo")
    blobs = {link.resolve() for link in links}
    for link in links:
        link.unlink()
    still = {p.resolve() for s in snapshots for p in s.rglob("*") if p.is_file()}
    for blob in blobs - still:
        if blob.parent.name == "blobs":
            blob.unlink(missing_ok=True)
    return folder
