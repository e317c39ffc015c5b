"""What Ollama's /api/tags, /api/ps and /api/show say of a model, read from its file without
loading it: size, time, family, parameters, quantization, context."""

from __future__ import annotations

import hashlib
import math
from datetime import datetime, timezone
from pathlib import Path

from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile


def shown(card: dict, info: dict, parameters: str, trained: int | None) -> dict:
    """/api/show's answer for a model's card, its /api/tags entry, its sampling `parameters` and the
    context it was `trained` for (the served one, max_model_len, once it is loaded)."""
    context, family = card.get("max_model_len") or trained, info["details"]["family"]  # model_info's keys by family
    by_family = {f"{family}.context_length": context} if family else {}  # (a folder's family is not read)
    return {"details": info["details"], "modified_at": info["modified_at"], "template": "", "parameters": parameters,
            "model_info": {"general.architecture": family, **by_family, "context_length": context},
            "capabilities": ["completion", "tools"]}


_DETAILS: dict[tuple, dict] = {}


def details(card: dict) -> dict:
    """What /api/tags and /api/ps say of a model: its size on disk, modification time, an
    identifier (a hash of its path, size and time: not the file's sha256, which would mean
    reading it) and its family, parameters and quantization from the header."""
    root = Path(card["root"])
    try:
        files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
        stats = [f.stat() for f in files]
    except OSError:
        stats = []
    size, mtime = sum(s.st_size for s in stats), max((s.st_mtime for s in stats), default=0.0)
    key = (str(root), size, mtime)
    if key not in _DETAILS:
        _DETAILS[key] = {"format": "safetensors" if root.is_dir() else "gguf", "family": "", "families": [],
                         "parameter_size": "", "quantization_level": "", "parent_model": card.get("parent") or ""}
        _DETAILS[key].update(header(root))
    return {"name": f"{card['id']}:latest", "model": f"{card['id']}:latest", "size": size,
            "modified_at": datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z"),
            "digest": hashlib.sha256(repr(key).encode()).hexdigest(), "details": _DETAILS[key]}


def header(root: Path) -> dict:
    """Family, parameter count and quantization read from a GGUF header (nothing for a folder)."""
    if root.is_dir() or not root.is_file():
        return {}
    try:
        f = GGUFFile(root)
    except (MinervaError, OSError):
        return {}
    params = sum(math.prod(t.shape) for t in f.tensors.values())
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    return {"family": f.architecture, "families": [f.architecture], "parameter_size": size,
            "quantization_level": f.file_type_name}
