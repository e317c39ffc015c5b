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
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from minerva.errors import MinervaError
from minerva.formats.gguf import split_parts

log = logging.getLogger("minerva")
warnings.filterwarnings("ignore", message="Not enough free disk space", category=UserWarning)  # (see _room_for)

PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/")
# Without `:QUANT`, the first of these the repo has (the 4-bit mixes most people run first,
# then more bits, then fewer, then the float files); else the first tag in sorted order.
PREFERENCE = ("Q4_K_M", "Q4_K_S", "Q4_0", "MXFP4", "Q4_1", "Q4", "Q5_K_M", "Q5_K_S", "Q5_0", "Q5_1", "Q6_K",
              "Q8_0", "Q8", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "BF16", "F16", "F32")
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_QUANT = re.compile(r"[A-Za-z0-9_.-]{1,200}")  # a quant tag, or a file's name
# llama.cpp's quant names (Q4_K_M, IQ2_XXS, Q4_0_4_8, ...), unsloth's and bartowski's variants
# (Q4_K_XL, Q6_K_L), the float types, MXFP4; FP16/FP32 as some repos spell F16/F32
_TAG = re.compile(r"(?<![A-Za-z0-9])(I?Q[1-8](?:_(?:[0-9]|K|S|M|L|XL|XXL|XS|XXS|NL))*|BF16|FP?16|FP?32|"
                  r"MXFP4(?:_MOE)?|TQ[12]_0)(?![A-Za-z0-9])", re.IGNORECASE)
# What a SafeTensors model directory needs: config, tokenizer, chat template, weights.
_HF_FILES = re.compile(r"[^/]+\.(json|safetensors|jinja|tiktoken)|tokenizer\.model|merges\.txt|vocab\.txt")
_CHUNK = 1 << 20
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}


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
    repo, colon, quant = rest.partition(":")
    repo = repo.strip("/") if prefix else repo
    at = name.rfind("@")
    if at > 0 and _REPO.fullmatch(name[len(prefix or ""):at].partition(":")[0].strip("/")) and \
            not Path(name).expanduser().exists() and not lowered.endswith((".gguf", ".safetensors")):
        plain, _, tag = name[:at].partition(":")
        tag = tag or name[at + 1:].partition(":")[2]  # (OWNER/REPO:QUANT@REV or OWNER/REPO@REV:QUANT)
        raise MinervaError(f"'{name}' names a revision (@...), which Minerva does not fetch: it downloads a "
                           f"repo's main branch; write {plain}{':' + tag if tag else ''} "
                           "(no file or folder of that name exists here either)")
    if colon and not quant and _REPO.fullmatch(repo):  # `OWNER/REPO:` (an unset $QUANT?): not the default quant
        raise MinervaError(f"'{name}' ends in ':' without a quantization; write {repo}:QUANT (e.g. :Q4_K_M), or "
                           f"{repo} alone for its default file")
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
            tag = tags[-1].upper()
            return {"FP16": "F16", "FP32": "F32"}.get(tag, tag)
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


def _incomplete_splits(ref: RepoRef, files: list[str], where: str) -> None:
    """Refuse a repo whose only GGUF models (of the quant asked for) are split ones missing a part."""
    present = set(files)
    for f in sorted(files):
        parts = split_parts(Path(f)) if f.lower().endswith(".gguf") else None
        if parts is None or str(parts[0]) != f and str(parts[0]) in present:
            continue  # (a split model is named once, by its first part present)
        if ref.quant and (quant_tag(f) or "").upper() != ref.quant.upper():
            continue
        lacking = [str(p) for p in parts if str(p) not in present]
        if lacking:
            stem = re.sub(r"-\d{5}-of-\d{5}\.gguf$", "", Path(f).name, flags=re.IGNORECASE)
            raise MinervaError(f"'{ref.repo_id}'{where} holds {stem} split in {len(parts)} "
                               f"parts and lacks {', '.join(lacking)}; the model cannot load without every part")


def pick_gguf(ref: RepoRef, files: list[str], where: str = "") -> list[str]:
    """The file(s) of the quant `ref` asks for, else of the preferred one the repo has."""
    choices = gguf_choices(files)
    if not choices or ref.quant and not any(ref.quant.upper() in (t.upper(), n[0].upper()) for t, n in choices.items()):
        _incomplete_splits(ref, files, where)
    if ref.quant:
        want = ref.quant.upper()
        want = {"FP16": "F16", "FP32": "F32"}.get(want, want)
        for tag, names in choices.items():
            if want in (tag.upper(), names[0].upper(), names[0].rsplit("/", 1)[-1].upper()):
                return names
        for f in sorted(files):  # a file by its name, where another of its quant is the default
            if f.lower().endswith(".gguf") and want in (f.upper(), f.rsplit("/", 1)[-1].upper()):
                parts = split_parts(Path(f))
                if parts is None or (str(parts[0]) == f and set(map(str, parts)) <= set(files)):
                    return [str(p) for p in parts] if parts else [f]
        have = ", ".join(sorted(choices)) or "none"
        raise MinervaError(f"'{ref.repo_id}'{where} has no {ref.quant.upper()} file; its quants: {have}; "
                           f"name one as {ref.repo_id}:QUANT")
    for tag in PREFERENCE:
        if tag in choices:
            return _said(ref, files, choices[tag])
    if choices:  # a tag outside the list before a file without one
        return _said(ref, files, choices[min(choices, key=lambda k: (k.lower().endswith(".gguf"), k))])
    raise MinervaError(f"'{ref.repo_id}' has no GGUF file")


def _said(ref: RepoRef, files: list[str], names: list[str]) -> list[str]:
    """`names`, the model chosen without a quant asked for, after a line naming the others it
    was chosen among where they look alike (the same quant tag, or none)."""
    tag = quant_tag(names[0])
    alike = [f for f in sorted(files) if f.lower().endswith(".gguf") and "mmproj" not in f.lower()
             and f not in names and quant_tag(f) == tag
             and (split_parts(Path(f)) is None or str(split_parts(Path(f))[0]) == f)]
    if alike:
        log.warning("%s: %s chosen; %s alike (name one as %s:FILENAME)", ref.repo_id, names[0], ", ".join(alike),
                    ref.repo_id)
    return names


def pick_files(ref: RepoRef, files: list[str], where: str = "") -> list[str]:
    """What to download for `ref`: one GGUF model's file(s), or a SafeTensors model's files
    (`where` says where the files are, for the errors)."""
    if ref.quant or gguf_choices(files):
        return pick_gguf(ref, files, where)
    top = [f for f in files if "/" not in f]
    if ADAPTER_FILES <= set(top) and "config.json" not in top:  # a LoRA adapter (PEFT's files)
        return sorted(ADAPTER_FILES)
    if "config.json" in top and any(f.endswith(".safetensors") for f in top):
        chosen = [f for f in top if _HF_FILES.fullmatch(f)]
        if any(f.startswith("model") and f.endswith(".safetensors") for f in chosen):
            chosen = [f for f in chosen if not f.startswith("consolidated")]  # Mistral's second copy
        return chosen
    _incomplete_splits(ref, files, where)
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
    each with its own progress bar and checked as it arrives; returns the snapshot folder."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    snapshot = repo_folder(ref.repo_id) / "snapshots" / commit
    missing = [f for f in files if not (snapshot / f).is_file()]
    if missing and not progress:
        disable_progress_bars()
    try:
        for name in files:
            if name in missing:
                _room_for(name, listed[name])
                try:
                    hf_hub_download(ref.repo_id, name, revision=commit, cache_dir=cache_dir(), endpoint=_endpoint())
                except Exception as exc:
                    raise _hub_error(ref, exc) from None
                _drop_partials(snapshot / name)
            if name in missing or verify:
                _verify(ref, snapshot / name, listed[name])
    finally:
        if missing and not progress:
            enable_progress_bars()
    try:  # what huggingface_hub writes when it resolves `main` itself: the offline lookup reads it
        (repo_folder(ref.repo_id) / "refs").mkdir(parents=True, exist_ok=True)
        (repo_folder(ref.repo_id) / "refs" / "main").write_text(commit)
    except OSError:
        pass
    return snapshot


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


def _verify(ref: RepoRef, path: Path, listed) -> None:
    """A file against the checksum the Hub lists for it (an LFS file's sha256, else its git
    blob id); a mismatch deletes it (its cache blob too), so the next try downloads it again,
    and so does an interrupted check."""
    if listed.lfs is not None:
        h, want, kind = hashlib.sha256(), listed.lfs.sha256, "sha256"
    elif listed.blob_id:
        h, want, kind = hashlib.sha1(), listed.blob_id, "git blob id"
        h.update(b"blob %d\0" % path.stat().st_size)
    else:
        return
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except BaseException:
        _delete(path)
        raise
    if h.hexdigest() != want:
        _delete(path)
        raise MinervaError(f"'{ref}': {path.name} has {kind} {h.hexdigest()}, but the Hub lists "
                           f"{want}; the file was corrupted and is deleted; run the command again")


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
    return links[0]
