"""Decode bursts (--decode-steps): several forwards in one engine step, each sampled token fed
back in (minerva/engine/scheduler.py `_burst`, minerva/engine/runner.py `_burst`, the native
`forward_steps`).

References: transformers' greedy continuation of the same GGUF files, and the engine's own
one-token-a-step runs in the same test (the same requests must give the same tokens, text
and finish reasons, whatever the burst length).
"""

from __future__ import annotations

import dataclasses

import pytest

from minerva import LLM, SamplingParams
from minerva.engine import scheduler
from minerva.engine.request import Request
from minerva.errors import MinervaError
from minerva.models.causal_lm import CausalLM
from tests.helpers.hf import hf_greedy
from tests.helpers.tiny_hf import VOCAB, save


@pytest.fixture(autouse=True)
def no_time_cap(monkeypatch):
    """Bursts as long as --decode-steps allows whatever a forward takes on the machine (the
    0.1 s cap made them depend on its speed); the cap's own test sets the times."""
    monkeypatch.setattr(scheduler, "BURST_SECONDS", 1e9)


@pytest.fixture
def native_bursts(monkeypatch):
    """The step counts each native burst (CausalLM.greedy_steps) ran, as the test goes."""
    ran: list[int] = []
    original = CausalLM.greedy_steps

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out is not None:
            ran.append(len(out[0]))
        return out

    monkeypatch.setattr(CausalLM, "greedy_steps", spy)
    return ran


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_bursts_match_transformers(request, name, native_bursts):
    """Three requests of different lengths in one batch, five forwards a step, against
    transformers' greedy tokens for each alone (float32, float activations: the reference's
    precision), through the native burst."""
    gguf, hf = request.getfixturevalue(f"{name}_gguf"), request.getfixturevalue(f"{name}_hf")
    llm = LLM(str(gguf), device="cpu", dtype="float32", activations="float", decode_steps=5)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    lengths = [32, 19, 26]
    outs = llm.generate(ids, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths],
                        use_tqdm=False)
    for i, n, o in zip(ids, lengths, outs):
        assert o.token_ids == hf_greedy(hf, i, n)
        assert o.finish_reason == "length"
    assert native_bursts and max(native_bursts) == 4  # the first of five forwards runs from Python
    assert llm.engine.blocks.num_used_blocks == 0


def token_runs(llm: LLM, steps: int, prompts: list, params) -> list:
    """(tokens, text, finish reason) of each prompt, with bursts of `steps` forwards."""
    scheduler = llm.engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, decode_steps=steps)
    return [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_bursts_give_single_steps_tokens_and_stops(request, name, native_bursts):
    """The engine's default precision (int8 activations where the CPU has the kernels): one
    token a step against bursts of 3 and 8, with a stop token and a stop string that fall
    inside a burst, and a max_tokens that is no multiple of the burst."""
    llm = LLM(str(request.getfixturevalue(f"{name}_gguf")), device="cpu")
    greedy = SamplingParams(max_tokens=21, temperature=0, ignore_eos=True)
    base = token_runs(llm, 1, PROMPTS, greedy)
    assert all(len(t) == 21 for t, _, _ in base)
    stop_token = base[0][0][10]
    words = base[1][1].split()
    stop_text = next(w for w in words[len(words) // 2:] if len(w) > 2)
    params = [SamplingParams(max_tokens=21, temperature=0, ignore_eos=True, stop_token_ids=[stop_token]),
              SamplingParams(max_tokens=21, temperature=0, ignore_eos=True, stop=[stop_text]),
              SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)]
    expected = token_runs(llm, 1, PROMPTS, params)
    assert expected[0][2] == "stop" and len(expected[0][0]) == base[0][0].index(stop_token)
    assert expected[1][2] == "stop" and stop_text not in expected[1][1]
    assert expected[2][2] == "length" and len(expected[2][0]) == 13
    native_bursts.clear()
    for steps in (3, 8):
        assert token_runs(llm, steps, PROMPTS, greedy) == base
        assert token_runs(llm, steps, PROMPTS, params) == expected
    assert native_bursts and max(native_bursts) > 1
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save(tmp_path_factory.mktemp("bursts"), "llama-untied")


def test_seeded_sampling_is_the_same_in_bursts(tiny_dir):
    """Sampled requests burst through the Python loop (a draw from each request's generator
    a forward): with seeds, the same tokens as one token a step."""
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_memory=32 << 20)
    ps = [[(7 * i + j) % VOCAB for j in range(5 + i)] for i in range(4)]
    params = [SamplingParams(max_tokens=17, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True) for i in range(4)]
    assert token_runs(llm, 4, ps, params) == token_runs(llm, 1, ps, params)


def deltas_of(engine, prompt) -> list[int]:
    """Token counts of each delta of one greedy request driven step by step."""
    r = Request(prompt, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    engine.add_request(r)
    counts = []
    while engine.has_unfinished():
        counts += [len(d.token_ids) for d in engine.step() if d.request_id == r.request_id]
    return counts


def test_a_burst_ends_when_interrupted_or_a_request_waits(tiny_dir, monkeypatch):
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_memory=32 << 20, decode_steps=4)
    engine = llm.engine
    prompt = [3, 1, 4, 1, 5]
    # the prompt's step, one decode step that times a forward, then bursts up to max_tokens
    assert deltas_of(engine, prompt) == [1, 1, 4, 4, 4]
    assert deltas_of(engine, prompt) == [1, 4, 4, 4, 1]  # timed already
    engine.interrupt = lambda: True  # the server's: a request or an abort arrived
    assert deltas_of(engine, prompt) == [1] * 14
    engine.interrupt = None
    # a burst lasts about BURST_SECONDS at most, by the last step's time a forward (0.04 s here)
    monkeypatch.setattr(scheduler, "BURST_SECONDS", 0.1)
    timed = []
    monkeypatch.setattr(scheduler.Scheduler, "timed", lambda self, output, sampled, seconds: (
        timed.append(max(len(t) for t in sampled if t)), setattr(self, "forward_seconds", 0.04)))
    assert deltas_of(engine, prompt) == [1] + [2] * 6 + [1]
    assert timed == [1] + [2] * 6 + [1]
    monkeypatch.setattr(scheduler, "BURST_SECONDS", 0.0)
    assert deltas_of(engine, prompt) == [1] * 14
    monkeypatch.undo()
    monkeypatch.setattr(scheduler, "BURST_SECONDS", 1e9)
    # a request that waits to start (one may run at a time) gets its step after one token
    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_memory=32 << 20, decode_steps=4,
              max_num_seqs=1)
    first, second = (Request(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for _ in range(2))
    llm.engine.add_request(first)
    llm.engine.add_request(second)
    counts = {first.request_id: [], second.request_id: []}
    while llm.engine.has_unfinished():
        for d in llm.engine.step():
            counts[d.request_id].append(len(d.token_ids))
    assert counts[first.request_id] == [1] * 6  # the second waited all along
    assert counts[second.request_id] == [1, 4, 1]


def test_bursts_in_a_full_pool(tiny_dir):
    """Blocks for a whole burst or none, and no request preempted for one: in a pool of three
    blocks, two requests that both want a second block mid-burst, one getting it; then
    preemption as without bursts. The tokens of a roomy pool's one-token steps."""
    ps = [[(5 * i + j) % VOCAB for j in range(14)] for i in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    roomy = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_memory=32 << 20, decode_steps=1)
    expected = [o.token_ids for o in roomy.generate(ps, params, use_tqdm=False)]
    # K and V of 16 tokens, 2 KV heads of 16 dims, float32, 3 layers (test_engine's PER_BLOCK)
    tight = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_memory=3 * 2 * 16 * 2 * 16 * 4 * 3,
                decode_steps=8, enable_prefix_caching=False)
    assert tight.engine.blocks.num_blocks == 3
    assert [o.token_ids for o in tight.generate(ps, params, use_tqdm=False)] == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.blocks.num_used_blocks == 0


def test_decode_steps_must_be_positive(tiny_dir):
    with pytest.raises(MinervaError, match="--decode-steps must be an integer >= 1"):
        LLM(str(tiny_dir), device="cpu", decode_steps=0)


def test_the_server_ends_a_burst_when_a_command_arrives(tiny_dir):
    """The server's engine thread takes new requests and aborts between steps: one waiting in
    its queue ends a burst (Engine.interrupt)."""
    from minerva.serve.async_engine import AsyncEngine, Group
    from minerva.serve.metrics import Metrics

    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", kv_cache_memory=32 << 20)
    server = AsyncEngine(llm, Metrics("tiny"))
    assert llm.engine.interrupt() is False
    server.abort(Group([]))
    assert llm.engine.interrupt() is True
