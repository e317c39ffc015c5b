"""The memory check before a load: the weights' bytes read from the header, against what the
loader then holds, and a model or KV pool that cannot fit refused with the numbers."""

from __future__ import annotations

import json
import subprocess
import sys

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


PEAK = r"""
import json, sys
from minerva import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=int(sys.argv[2]) + 16, max_num_seqs=1, kv_cache_memory=0.9)
ids = [100 + (i * 7919) % 20000 for i in range(int(sys.argv[2]))]
llm.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"estimate": llm.memory.peak, "measured": peak, "kv": llm.memory.kv}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("model", ["smollm2_gguf", "gemma3_gguf"])
def test_the_memory_estimate_is_within_ten_percent_of_the_measured_peak(model, request):
    """Each model in a fresh process, its KV pool filled by one long prompt read in the
    largest steps: the process's peak resident memory against `LLM.memory.peak`."""
    path = request.getfixturevalue(model)
    out = subprocess.run([sys.executable, "-c", PEAK, str(path), "2040"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["kv"] > 0
    assert abs(r["estimate"] / r["measured"] - 1) < 0.10, r


def test_the_estimate_adds_up_its_parts(smollm2_gguf):
    llm = LLM(str(smollm2_gguf), kv_cache_memory=4e6, max_num_batched_tokens=512)
    e = llm.memory
    assert e.weights == fit.weight_bytes(smollm2_gguf, llm.dtype)
    assert e.kv == llm.engine.cache.nbytes and 3e6 < e.kv <= 4e6
    assert e.step == 4 * 512 * (4 * 576 + 3 * 1536)  # SmolLM2: hidden 576, intermediate 1536
    entries = (49152 * 2 + 48900) * fit.VOCAB_ENTRY  # tokens, types, merges (and a few short arrays)
    assert entries <= e.vocab < entries + 16 * fit.VOCAB_ENTRY
    assert e.peak == e.base + e.weights + e.vocab + max(e.load, e.kv + e.step)
    assert "weights 97 MB" in e.describe()


def test_an_asked_context_gets_one_request_of_pool_or_a_refusal(smollm2_gguf, monkeypatch):
    """--max-model-len: the fraction's pool grows to one whole request when memory allows (with
    a tenth to spare), else the load is refused with the longest context that fits."""
    per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2 in float32: 30 layers, K and V, 3 KV heads of 64
    monkeypatch.setattr(engine, "available_memory", lambda device: 400_000_000)
    llm = LLM(str(smollm2_gguf), dtype="float32", kv_cache_memory=0.01, max_model_len=4096, max_num_seqs=1)
    assert llm.engine.max_model_len == 4096  # 1% of 400 MB holds ~170 tokens; one request of 4096 fits in 90%
    assert abs(llm.engine.cache.nbytes - 4096 * per_token) <= 16 * per_token
    small = LLM(str(smollm2_gguf), dtype="float32", kv_cache_memory=0.01, max_num_seqs=1)
    assert small.engine.max_model_len < 4096  # no context asked: the fraction's pool, and requests up to it
    monkeypatch.setattr(engine, "available_memory", lambda device: 150_000_000)
    with pytest.raises(MinervaError, match=r"--max-model-len 8192 needs 0.38 GB of KV cache for one request, and "
                                           r"0.\d\d GB of memory is available on cpu beside the weights; give "
                                           r"--max-model-len \d+ or less"):
        LLM(str(smollm2_gguf), dtype="float32", kv_cache_memory=0.2, max_model_len=8192)


def test_the_default_kv_pool_is_sized_to_fit(smollm2_gguf, monkeypatch):
    """Without --kv-cache-memory the pool takes FIT of the memory beside the weights and a
    step's activations, at most what max_num_seqs whole-context requests can fill; the
    cached blocks kept are --prefix-cache-memory, at most a quarter of the pool."""
    room = 3_000_000_000
    monkeypatch.setattr(engine, "available_memory", lambda device: room)
    llm = LLM(str(smollm2_gguf), max_num_seqs=64)
    cache, blocks = llm.engine.cache, llm.engine.blocks
    per_block = cache.nbytes // cache.num_blocks
    mc, config = llm.engine.model.config, llm.engine.config
    step = fit.step_bytes(mc, config.max_num_batched_tokens)
    assert cache.num_blocks == int(engine.FIT * (room - step) // per_block)  # 64 x 8,192 tokens would be 12 GB
    assert blocks._cache_cap == int(0.05 * room // per_block)
    small = LLM(str(smollm2_gguf), max_num_seqs=2, prefix_cache_memory=1e9)
    per_seq = -(-mc.max_position // config.block_size)
    assert small.engine.cache.num_blocks == 2 * per_seq  # two requests of the whole context
    assert small.engine.blocks._cache_cap == per_seq // 2  # a quarter of the pool
    assert LLM(str(smollm2_gguf), prefix_cache_memory=0).engine.blocks._cache_cap == 0
    with pytest.raises(MinervaError, match="--prefix-cache-memory must be >= 0"):
        LLM(str(smollm2_gguf), prefix_cache_memory=-1)
