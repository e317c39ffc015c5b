"""Minerva: LLM inference for GGUF and SafeTensors models."""

from minerva.engine.request import CompletionOutput, RequestOutput
from minerva.engine.sampler import SamplingParams
from minerva.errors import MinervaError
from minerva.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "MinervaError"]
