"""Speculative decoding never changes the output distribution.

- `verify` (rejection sampling) against known distributions: chi-square goodness of fit;
- greedy with each proposer equals greedy without, token for token, alone and in a batch
  with requests that do not speculate;
- sampling with a draft model whose distribution differs from the target's: the emitted
  tokens follow the same distribution as sampling without speculation (two-sample test);
- stand-down, bad settings, incompatible vocabularies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from minerva import LLM, SamplingParams
from minerva.engine.rejection import sample_along, verify
from minerva.engine.sampler import SamplerState, sample_batch
from minerva.engine import speculative
from minerva.engine.speculative import Acceptance, NgramProposer, Speculator, StepCosts, expected_tokens
from minerva.errors import MinervaError
from tests.helpers.cli import assert_clean_error, run
from tests.helpers.server import metric, running_server
from tests.helpers.tiny_hf import VOCAB, save

ALPHA = 1e-3  # the seeds are fixed, so each test is deterministic; a failure is far outside chance


def dist(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-q", "one-hot-q"])
def test_verify_emits_the_target_distribution(deterministic):
    """Rejection sampling with a draft's q (`verify`), and with guesses made deterministically
    (`sample_along`, from logits whose softmax is p)."""
    p = torch.stack([dist([5, 1, 1, 2, 0.5, 0.5]), dist([1, 3, 0, 1, 4, 1]), dist([2, 2, 2, 1, 1, 2])])
    q = torch.stack([dist([1, 4, 1, 1, 2, 1]), dist([3, 1, 1, 1, 1, 3])])
    logits = p.log().float()
    gen = torch.Generator().manual_seed(0)
    state = SamplerState(SamplingParams(temperature=1.0), gen)
    n = 20000
    first, second = np.zeros(6), np.zeros(6)
    for _ in range(n):
        if deterministic:
            out = sample_along(logits, [0, 4], [state] * 3)  # e.g. prompt lookup
        else:
            drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
            out = verify(p, drafts, q, gen)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        if len(out) > 1:  # position 2 was reached through an accepted guess
            second[out[1]] += 1
    for counts, target in [(first, p[0]), (second, p[1])]:
        keep = target.numpy() > 0
        assert counts[~keep].sum() == 0
        expected = target.numpy()[keep] * counts.sum()
        assert chisquare(counts[keep], expected).pvalue > ALPHA


def test_deterministic_guesses_meet_the_draws_made_without_them():
    """`sample_along` draws each position's token as the sampler does, one uniform of the
    request's generator a token emitted: with any guesses, the tokens are those of plain
    sampling from the same seed."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.5, top_p=0.95)
    plain_state = SamplerState(params, torch.Generator().manual_seed(7))
    plain = [sample_batch(logits[i:i + 1], [plain_state])[0] for i in range(6)]
    for drafts in ([], plain[:5], plain[:2] + [(plain[2] + 1) % 50], [(plain[0] + 1) % 50, plain[1]]):
        state = SamplerState(params, torch.Generator().manual_seed(7))
        out, at = [], 0
        while at < 6:  # steps of up to len(drafts) guesses each, guessed from `drafts`' pattern
            guesses = [plain[at + j] if j < len(drafts) and drafts[j] == plain[j] else (plain[at + j] + 1) % 50
                       for j in range(min(len(drafts), 5 - at))]
            step = sample_along(logits[at:at + len(guesses) + 1], guesses, [state] * (len(guesses) + 1))
            out += step
            at += len(step)
        assert out[:6] == plain, drafts


def test_ngram_lookup():
    ng = NgramProposer()
    assert ng.lookup([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # longest suffix (1, 2, 3) seen before
    assert ng.lookup([5, 6, 7, 5, 6, 8, 5, 6], 2) == [8, 5]  # the most recent match of (5, 6)
    assert ng.lookup([1, 2, 3], 3) == []


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save(tmp_path_factory.mktemp("spec-target"), "llama-untied")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return save(tmp_path_factory.mktemp("spec-draft"), "llama-tied")  # other weights, same vocabulary


def make(path, **options):
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=32 << 20, **options)


def repetitive_prompts(n):
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        motif = rng.integers(0, VOCAB, rng.integers(3, 7)).tolist()
        out.append(motif * 4 + rng.integers(0, VOCAB, 3).tolist() + motif)
    return out


@pytest.mark.parametrize("method", ["ngram", "self:1", "draft"])
def test_greedy_is_unchanged_token_for_token(target_dir, draft_dir, method):
    prompts = repetitive_prompts(6)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = make(target_dir).generate(prompts, params)
    spec_name = f"draft:{draft_dir}" if method == "draft" else method
    llm = make(target_dir, speculative=spec_name, num_speculative_tokens=3, speculative_max_batch=64)
    # half the requests opt out: speculating and plain requests share every step
    mixed = [params if i % 2 else SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                  speculative_tokens=0) for i in range(len(prompts))]
    spec = llm.generate(prompts, mixed)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.engine.speculator.stats
    assert stats.num_steps > 0 and stats.num_draft_tokens > 0
    if method == "ngram":
        assert stats.num_accepted_tokens > 0
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("method", ["ngram", "self:1", "draft"])
def test_a_seeded_sampling_request_is_the_same_with_speculation_or_without(target_dir, draft_dir, method):
    """A seeded sampling request's guesses are deterministic and its tokens drawn as without
    guesses: the same tokens as without speculation, alone, in a crowded batch (above
    speculative_max_batch: no guesses) and with a token budget that cuts guesses short."""
    prompts = repetitive_prompts(6)
    seeded = [SamplingParams(max_tokens=24, temperature=0.7, seed=1234 + i, ignore_eos=True, repetition_penalty=1.1)
              for i in range(3)]
    plain = make(target_dir).generate(prompts[:3], seeded)
    spec_name = f"draft:{draft_dir}" if method == "draft" else method
    others = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    for options in ({"speculative_max_batch": 64}, {"speculative_max_batch": 3},
                    {"speculative_max_batch": 64, "max_num_batched_tokens": 16}):
        llm = make(target_dir, speculative=spec_name, num_speculative_tokens=3, **options)
        alone = llm.generate(prompts[:3], seeded)
        crowded = llm.generate(prompts, seeded + [others] * 3)[:3]
        assert [o.token_ids for o in alone] == [o.token_ids for o in crowded] == [o.token_ids for o in plain], options
        assert llm.engine.speculator.stats.num_draft_tokens > 0


def test_sampling_distribution_is_unchanged(target_dir, draft_dir, monkeypatch):
    """The third generated token's distribution, sampled 1500 times with and without a
    draft model (whose distribution differs from the target's), passes a chi-square test of
    homogeneity; with a penalty and top-k so the transforms are part of what is preserved.
    The requests are seeded, so the test repeats; their draft samples its guesses, as it does
    for requests without a seed (a seeded one's are its most likely tokens)."""
    monkeypatch.setattr(speculative, "deterministic", lambda r: r.params.greedy)
    prompt = [3, 17, 42, 99, 5]
    n = 1500

    def third_tokens(llm):
        params = [SamplingParams(max_tokens=3, temperature=0.8, top_k=12, presence_penalty=0.5,
                                 ignore_eos=True, seed=s) for s in range(n)]
        return [o.token_ids[2] for o in llm.generate([prompt] * n, params)]

    plain = third_tokens(make(target_dir, max_num_seqs=256))
    llm = make(target_dir, max_num_seqs=256, speculative=f"draft:{draft_dir}", num_speculative_tokens=2,
               speculative_max_batch=256)
    spec = third_tokens(llm)
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    assert 0 < llm.engine.speculator.stats.num_accepted_tokens < llm.engine.speculator.stats.num_draft_tokens
    values = sorted(set(plain) | set(spec))
    table = np.array([[plain.count(v) for v in values], [spec.count(v) for v in values]])
    common = table.sum(0) >= 10  # pool the rare tokens into one category
    table = np.concatenate([table[:, common], table[:, ~common].sum(1, keepdims=True)], axis=1)
    assert chi2_contingency(table).pvalue > ALPHA


def test_acceptance_runs_are_a_kaplan_meier_estimate():
    """Runs accepted to their end are cut short, not rejections: 3 of 4 guesses accepted and
    then a rejection counts at position 4; 2 of 2 accepted says nothing past position 2."""
    a = Acceptance(4, decay=1.0)
    a.add(4, 3)  # rejected at 4
    a.add(2, 2)  # censored at 2
    a.add(4, 0)  # rejected at 1
    assert a.risk[1:] == [3, 2, 1, 1] and a.rejected[1:] == [1, 0, 0, 1]
    h = a.hazards([0.5] * 5, weight=0.0)
    assert h[1:] == [pytest.approx(1 / 3), 0.0, 0.0, 1.0]
    # expected tokens at k: 1 + P(run >= 1) + ... : 1 + 2/3 + 2/3 + 2/3 at k = 3, nothing more at 4
    assert expected_tokens(h, 3) == pytest.approx(1 + 3 * 2 / 3) and expected_tokens(h, 4) == expected_tokens(h, 3)
    assert expected_tokens(h, 0) == 1.0
    # with no counts at a position, the prior stands
    assert Acceptance(2, 0.9).hazards([0.3, 0.3, 0.3], weight=2.0)[1:] == [pytest.approx(0.3)] * 2
    b = Acceptance(1, decay=0.5)  # older counts weigh less
    b.add(1, 1)
    b.add(1, 0)
    assert (b.risk[1], b.rejected[1]) == (1.5, 1.0)


def test_step_costs_interpolate_between_the_row_counts_seen():
    c = StepCosts()
    assert c.estimate(3) is None
    c.add(1, 1.0)
    c.add(5, 3.0)
    assert c.estimate(3) == pytest.approx(2.0) and c.estimate(6) is None and c.estimate(1) == 1.0
    c.add(1, 2.0)  # a moving average
    assert 1.0 < c.estimate(1) < 2.0


class _Req:
    def __init__(self, rid):
        self.request_id = rid


def test_k_follows_acceptance_and_costs():
    """Guesses that are always accepted, at a cost that grows slowly with the rows: the most k;
    at a cost that grows as fast as the rows (each guess as dear as a plain step) and
    acceptance of 1 in 2: none; one step in EXPLORE explores whatever the estimates say."""
    def speculator(seconds_per_row, base, accepted_all):
        spec = Speculator(None, 4, 8)
        for rows in range(1, 6):
            spec.costs.add(rows, base + seconds_per_row * rows)
        r = _Req("a")
        for _ in range(40):
            if accepted_all:
                spec._runs(r).add(4, 4)
            else:
                spec._runs(r).add(4, 0)
                spec._runs(r).add(4, 1)
        return spec, r

    spec, r = speculator(0.01, 1.0, True)
    picks = [spec.choose_k([r], 1) for _ in range(2 * Speculator.EXPLORE)]
    assert [k for i, k in enumerate(picks, 1) if i % Speculator.EXPLORE] == [4] * (len(picks) - 2)
    spec, r = speculator(1.0, 0.0, False)
    picks = [spec.choose_k([r], 1) for _ in range(4 * Speculator.EXPLORE)]
    explored = {k for i, k in enumerate(picks, 1) if i % Speculator.EXPLORE == 0}
    assert {k for i, k in enumerate(picks, 1) if i % Speculator.EXPLORE} == {0} and 4 in explored and len(explored) > 1


def test_k_keeps_adapting_under_a_request_cap():
    """A request that may take only 2 guesses (its speculative_tokens, or its room) under
    --num-speculative-tokens 8: the step's rows and expected tokens count its 2, so the
    costs measured at 3 rows are found (it would otherwise wait forever for 9 rows' cost)."""
    spec = Speculator(None, 8, 8)
    for rows in (1, 2, 3):
        spec.costs.add(rows, float(rows))  # each guess as dear as a plain step
    r = _Req("a")
    for _ in range(20):
        spec._runs(r).add(2, 0)  # always rejected: no guesses pay
    picks = [spec.choose_k([r], 1, [2]) for _ in range(Speculator.EXPLORE - 1)]
    assert picks == [0] * (Speculator.EXPLORE - 1)
    assert spec.choose_k([r], 1, [2]) in (0, 1, 2)  # an exploring step stays within the cap


def test_stands_down_for_large_batches(target_dir):
    llm = make(target_dir, speculative="ngram", speculative_max_batch=2)
    llm.generate(repetitive_prompts(6), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert llm.engine.speculator.stats.num_steps == 0


def test_stands_down_when_guesses_are_rejected(target_dir, draft_dir):
    llm = make(target_dir, speculative=f"draft:{draft_dir}", num_speculative_tokens=4)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    stats = llm.engine.speculator.stats
    # an unrelated random draft is almost always wrong: after a few steps it backs off
    assert stats.acceptance_rate < 0.5 and stats.num_steps < 20


def test_bad_settings(target_dir, tmp_path):
    with pytest.raises(MinervaError, match="unknown --speculative"):
        make(target_dir, speculative="medusa")
    with pytest.raises(MinervaError, match="num-speculative-tokens"):
        make(target_dir, speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(MinervaError, match="fewer layers"):
        make(target_dir, speculative="self:3")
    other = shutil.copytree(target_dir, tmp_path / "other-vocab")
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {("Ġa" if k == "Ġt" else k): v for k, v in tok["model"]["vocab"].items()}
    tok["model"]["merges"] = [["Ġ", "a"]]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(MinervaError, match="different vocabulary"):
        make(target_dir, speculative=f"draft:{other}")
    with pytest.raises(MinervaError, match="speculative_tokens"):
        SamplingParams(speculative_tokens=-1)


def test_bench_speculative_reports_both_sides(target_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and the cat sat on the mat again " * 6)
    out = tmp_path / "spec.json"
    proc = run("bench", "speculative", str(target_dir), "--speculative", "ngram", "-n", "12", "-r", "1",
               "--dtype", "float32", "--text", str(text), "--text-tokens", "60", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    for label in ("speculation off", "speculation on", "speedup", "acceptance rate", "accepted guesses",
                  "step cost by rows"):
        assert label in proc.stdout
    report = json.loads(out.read_text())
    assert report["outputs_identical"] and len(report["accepted_length_histogram"]) == 4
    steps = report["step_seconds_by_rows"]  # one-row steps (speculation off) and verifying ones
    assert "1" in steps and any(int(rows) > 1 for rows in steps) and all(s > 0 for s in steps.values())
    assert_clean_error(run("bench", "speculative", str(target_dir), "-n", "4"), "--speculative")
    assert_clean_error(run("generate", str(target_dir), "hi", "--speculative", "eagle"), "--speculative")
    assert_clean_error(run("bench", "speculative", str(target_dir), "--speculative", "ngram",
                           "--text", str(tmp_path / "missing.txt")), "--text", "missing.txt")
    assert_clean_error(run("bench", "speculative", str(target_dir), "--speculative", "ngram",
                           "--text-tokens", "0"), "--text-tokens")
    assert_clean_error(run("generate", str(target_dir), "hi", "--speculative", "ngram",
                           "--speculative-max-batch", "0"), "--speculative-max-batch")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "self:8"])
def test_greedy_is_unchanged_on_smollm2(smollm2_gguf, smollm2_llm, method):
    text = (Path(__file__).parents[1] / "data" / "prose.txt").read_text()[:900]
    prompt = smollm2_llm.apply_chat_template(
        [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}])
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = smollm2_llm.generate(prompt, params)[0].outputs[0].token_ids
    llm = LLM(str(smollm2_gguf), device="cpu", dtype="float32", kv_cache_memory=64 << 20, speculative=method)
    spec = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert spec == plain
    assert llm.engine.speculator.stats.num_draft_tokens > 0


def test_server_speculation_per_request_and_metrics(target_dir):
    import httpx

    llm = make(target_dir, speculative="ngram", speculative_max_batch=64)
    prompt = repetitive_prompts(1)[0]
    expected = make(target_dir).generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                                  ignore_eos=True))[0].outputs[0].token_ids
    with running_server(llm) as (url, _):
        def complete(**extra):
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        off = complete(speculative_tokens=0)
        assert metric(url, "minerva:spec_decode_num_draft_tokens_total") == 0
        on = complete()
        assert on == off == llm.tokenizer.decode(expected)
        drafted = metric(url, "minerva:spec_decode_num_draft_tokens_total")
        accepted = metric(url, "minerva:spec_decode_num_accepted_tokens_total")
        assert drafted > 0 and 0 < accepted <= drafted
        assert metric(url, "minerva:spec_decode_accepted_length_count") == \
            metric(url, "minerva:spec_decode_num_drafts_total") > 0
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "speculative_tokens": 99}, timeout=30)
        assert bad.status_code == 400 and "speculative_tokens" in bad.text
