"""What a Hugging Face model name means, and which of a repo's files make its model.

`OWNER/REPO[:QUANT]` or `hf.co/OWNER/REPO[:QUANT]` (`parse`); from a repo's file list, the
GGUF file(s) of one quant (`pick_gguf`: the tag asked for, else the first of `PREFERENCE`),
a SafeTensors model's files, or a LoRA adapter's (`pick_files`). minerva/hub.py downloads
them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from minerva.errors import MinervaError
from minerva.formats.gguf import split_parts

log = logging.getLogger("minerva")

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
