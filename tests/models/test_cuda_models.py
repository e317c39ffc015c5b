"""Both real models on a GPU through the Triton backend (`--device cuda --kernels triton`),
against the CPU float32 reference path on the same file: logits within 1e-3 of the largest,
the same greedy ids, and a batch equal to each request alone. They skip without a CUDA GPU;
benchmarks/gpu_check.py runs the same checks on a GPU machine that cannot pull the models."""

from __future__ import annotations

import pytest
import torch

from minerva import LLM, SamplingParams
from tests.helpers.paged import paged_logits

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the Triton backend's "
                                 "whole-model checks run on one (benchmarks/gpu_check.py)")]

PROMPTS = ["Why is the sky blue?", "Write a haiku about the sea.", "What is 17 times 23?"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def load(path, device, kernels, dtype="float32"):
    return LLM(str(path), device=device, kernels=kernels, dtype=dtype, activations="float", kv_cache_memory=256 << 20)


def prompt_ids(llm):
    return [llm.encode_prompt(llm.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]


def ids(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(params=["smollm2_gguf", "gemma3_gguf"])
def model(request):
    return request.getfixturevalue(request.param)


def test_cuda_logits_and_greedy_ids_match_the_cpu_reference(model):
    ref = load(model, "cpu", "reference")
    prompts = prompt_ids(ref)
    seq = [i for p in prompts for i in p][:96]
    want_logits, want_ids = paged_logits(ref.engine.model, seq, chunk=40), [ids(ref, [p])[0] for p in prompts]
    gpu = load(model, "cuda", "triton")
    assert gpu.kernels == "triton"
    got = paged_logits(gpu.engine.model, seq, chunk=40, device="cuda").cpu()
    assert (got - want_logits).abs().max() <= 1e-3 * want_logits.abs().max()
    assert [ids(gpu, [p])[0] for p in prompts] == want_ids


def test_cuda_batched_equals_alone(model):
    gpu = load(model, "cuda", "triton", dtype="bfloat16")
    prompts = prompt_ids(gpu) * 2
    assert ids(gpu, prompts) == [ids(gpu, [p])[0] for p in prompts]
