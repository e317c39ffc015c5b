"""What several of the server's test modules share."""

from __future__ import annotations

import pytest

from minerva import LLM
from tests.helpers.server import running_server

API_KEY = "sk-test"


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    """SmolLM2 served as 'smollm2' with the API key API_KEY (float32 and float activations:
    the same greedy replies on every CPU); each module that asks gets a server of its own."""
    llm = LLM(str(smollm2_gguf), device="cpu", dtype="float32", activations="float", kv_cache_memory=64e6)
    with running_server(llm, served_model_name="smollm2", api_key=API_KEY) as (url, _):
        yield url
