"""Minerva: LLM inference for GGUF and SafeTensors models."""

from importlib.metadata import PackageNotFoundError, version

from minerva.engine.request import CompletionOutput, RequestOutput
from minerva.engine.sampler import SamplingParams
from minerva.errors import MinervaError
from minerva.llm import LLM

try:
    __version__ = version("minerva")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.1.0+source"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "MinervaError"]
