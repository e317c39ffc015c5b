"""Shared fixtures: the two real models, pulled once into the model store and loaded once, and a
tiny random GGUF model for the command-line and server tests."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # the Triton kernels' tests run on Triton's interpreter; triton's own library functions
    # take the mode in force when triton is first imported, so it is set before anything
    # (transformers included) imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from minerva.store import pull
from tests.helpers.hf import load_hf_reference
from tests.helpers.tiny_gguf import TINY_CONTEXT, write_tiny_llama

torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A 1-layer llama GGUF with random weights and a 257-token byte-level vocabulary."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", context=TINY_CONTEXT)


@pytest.fixture(scope="session")
def smollm2_gguf():
    return pull("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_gguf():
    return pull("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    from minerva import LLM

    # compared with transformers in fp32: float activations whatever `auto` picks here
    return LLM(str(smollm2_gguf), device="cpu", dtype="float32", activations="float")


@pytest.fixture(scope="session")
def gemma3_llm(gemma3_gguf):
    from minerva import LLM

    return LLM(str(gemma3_gguf), device="cpu", dtype="float32", activations="float")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    return load_hf_reference(smollm2_gguf)


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_gguf):
    return load_hf_reference(gemma3_gguf)


def pytest_sessionstart(session):
    """The kernels built and their choices planned (`minerva.kernels.tune`) once, before any
    test, so no test's subprocess pays for the plan within its own time limit."""
    from minerva.kernels import native, tune
    tune.ensure(native.load())
