"""The memory check before a load: the weights' bytes read from the header, against what the
loader then holds, and a model or KV pool that cannot fit refused with the numbers."""

from __future__ import annotations

import pytest
import torch

import minerva.engine.engine as engine
from minerva import LLM
from minerva.errors import MinervaError
from minerva.models import fit
from tests.helpers import tiny_hf


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gguf_weight_estimate_matches_the_load(smollm2_gguf, gemma3_gguf, dtype):
    for path in (smollm2_gguf, gemma3_gguf):
        llm = LLM(str(path), dtype=dtype, kv_cache_memory=4e6)
        estimate = fit.weight_bytes(path, getattr(torch, dtype))
        assert abs(estimate / llm.loaded.weight_bytes - 1) < 0.01, (path.name, estimate, llm.loaded.weight_bytes)


@pytest.mark.parametrize("dtype, quantize", [("float32", None), ("bfloat16", None), ("float32", "int8"),
                                             ("float32", "int4")])
def test_safetensors_weight_estimate_matches_the_load(tmp_path, dtype, quantize):
    path = tiny_hf.save(tmp_path, "llama-untied")
    llm = LLM(str(path), dtype=dtype, quantize=quantize, kv_cache_memory=4e6)
    estimate = fit.weight_bytes(path, getattr(torch, dtype), quantize)
    assert abs(estimate / llm.loaded.weight_bytes - 1) < 0.03, (estimate, llm.loaded.weight_bytes)


def test_a_model_that_cannot_fit_is_refused_before_loading(smollm2_gguf, monkeypatch, tmp_path):
    monkeypatch.setattr(fit, "available_memory", lambda device: 200_000_000)
    with pytest.raises(MinervaError, match=r"'SmolLM2-135M-Instruct.Q4_1.gguf' needs about 0.1 GB of memory for "
                                           r"its weights and 0.3 GB beside them, and 0.2 GB is available on cpu; "
                                           r"free memory, or use a smaller quant"):
        LLM(str(smollm2_gguf))
    path = tiny_hf.save(tmp_path, "llama-untied")
    monkeypatch.setattr(fit, "available_memory", lambda device: 1000)
    with pytest.raises(MinervaError, match=r"or use --quantize int4 \(or int8\)"):
        LLM(str(path))


def test_a_kv_pool_beyond_the_memory_available_is_refused(smollm2_gguf, monkeypatch):
    monkeypatch.setattr(engine, "available_memory", lambda device: 1_000_000_000)
    with pytest.raises(MinervaError, match=r"--kv-cache-memory 2.00 GB is more than the 1.00 GB of memory available"):
        LLM(str(smollm2_gguf), kv_cache_memory=2e9)
    LLM(str(smollm2_gguf), kv_cache_memory=0.5e9)  # less is fine
