"""Sampler filters against transformers' logits processors (the independent reference)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from minerva import SamplingParams
from minerva.engine.sampler import new_state, sample
from minerva.errors import MinervaError

V = 50


def support(params: SamplingParams, logits: torch.Tensor) -> set[int]:
    """Tokens our sampler can emit: many seeded draws (the support is tiny so this is exhaustive)."""
    state = new_state(params, [], torch.device("cpu"))
    return {sample(logits, state) for _ in range(400)}


def reference_support(logits: torch.Tensor, *warpers) -> set[int]:
    scores = logits[None].clone()
    for w in warpers:
        scores = w(torch.zeros(1, 1, dtype=torch.long), scores)
    return set(torch.nonzero(torch.isfinite(scores[0])).flatten().tolist())


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(V, generator=g) * 3
    x[:5] += torch.tensor([6.0, 5.5, 5.0, 4.0, 3.0])  # a few clear favourites keep supports small
    return x


def test_top_k(logits):
    p = SamplingParams(temperature=1.0, top_k=3)
    assert support(p, logits) <= reference_support(logits, TopKLogitsWarper(3))
    assert len(reference_support(logits, TopKLogitsWarper(3))) == 3


def test_top_p(logits):
    p = SamplingParams(temperature=0.7, top_p=0.6)
    ref = reference_support(logits, TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.6))
    ours = support(p, logits)
    assert ours <= ref and len(ours) == len(ref)


def test_min_p(logits):
    p = SamplingParams(temperature=1.0, min_p=0.2)
    ref = reference_support(logits, MinPLogitsWarper(0.2))
    ours = support(p, logits)
    assert ours <= ref and len(ours) == len(ref)


def test_repetition_penalty_matches_transformers(logits):
    seen = [0, 3, 7, 7, 12]
    proc = RepetitionPenaltyLogitsProcessor(1.3)
    ref = proc(torch.tensor([seen]), logits[None].clone())[0]
    # with temperature 0 the sampler takes the argmax of the penalized logits
    state = new_state(SamplingParams(temperature=0, repetition_penalty=1.3), seen, torch.device("cpu"))
    assert sample(logits, state) == int(ref.argmax())
    strong = new_state(SamplingParams(temperature=0, repetition_penalty=50.0), [int(logits.argmax())],
                       torch.device("cpu"))
    assert sample(logits, strong) != int(logits.argmax())


def test_greedy_is_argmax(logits):
    assert sample(logits, new_state(SamplingParams(temperature=0), [], torch.device("cpu"))) == int(logits.argmax())


def test_sampling_follows_softmax():
    """Frequencies of 20k draws match softmax(logits / T) (chi-square, 5 categories)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    T = 0.8
    state = new_state(SamplingParams(temperature=T, seed=3), [], torch.device("cpu"))
    n = 20000
    counts = torch.bincount(torch.tensor([sample(logits, state) for _ in range(n)]), minlength=5).double()
    expected = torch.softmax(logits / T, -1).double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47  # p = 0.001 at 4 degrees of freedom


def test_same_seed_same_draws(logits):
    a = new_state(SamplingParams(seed=42), [], torch.device("cpu"))
    b = new_state(SamplingParams(seed=42), [], torch.device("cpu"))
    assert [sample(logits, a) for _ in range(20)] == [sample(logits, b) for _ in range(20)]


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=math.nan), dict(top_p=0.0),
                                    dict(top_k=-1), dict(min_p=1.5), dict(max_tokens=0),
                                    dict(repetition_penalty=0.0), dict(stop=[""]), dict(seed="x"),
                                    dict(stop_token_ids=[-1])])
def test_invalid_params(kwargs):
    with pytest.raises(MinervaError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
