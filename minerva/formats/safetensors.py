"""Hugging Face model directories: config.json plus one or many *.safetensors files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from minerva.errors import MinervaError

SUPPORTED_DTYPES = {torch.float32, torch.float16, torch.bfloat16}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def pickle_refusal(path: Path) -> MinervaError:
    return MinervaError(f"'{path}' holds pickle checkpoints (.bin/.pt), which Minerva refuses because "
                        "loading a pickle can run arbitrary code; convert the model to safetensors")


def is_adapter_dir(path: Path) -> bool:
    """Whether a folder is a PEFT adapter (its config, no model config), not a model."""
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def checkpoint_files(path: Path) -> list[Path]:
    """The *.safetensors files of a Hugging Face directory, with a clear error for anything else."""
    if is_adapter_dir(path):
        raise MinervaError(f"'{path}' is a LoRA adapter, not a model: serve it on its base model with "
                           "--lora NAME=PATH_OR_REPO")
    if not (path / "config.json").is_file():
        raise MinervaError(f"directory '{path}' has no config.json; a Hugging Face model directory "
                           "needs config.json and *.safetensors weights")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = _read_json(index)["weight_map"]
            shards = {Path(f) for f in weight_map.values()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise MinervaError(f"'{index}' has no valid weight_map ({type(exc).__name__}: {exc}); "
                               "re-download the checkpoint") from None
        for shard in shards:
            if shard.is_absolute() or ".." in shard.parts:
                raise MinervaError(f"'{index}' names the shard '{shard}' outside the model directory; "
                                   "re-download the checkpoint")
        return sorted(path / shard for shard in shards)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(p.suffix.lower() in PICKLE_SUFFIXES for p in path.iterdir()):
            raise pickle_refusal(path)
        raise MinervaError(f"directory '{path}' has config.json but no *.safetensors weights")
    return files


def _read_json(path: Path) -> Any:
    """A JSON file's value; unreadable, malformed or absurdly nested JSON is one clean error."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError, bad UTF-8, an int over 4300 digits
        raise MinervaError(f"cannot read '{path}': {exc}".replace("\n", " ")) from None
    except RecursionError:
        raise MinervaError(f"cannot read '{path}': its JSON is nested too deeply to be a real "
                           "model file; re-download it") from None


class SafeTensorsDir:
    """Tensors of a single-file or sharded (model.safetensors.index.json) checkpoint."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        files = checkpoint_files(self.path)
        self.config: dict[str, Any] = _read_json(self.path / "config.json")
        if not isinstance(self.config, dict):
            raise MinervaError(f"'{self.path / 'config.json'}' is not a JSON object")
        self._where: dict[str, Any] = {}
        self._handles = []
        first: dict[str, Path] = {}
        for file in files:
            if not file.is_file():
                raise MinervaError(f"shard '{file}' named in the index does not exist" if (
                    self.path / "model.safetensors.index.json").is_file() else f"'{file}' is not a file")
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types on bad headers
                raise MinervaError(f"'{file}' is not a readable safetensors file ({exc}); "
                                   "it may be truncated or corrupt") from None
            self._handles.append(handle)
            for name in handle.keys():
                if name in first:  # which copy would be the model's?
                    raise MinervaError(f"tensor '{name}' is in both '{first[name].name}' and '{file.name}' of "
                                       f"'{self.path}'; a checkpoint holds each tensor once: remove the stray file")
                self._where[name], first[name] = handle, file

    def tensor_names(self) -> list[str]:
        return list(self._where)

    def dtype_and_shape(self, name: str) -> tuple[str, list[int]]:
        """A tensor's stored dtype ("F16", "BF16", ...) and shape, from the file's header alone."""
        info = self._where[name].get_slice(name)
        return info.get_dtype(), info.get_shape()

    def tensor(self, name: str, packed: bool = False) -> torch.Tensor:
        """The tensor `name`: a float one, or with `packed` a uint8 one (quantized blocks)."""
        try:
            t = self._where[name].get_tensor(name)
        except Exception as exc:
            raise MinervaError(f"'{self.path}': cannot read tensor '{name}' ({exc}); "
                               "the file may be truncated") from None
        if packed:
            if t.dtype != torch.uint8:
                raise MinervaError(f"'{self.path}': tensor '{name}' has dtype {t.dtype}; "
                                   "packed blocks are uint8")
        elif t.dtype not in SUPPORTED_DTYPES:
            raise MinervaError(f"'{self.path}': tensor '{name}' has dtype {t.dtype}; "
                               "supported are float32, float16 and bfloat16")
        return t
