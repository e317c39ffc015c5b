"""Sampler filters against transformers' logits processors (the independent reference)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from minerva import SamplingParams
from minerva.engine.sampler import (invert_cdf, invert_cdf_torch, new_state, process_batch, process_logits, sample,
                                   sample_batch, token_logprobs)
from minerva.errors import MinervaError
from minerva.kernels import native

V = 50


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(V, generator=g) * 3
    x[:5] += torch.tensor([6.0, 5.5, 5.0, 4.0, 3.0])  # a few clear favourites keep supports small
    return x


def hf_chain(logits: torch.Tensor, seen: list[int], p: SamplingParams) -> torch.Tensor:
    """transformers' processors in the order its generate() applies them."""
    chain = []
    if p.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    chain.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k:
        chain.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        chain.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        chain.append(MinPLogitsWarper(p.min_p))
    scores, ids = logits[None].clone(), torch.tensor([seen or [0]])
    for proc in chain:
        scores = proc(ids, scores)
    return scores[0]


CASES = [
    dict(top_k=3),
    dict(top_k=10, temperature=0.7),
    dict(top_p=0.6, temperature=0.7),
    dict(top_p=0.95),
    dict(min_p=0.2),
    dict(min_p=0.05, temperature=1.3),
    dict(repetition_penalty=1.3, temperature=0.9),
    dict(top_k=20, top_p=0.8, min_p=0.1, temperature=0.6, repetition_penalty=1.2),
]


@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: ",".join(f"{a}={v}" for a, v in k.items()))
def test_processing_matches_transformers(logits, kwargs):
    seen = [0, 3, 7, 7, 12, 30, 41]  # includes strongly positive and negative logits
    assert (logits[seen] < 0).any() and (logits[seen] > 0).any()
    params = SamplingParams(**kwargs)
    ours = process_logits(logits, new_state(params, seen, torch.device("cpu")))
    ref = hf_chain(logits, seen if params.repetition_penalty != 1.0 else [], params)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    kept = torch.isfinite(ref)
    assert kept.sum() >= 1
    torch.testing.assert_close(ours[kept], ref[kept])


def test_one_batch_of_mixed_parameters_matches_transformers_row_by_row():
    """Every case in one [B, vocab] batch (plus a greedy row): each row equals its own reference."""
    g = torch.Generator().manual_seed(5)
    batch = torch.randn(len(CASES) + 1, V, generator=g) * 3
    seen = [0, 3, 7, 7, 12, 30, 41]
    params = [SamplingParams(**kw) for kw in CASES] + [SamplingParams(temperature=0, top_k=2)]
    ours = process_batch(batch, [new_state(p, seen, torch.device("cpu")) for p in params])
    for row, p in enumerate(params[:-1]):
        ref = hf_chain(batch[row], seen if p.repetition_penalty != 1.0 else [], p)
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(ref)), p
        kept = torch.isfinite(ref)
        torch.testing.assert_close(ours[row][kept], ref[kept])
    assert torch.equal(ours[-1], batch[-1])  # greedy rows are left untransformed


def test_a_seeded_row_draws_the_same_tokens_alone_or_in_any_batch():
    g = torch.Generator().manual_seed(9)
    steps = [torch.randn(6, V, generator=g) * 2 for _ in range(30)]
    mine = SamplingParams(seed=11, top_p=0.9, temperature=0.8, frequency_penalty=0.5)
    others = [SamplingParams(seed=s, top_k=5, presence_penalty=1.0) for s in range(4)] + [SamplingParams(temperature=0)]
    alone_state = new_state(mine, [1, 2], torch.device("cpu"))
    batch_states = [new_state(p, [3], torch.device("cpu")) for p in others]
    batch_states.insert(2, new_state(mine, [1, 2], torch.device("cpu")))
    alone, together = [], []
    for step in steps:
        t = sample_batch(step[2:3], [alone_state])[0]
        alone_state.record(t)
        alone.append(t)
        ts = sample_batch(step, batch_states)
        for s, tok in zip(batch_states, ts):
            s.record(tok)
        together.append(ts[2])
    assert alone == together and len(set(alone)) > 1


def test_batched_logprobs_match_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, V, generator=g)
    out = token_logprobs(logits, [4, 0, 9], [0, 3, 20])
    ref = torch.log_softmax(logits, -1)
    for row, (lp, k) in enumerate(zip(out, [0, 3, 20])):
        assert lp.logprob == pytest.approx(float(ref[row, lp.token_id]), abs=1e-6)
        assert [t for t, _ in lp.top] == torch.topk(ref[row], k).indices.tolist()


def test_top_logprobs_of_tied_tokens_do_not_depend_on_the_batch():
    """A row's top k is the same alone and beside a row that wants more: tied values in id
    order, and of the tokens tied at the k-th value the lowest ids."""
    row = torch.full((V,), -5.0)
    row[[40, 7, 49, 3]] = 2.0  # four tied at the top
    row[[45, 11, 30, 25, 48]] = 1.0  # five tied next: k = 6 cuts through them
    other = torch.randn(V, generator=torch.Generator().manual_seed(0))
    alone = token_logprobs(row[None], [3], [6])[0].top
    beside = token_logprobs(torch.stack([other, row]), [0, 3], [20, 6])[1].top
    assert alone == beside
    assert [t for t, _ in alone] == [3, 7, 40, 49, 11, 25]


def test_sampled_tokens_stay_in_the_kept_set(logits):
    params = SamplingParams(top_k=20, top_p=0.8, min_p=0.1, temperature=0.6, seed=0)
    kept = set(torch.nonzero(torch.isfinite(hf_chain(logits, [], params))).flatten().tolist())
    state = new_state(params, [], torch.device("cpu"))
    drawn = {sample(logits, state) for _ in range(300)}
    assert drawn <= kept and len(drawn) > 1


def test_repetition_penalty_changes_the_greedy_choice(logits):
    top = int(logits.argmax())
    strong = new_state(SamplingParams(temperature=0, repetition_penalty=50.0), [top], torch.device("cpu"))
    assert sample(logits, strong) != top


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


def test_presence_and_frequency_penalties(logits):
    """OpenAI's definition: logit - presence * [count > 0] - frequency * count, generated tokens only."""
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    state = new_state(params, [1, 2, 3], torch.device("cpu"))  # prompt tokens are not penalized
    for t in [4, 4, 4, 9]:
        state.record(t)
    expected = logits.clone()
    for token, count in {4: 3, 9: 1}.items():
        expected[token] -= 0.5 + 0.25 * count
    assert torch.equal(process_logits(logits, state), expected)


def test_logit_bias_forces_and_bans(logits):
    top = int(logits.argmax())
    ban = new_state(SamplingParams(temperature=0, logit_bias={top: -100.0}), [], torch.device("cpu"))
    assert sample(logits, ban) != top
    force = new_state(SamplingParams(temperature=1.0, seed=0, logit_bias={7: 100.0}), [], torch.device("cpu"))
    assert {sample(logits, force) for _ in range(20)} == {7}


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=3.0), dict(frequency_penalty=-2.5),
                                    dict(logit_bias={-1: 1.0}), dict(logit_bias={5: 101.0}),
                                    dict(n=0), dict(temperature=-0.1), dict(temperature=math.nan), dict(top_p=0.0),
                                    dict(top_k=-1), dict(min_p=1.5), dict(max_tokens=0),
                                    dict(repetition_penalty=0.0), dict(stop=[""]), dict(seed="x"),
                                    dict(stop_token_ids=[-1]), dict(seed=2**64), dict(seed=-2**63 - 1),
                                    dict(stop=5), dict(stop_token_ids=5), dict(max_tokens=True), dict(n=True),
                                    dict(ignore_eos="no")])
def test_invalid_params(kwargs):
    with pytest.raises(MinervaError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


@pytest.mark.skipif(native.load() is None, reason="the native kernels do not run on this CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_inverse_cdf_draws_what_torch_draws(dtype):
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(64, 49152, generator=g, dtype=torch.float64) * 4, -1).to(dtype)
    probs[1] = 0.0  # no mass: token 0, as torch's searchsorted and count give it
    probs[2, :-7] = 0.0  # mass only at the end
    probs[3] = 1.0  # unnormalized
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[4] = 1 - 2 ** -53  # u * total rounds up to the total: the last token with mass
    u[5] = 0.0
    u[6] = probs[6, :100].double().sum() / probs[6].double().sum()  # on a boundary
    got = native.load().invert_cdf_rows(probs.contiguous(), u)
    assert torch.equal(got, invert_cdf_torch(probs, u))
    assert torch.equal(invert_cdf(probs, u), got)


@pytest.mark.parametrize("spread", [8.0, 2.0, 0.3])  # peaked rows; rows whose top_p needs thousands of tokens
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_over_a_real_vocabulary_keeps_what_transformers_keeps(spread, top_p):
    g = torch.Generator().manual_seed(int(spread * 100 + top_p * 10))
    logits = torch.randn(6, 49152, generator=g) * spread
    states = [new_state(SamplingParams(top_p=top_p, seed=0), [], torch.device("cpu")) for _ in range(6)]
    want = TopPLogitsWarper(top_p)(None, logits.clone())
    got = process_batch(logits, states)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(want)])


def test_a_rows_top_p_cut_does_not_depend_on_the_rows_beside_it():
    """A row whose top_p ends exactly at a cumulative probability (where rounding decides the
    last token) keeps the same tokens alone and beside a flat row, which takes the whole-row
    sort: each row takes the head or the sort by its own values."""
    g = torch.Generator().manual_seed(5)
    cpu = torch.device("cpu")
    for _ in range(40):
        row = torch.randn(1, 4096, generator=g) * 4
        top = torch.softmax(row, -1).topk(64).values.cumsum(-1)[0]
        top_p = float(top[int(torch.randint(1, 40, (1,), generator=g))])
        peaked = new_state(SamplingParams(top_p=min(top_p, 1.0), seed=0), [], cpu)
        flat = new_state(SamplingParams(top_p=0.99, seed=0), [], cpu)
        alone = process_batch(row, [peaked])
        beside = process_batch(torch.cat([row, torch.zeros(1, 4096)]), [peaked, flat])
        assert torch.equal(beside[:1], alone)


@pytest.mark.parametrize("kinds", [["t"], ["t", "g"], ["g", "p"], ["t", "p"], ["k", "k"]])
def test_processing_leaves_the_callers_logits_alone(kinds):
    """All rows sampled, greedy among sampled, penalties: the result is new, the input unchanged,
    and each row is what it is alone."""
    make = {"t": dict(temperature=0.7), "g": dict(temperature=0), "p": dict(temperature=0.9, presence_penalty=1.0),
            "k": dict(top_k=3)}
    g = torch.Generator().manual_seed(2)
    batch = torch.randn(len(kinds), V, generator=g)
    before = batch.clone()
    states = [new_state(SamplingParams(**make[k]), [0, 4], torch.device("cpu")) for k in kinds]
    for s in states:
        s.record(4)
    ours = process_batch(batch, states)
    assert torch.equal(batch, before)
    for row, s in enumerate(states):
        assert torch.equal(ours[row], process_batch(before[row:row + 1], [s])[0])


def reference_draws(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Each row's token under transformers' processors, the CDF inverted at u in float64, and
    whether u falls within 2e-7 of a boundary between two tokens (where float rounding may decide)."""
    tokens, near = [], []
    for row, draw in zip(logits, u.tolist()):
        probs = torch.softmax(hf_chain(row, [], params).double(), -1)
        cdf = probs.cumsum(0)
        target = draw * float(cdf[-1])
        tokens.append(int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True)))
        near.append(bool(((cdf - target).abs() < 2e-7 * float(cdf[-1])).any()))
    return tokens, near


NATIVE_CASES = [dict(temperature=0.8), dict(top_p=0.9, temperature=0.7), dict(top_p=0.5), dict(top_k=40),
                dict(top_k=1000, temperature=1.3), dict(min_p=0.05), dict(top_k=100, top_p=0.8, min_p=0.02, temperature=0.9)]


@pytest.mark.skipif(native.load() is None, reason="the native kernels do not run on this CPU")
@pytest.mark.parametrize("spread", [8.0, 2.0, 0.5])  # peaked rows; rows whose top_p needs thousands of tokens
@pytest.mark.parametrize("kwargs", NATIVE_CASES, ids=lambda k: ",".join(f"{a}={v}" for a, v in k.items()))
def test_native_sampler_draws_what_transformers_gives(spread, kwargs):
    """The fused kernel (temperature, top-k, top-p, min-p, draw) against transformers' processors
    and a float64 inverse CDF, over a real vocabulary's size."""
    g = torch.Generator().manual_seed(int(spread * 10) + len(kwargs))
    logits = torch.randn(24, 49152, generator=g) * spread
    states = [new_state(SamplingParams(seed=i, **kwargs), [], torch.device("cpu")) for i in range(24)]
    # each state's first draw, as sample_batch takes it from the state's generator
    u = torch.cat([torch.rand(1, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i in range(24)])
    got = sample_batch(logits, states)
    want, near = reference_draws(logits, SamplingParams(**kwargs), u)
    assert sum(near) <= 4
    assert [a for a, n in zip(got, near) if not n] == [b for b, n in zip(want, near) if not n]


@pytest.mark.skipif(native.load() is None, reason="the native kernels do not run on this CPU")
def test_native_sampler_keeps_ties_as_transformers_does():
    """top_k keeps every token tied with the k-th largest, top_p and min_p their thresholds: over
    a grid of draws the kernel gives each token the reference gives, and every kept token turns up."""
    row = torch.full((49152,), -30.0)
    row[:9] = torch.tensor([5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 2.0, 1.0, 1.0])
    u = (torch.arange(4000, dtype=torch.float64) + 0.5) / 4000
    kernels = native.load()
    # top_p=0.8 ends inside the four tied tokens (cumulative 0.50, 0.69, 0.75, 0.82, ...): the first two stay
    for kwargs in (dict(top_k=3), dict(top_p=0.8), dict(min_p=0.1, temperature=0.5), dict(temperature=1.0)):
        params = SamplingParams(**kwargs)
        rows = row.expand(len(u), -1).contiguous()
        got = kernels.sample_rows(rows, torch.full((len(u),), params.temperature, dtype=torch.float32),
                                  torch.full((len(u),), params.top_k, dtype=torch.int64),
                                  torch.full((len(u),), params.top_p, dtype=torch.float64),
                                  torch.full((len(u),), params.min_p, dtype=torch.float32), u).tolist()
        want, near = reference_draws(row[None].expand(len(u), -1), params, u)
        assert [a for a, n in zip(got, near) if not n] == [b for b, n in zip(want, near) if not n], kwargs
        kept = set(torch.nonzero(torch.isfinite(hf_chain(row, [], params))).flatten().tolist())
        if len(kept) < 100:  # not the untouched row, whose -30 tail has no mass a grid of draws can reach
            assert set(got) == kept, kwargs


@pytest.mark.skipif(native.load() is None, reason="the native kernels do not run on this CPU")
@pytest.mark.parametrize("V", [1, 7, 9, 33])
def test_native_sampler_edges(V):
    """Short rows (the vector loops' tails), one finite token, the strictest settings: what
    transformers keeps, drawn at the same uniforms."""
    g = torch.Generator().manual_seed(V)
    rows = torch.randn(6, V, generator=g) * 3
    rows[1, :] = -math.inf
    rows[1, V // 2] = 0.5  # one token left (a grammar's mask): always it
    u = torch.rand(6, generator=g, dtype=torch.float64)
    for kwargs in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(temperature=1e-3), dict(temperature=2.0),
                   dict(top_k=V + 5, top_p=0.7)):
        params = SamplingParams(**kwargs)
        got = native.load().sample_rows(
            rows, torch.full((6,), params.temperature, dtype=torch.float32),
            torch.full((6,), params.top_k if 0 < params.top_k < V else 0, dtype=torch.int64),
            torch.full((6,), params.top_p, dtype=torch.float64), torch.full((6,), params.min_p, dtype=torch.float32),
            u).tolist()
        want, near = reference_draws(rows, params, u)
        assert got[1] == V // 2, kwargs
        assert [a for a, n in zip(got, near) if not n] == [b for b, n in zip(want, near) if not n], kwargs


def test_a_row_with_no_finite_logit_is_refused():
    """Logits that are -inf everywhere leave no token to pick (an overflow, as NaN and +inf are):
    refused, by the native greedy path and torch's alike, not read as token 0."""
    from minerva.engine.sampler import check_logits, greedy_tokens

    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    assert greedy_tokens(logits, torch.float32, cpu=True) == logits.argmax(-1).tolist()
    logits[1] = -math.inf
    for cpu in (True, False):
        with pytest.raises(MinervaError, match="the model produced NaN/inf logits"):
            greedy_tokens(logits, torch.float32, cpu=cpu)
    with pytest.raises(MinervaError, match="the model produced NaN/inf logits"):
        check_logits(logits, torch.bfloat16)
