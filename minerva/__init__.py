"""Minerva: LLM inference for GGUF and SafeTensors models."""

from importlib import import_module

from minerva.errors import MinervaError

# Loaded on first use (they import torch): `import minerva` and the `minerva` command's first
# moments stay light, so a Ctrl-C then ends it quietly (minerva/console.py).
_LAZY = {"LLM": "minerva.llm", "SamplingParams": "minerva.engine.sampler",
         "RequestOutput": "minerva.engine.request", "CompletionOutput": "minerva.engine.request"}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "MinervaError"]


def __getattr__(name: str):
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("minerva")
        except PackageNotFoundError:  # run from a source tree that was never installed
            value = "0.1.0+source"
    elif name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'minerva' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"__version__"})
