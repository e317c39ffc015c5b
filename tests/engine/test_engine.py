"""The batched engine against its own one-request-at-a-time runs and against transformers.

Reference: each request run alone through the same engine (batch invariance), and
the model's logits from transformers (tiny random checkpoints).
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minerva import LLM, SamplingParams
from minerva.engine.request import Request
from minerva.errors import MinervaError
from tests.helpers.tiny_hf import VOCAB, save


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save(tmp_path_factory.mktemp("engine"), "llama-untied")


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return save(tmp_path_factory.mktemp("engine-gemma"), "gemma3")


# KV bytes per block of the llama-untied checkpoint in float32: K and V, 16 tokens, 2 KV heads of
# 64 / 4 = 16 dims, 4 bytes each, in each of 3 layers (worked out from its config by hand).
PER_BLOCK = 2 * 16 * 2 * 16 * 4 * 3


def make_llm(path, **options):
    options.setdefault("kv_cache_memory", 32 << 20)
    options.setdefault("dtype", "float32")
    return LLM(str(path), device="cpu", **options)


def prompts(n, lo=3, hi=60, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_alone(llm, prompt, params):
    return llm.generate([prompt], params)[0].token_ids


GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("path", ["model_dir", "gemma_dir"])
def test_batched_equals_alone(request, path, params):
    llm = make_llm(request.getfixturevalue(path))
    ps = prompts(12)
    batched = [o.token_ids for o in llm.generate(ps, params)]
    assert batched == [run_alone(llm, p, params) for p in ps]
    assert llm.engine.blocks.num_used_blocks == 0


def test_batch_invariance_with_staggered_arrivals(model_dir):
    """One request alone vs. among 32 others of mixed lengths that arrive at different steps."""
    llm = make_llm(model_dir, max_num_batched_tokens=64)
    target = prompts(1, 40, 40, seed=99)[0]
    alone = run_alone(llm, target, SAMPLED)
    engine, others = llm.engine, prompts(32, 1, 90, seed=5)
    rng = random.Random(3)
    pending = [Request(p, SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.7, seed=i,
                                         ignore_eos=True)) for i, p in enumerate(others)]
    mine = Request(list(target), SAMPLED)
    tokens: list[int] = []
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 2 == 0:
            for _ in range(rng.randint(1, 4)):
                if pending:
                    engine.add_request(pending.pop())
        if steps == 3:
            engine.add_request(mine)
        for delta in engine.step():
            if delta.request_id == mine.request_id:
                tokens += delta.token_ids
        steps += 1
    assert tokens == alone
    assert engine.blocks.num_used_blocks == 0


def test_chunked_prefill_equals_whole(model_dir):
    whole = make_llm(model_dir, max_num_batched_tokens=2048)
    chunked = make_llm(model_dir, max_num_batched_tokens=7)  # 100-token prompt in 15 chunks
    p = prompts(1, 100, 100, seed=4)
    assert run_alone(chunked, p[0], GREEDY) == run_alone(whole, p[0], GREEDY)
    assert run_alone(chunked, p[0], SAMPLED) == run_alone(whole, p[0], SAMPLED)


def test_prompts_cut_to_prefill_chunk_seconds_beside_decodes(model_dir):
    """A prompt that arrives while another request decodes goes in the chunks
    prefill_chunk_seconds allows at the measured speed of a row (here MIN_CHUNK, 16, a step:
    no row is that fast); alone, a prompt starts with FIRST_CHUNK (64) before a row is timed;
    the tokens are those of a whole prefill."""
    from minerva.engine.scheduler import FIRST_CHUNK, MIN_CHUNK
    whole = make_llm(model_dir, prefill_chunk_seconds=0)
    cut = make_llm(model_dir, prefill_chunk_seconds=1e-9)
    early, late = prompts(2, 70, 70, seed=8)
    engine = cut.engine
    first, second = Request(list(early), GREEDY), Request(list(late), GREEDY)
    tokens = {first.request_id: [], second.request_id: []}
    schedule, steps = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    engine.add_request(first)
    while engine.has_unfinished():
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
        if len(steps) == 2:  # first's whole prompt, alone: a row's time measured
            assert engine.scheduler.row_seconds > 0
            engine.add_request(second)
    assert [o.prompt_tokens for o in steps if o.prompt_tokens] == [FIRST_CHUNK, 70 - FIRST_CHUNK] + [MIN_CHUNK] * 4 + [
        70 - 4 * MIN_CHUNK]
    assert tokens[first.request_id] == run_alone(whole, early, GREEDY)
    assert tokens[second.request_id] == run_alone(whole, late, GREEDY)


def test_prefill_chunk_seconds_is_checked(model_dir):
    with pytest.raises(MinervaError, match="--prefill-chunk-seconds must be a finite number >= 0"):
        make_llm(model_dir, prefill_chunk_seconds=-0.5)


def test_prefix_cache_hit_equals_cold_run(model_dir):
    cold = make_llm(model_dir, enable_prefix_caching=False)
    warm = make_llm(model_dir)
    p = prompts(1, 70, 70, seed=8)[0]
    expected = run_alone(cold, p, SAMPLED)
    assert run_alone(warm, p, SAMPLED) == expected  # fills the cache
    hits = warm.engine.blocks.prefix_hits
    assert run_alone(warm, p, SAMPLED) == expected  # served from the cache
    assert warm.engine.blocks.prefix_hits - hits == (len(p) - 1) // 16 * 16
    assert cold.engine.blocks.prefix_hits == 0


@pytest.mark.parametrize("path", ["model_dir", "gemma_dir"])
def test_prompts_sharing_a_prefix_sent_together_compute_it_once(request, path):
    """Four prompts that begin with one 100-token prefix, sent together (budget 32 a step): the
    first computes it, the others wait for it and take it from the cache; each answer is what
    it is alone, with no cache (Gemma 3: its sliding-window layers too)."""
    cold = make_llm(request.getfixturevalue(path), enable_prefix_caching=False)
    shared = prompts(1, 100, 100, seed=3)[0]
    ps = [shared + tail for tail in prompts(4, 1, 9, seed=4)]
    expected = [run_alone(cold, p, SAMPLED) for p in ps]
    llm = make_llm(request.getfixturevalue(path), max_num_batched_tokens=32)
    assert [o.token_ids for o in llm.generate(ps, SAMPLED)] == expected
    assert llm.engine.blocks.prefix_hits == 3 * (100 // 16 * 16)


def test_preempted_request_equals_undisturbed(model_dir):
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)
    ps = prompts(6, 30, 50, seed=2)
    roomy = make_llm(model_dir)
    expected = [o.token_ids for o in roomy.generate(ps, params)]
    # 24 blocks of 16 tokens cannot hold six requests of up to 90 tokens: some are preempted
    tight = make_llm(model_dir, kv_cache_memory=24 * PER_BLOCK)
    assert tight.engine.blocks.num_blocks == 24 and tight.engine.cache.nbytes == 24 * PER_BLOCK
    got = [o.token_ids for o in tight.generate(ps, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.engine.blocks.num_used_blocks == 0


def test_matches_transformers_greedy(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = make_llm(model_dir)
    ps = prompts(4, 5, 30, seed=6)
    outs = llm.generate(ps, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for p, o in zip(ps, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert o.token_ids == ref.tolist()


def test_abort_frees_blocks(model_dir):
    llm = make_llm(model_dir)
    engine = llm.engine
    reqs = [Request(p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in prompts(5)]
    for r in reqs:
        engine.add_request(r)
    engine.step()
    engine.step()
    assert engine.blocks.num_used_blocks > 0
    for r in reqs[:3]:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_used_blocks == 0


def test_stopping_a_stream_early_frees_blocks(model_dir):
    llm = make_llm(model_dir)
    stream = llm.stream(prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert llm.engine.blocks.num_used_blocks == 0 and not llm.engine.has_unfinished()


def test_n_completions_share_the_prompt(model_dir):
    llm = make_llm(model_dir)
    p = prompts(1, 64, 64, seed=1)[0]
    out = llm.generate([p], SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.blocks.prefix_hits >= 3 * 48  # the later three reuse the first one's full blocks
    single = run_alone(llm, p, SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True))
    assert out.outputs[2].token_ids == single  # completion i uses seed + i


def test_request_too_large_for_the_pool(model_dir):
    from minerva.errors import MinervaError

    llm = make_llm(model_dir, kv_cache_memory=4 * PER_BLOCK)  # 64 tokens: not enough for 150
    with pytest.raises(MinervaError, match="pool holds"):
        llm.generate([prompts(1, 50, 50)[0]], SamplingParams(max_tokens=100))


def test_logit_bias_through_the_engine(model_dir):
    from minerva.errors import MinervaError

    llm = make_llm(model_dir)
    out = llm.generate([prompts(1)[0]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                       logit_bias={5: 100.0}))[0]
    assert out.token_ids == [5] * 5
    with pytest.raises(MinervaError, match="logit_bias"):
        llm.generate([prompts(1)[0]], SamplingParams(max_tokens=5, logit_bias={VOCAB + 3: 1.0}))


def test_logprobs_match_transformers(model_dir):
    """Each returned logprob equals log_softmax of transformers' logits at that position."""
    from transformers import AutoModelForCausalLM

    llm = make_llm(model_dir)
    p = prompts(1, 12, 12, seed=9)[0]
    out = llm.generate([p], SamplingParams(max_tokens=6, temperature=0.8, seed=1, logprobs=3,
                                           ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([p + out.token_ids])).logits[0].float(), -1)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(p) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        top = torch.topk(row, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert all(abs(v - float(w)) < 1e-4 for (_, v), w in zip(lp.top, top.values))
    plain = llm.generate([p], SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True))[0]
    assert plain.outputs[0].logprobs is None and plain.token_ids == out.token_ids


ACTIONS = st.lists(st.tuples(st.sampled_from(["add", "abort", "step"]), st.integers(0, 10**6)),
                   min_size=1, max_size=40)


@pytest.fixture(scope="module")
def tight_llm(model_dir):
    # 12 blocks of 16 tokens: requests compete for blocks, so preemption happens too
    llm = make_llm(model_dir, kv_cache_memory=12 * PER_BLOCK, max_num_batched_tokens=24, max_num_seqs=4)
    assert llm.engine.blocks.num_blocks == 12
    return llm


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS)
def test_random_add_abort_step_never_leaks(tight_llm, actions):
    engine = tight_llm.engine
    live: list[Request] = []
    added: list[Request] = []
    for action, x in actions:
        rng = random.Random(x)
        if action == "add":
            p = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))]
            r = Request(p, SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0, 1.0]),
                                          seed=x, ignore_eos=True), priority=rng.randint(0, 2))
            engine.add_request(r)
            live.append(r)
            added.append(r)
        elif action == "abort" and live:
            engine.abort(live.pop(x % len(live)).request_id)
        else:
            engine.step()
        # blocks in use are exactly those in some live request's table (none leaked, none lost)
        held = set().union(*(engine.blocks.block_table(rid) for rid in engine.requests))
        assert engine.blocks.num_used_blocks == len(held)
        assert all(engine.blocks.block_table(r.request_id) for r in engine.scheduler.running)
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_used_blocks == 0
    assert not engine.requests and not engine.scheduler.outputs
    for r in added:  # every request ended: ran to its length, or was aborted before that
        if r in live:
            assert r.finish_reason == "length" and len(r.output_token_ids) == r.params.max_tokens
        else:
            assert r.finish_reason in ("abort", "length")


@pytest.mark.parametrize("dtype,norm_weight,advice", [
    ("float16", 1e6, r"overflow in float16; run with --dtype bfloat16 or float32"),  # finite in the wider dtypes
    ("bfloat16", math.nan, r"in bfloat16, or damaged weights; run with --dtype float32, and if that fails too, "
                           r"the model's weights are damaged\)"),
    ("float32", math.nan, r"ran in float32, so no wider dtype helps"),
])
def test_nan_logits_advice_fits_the_dtype_of_the_run(model_dir, dtype, norm_weight, advice):
    llm = make_llm(model_dir, dtype=dtype)
    with torch.inference_mode():
        llm.loaded.model.norm.weight.fill_(norm_weight)
    with pytest.raises(MinervaError, match=r"the model produced NaN/inf logits \(.*" + advice) as e:
        llm.generate([[1, 2, 3]], GREEDY)
    suggested = str(e.value).partition("--dtype")[2].replace(")", " ").split()
    assert dtype not in suggested  # never "use the dtype you are using"


def test_auto_dtype_is_bfloat16_where_the_cpu_kernels_run(model_dir):
    with open("/proc/cpuinfo") as f:
        flags = set(next((ln for ln in f if ln.startswith("flags")), ":").split(":", 1)[1].split())
    # the instruction sets the C++ kernels are built for (minerva/kernels/csrc), unless switched off
    capable = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c", "fma"} <= flags \
        and not os.environ.get("MINERVA_NO_NATIVE")
    llm = make_llm(model_dir, dtype="auto")
    expected = "bfloat16" if capable else "float32"
    assert llm.dtype_name == expected and llm.dtype == getattr(torch, expected)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(MinervaError, match="unknown dtype"):
        make_llm(model_dir, dtype="float8")
