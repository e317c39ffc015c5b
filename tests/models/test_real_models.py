"""Real GGUF models against HF transformers loading the same file (dequantized, fp32)."""

from __future__ import annotations

import pytest
import torch

from minerva import SamplingParams
from minerva.engine.perplexity import perplexity
from tests.helpers.hf import hf_greedy, hf_perplexity
from tests.helpers.paged import paged_logits

pytestmark = pytest.mark.slow

MODELS = ["smollm2", "gemma3"]
TEXT = (
    "The history of astronomy is long. Ancient peoples watched the sky to keep calendars, "
    "predict floods and navigate the seas. Later, telescopes revealed moons around Jupiter, "
    "the phases of Venus and countless stars invisible to the naked eye. "
)


@pytest.fixture(params=MODELS)
def pair(request):
    name = request.param
    return request.getfixturevalue(f"{name}_llm"), request.getfixturevalue(f"{name}_hf")


def minerva_logits(llm, ids: list[int]) -> torch.Tensor:
    """Through the paged KV cache in chunks of 256: a prompt the engine prefills in pieces."""
    return paged_logits(llm.loaded.model, ids, chunk=256, dtype=llm.dtype, device=llm.device)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("length", [1, 17, 200, 700])  # 700 > Gemma 3's 512-token sliding window
def test_logits_match_transformers(pair, length):
    llm, hf = pair
    ids = llm.tokenizer.encode((TEXT * 20))[:length]
    assert len(ids) == length
    mine, ref = minerva_logits(llm, ids), hf_logits(hf, ids)
    scale = ref.abs().max().item()
    assert (mine - ref).abs().max().item() <= 1e-4 * scale, "logits differ beyond fp32 rounding"
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_matches_transformers(pair, prompt):
    llm, hf = pair
    ids = llm.tokenizer.encode(prompt)
    out = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, ids, 32)
    assert out.finish_reason == "length"


def test_perplexity_matches_transformers(pair):
    llm, hf = pair
    ids = llm.tokenizer.encode(TEXT * 6)
    context, stride = 256, 128
    ours = perplexity(llm.loaded.model, ids, context=context, stride=stride, device=llm.device,
                      dtype=llm.dtype)
    ref = hf_perplexity(hf, ids, context, stride)
    assert abs(ours.perplexity - ref) / ref < 0.005
    assert ours.windows > 1
