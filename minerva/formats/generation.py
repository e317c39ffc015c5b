"""A model's own sampling defaults: the temperature, top-k, top-p, min-p and repetition penalty
its makers recommend, and the length of a reply, for requests that do not set them (as vLLM
and llama.cpp apply them).

They come from a Hugging Face directory's `generation_config.json` (the keys it writes, not
transformers' built-in defaults; `max_new_tokens` is the reply's length), or from a GGUF
file's `general.sampling.*` keys (llama.cpp's names; they hold no length). A value of the wrong kind or out of range is left out with a warning: the model still
loads, and requests fall back to the API's own default for it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import reprlib
from pathlib import Path
from typing import Any

from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile

log = logging.getLogger("minerva")

FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")  # the sampling fields
# generation_config.json's names and general.sampling.*'s, for each field (and max_tokens)
HF_NAMES = {**{name: name for name in FIELDS}, "max_tokens": "max_new_tokens"}
GGUF_NAMES = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
              "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p",
              "repetition_penalty": "general.sampling.penalty_repeat"}
CHOICES = "'auto' (the model's own), 'none' (the API's defaults) or a folder with a generation_config.json"


def _valid(name: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or abs(value) > 2**62 or not math.isfinite(value):
        return False  # (an integer past a float's range is refused before isfinite would overflow)
    if name == "top_k":
        return value == int(value) and 0 <= value < 2**31
    if name == "max_tokens":
        return value == int(value) and 1 <= value < 2**31
    if name == "temperature":
        return 0 <= value <= 2
    if name == "repetition_penalty":
        return 0 < value <= 100
    return 0 < value <= 1 if name == "top_p" else 0 <= value <= 1


def _pick(values: dict[str, Any], names: dict[str, str], where: str) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for field, key in names.items():
        if key not in values or values[key] is None:
            continue
        value = values[key]
        if not _valid(field, value):
            log.warning("%s: %s = %s is not a usable %s; requests that leave it out get the API's default",
                        where, key, reprlib.repr(value), field)
            continue
        out[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    if out.get("top_k") == 0:
        del out["top_k"]  # 0 is off, as it is already
    return out


def from_hf_dir(folder: Path) -> dict[str, float | int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        log.warning("%s: not readable JSON (%s); its sampling defaults are not used", path,
                    "nested too deep" if isinstance(exc, RecursionError) else exc)
        return {}
    if not isinstance(values, dict):
        kind = {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(type(values), "a number")
        log.warning("%s: holds %s, not a JSON object; its sampling defaults are not used", path, kind)
        return {}
    return _pick(values, HF_NAMES, str(path))


def from_gguf_metadata(metadata: dict[str, Any], where: str) -> dict[str, float | int]:
    return _pick(metadata, GGUF_NAMES, where)


def check_choice(choice: Any) -> None:
    """A one-line error for a `generation_config` that is none of the choices (before a load)."""
    if choice in ("auto", "none"):
        return
    if not isinstance(choice, (str, os.PathLike)) or not (Path(choice) / "generation_config.json").is_file():
        raise MinervaError(f"generation_config (--generation-config) must be {CHOICES}; got {str(choice)!r}")


def sampling_defaults(model_path: Path, choice: str | os.PathLike = "auto", announce: bool = False,
                      metadata: dict[str, Any] | None = None) -> dict[str, float | int]:
    """The sampling defaults a model's requests start from: its own (`choice` "auto"), none
    ("none"), or those of another folder's generation_config.json; logged with `announce`. A
    GGUF model's header `metadata`, where it is read already, spares reading it again."""
    check_choice(choice)
    if choice == "none":
        defaults = {}
    elif choice != "auto":
        defaults = from_hf_dir(Path(choice))
    elif model_path.is_dir():
        defaults = from_hf_dir(model_path)
    else:
        defaults = from_gguf_metadata(metadata if metadata is not None else GGUFFile(model_path).metadata,
                                      str(model_path))
    if announce and defaults:
        log.info("sampling defaults of the model's generation config (for requests that leave them out): %s",
                 describe(defaults))
    return defaults


def describe(defaults: dict[str, float | int]) -> str:
    return ", ".join(f"{name}={value_text(value)}" for name, value in defaults.items())


def value_text(value: float | int) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
