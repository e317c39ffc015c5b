"""The scheduler and block manager driven alone: no model, sampled tokens made up by the test
(as vLLM's scheduler tests do). Each test states the rule it checks; the expected values are
worked out by hand from the rule, not by running the scheduler."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from minerva.engine.block_manager import BlockManager
from minerva.engine.output import OutputProcessor
from minerva.engine.request import Request, Status
from minerva.engine.sampler import SamplingParams, new_state
from minerva.engine.scheduler import Scheduler, SchedulerConfig
from minerva.errors import MinervaError
from minerva.formats.tokenizer import Tokenizer

VOCAB = 64
EOS = 1


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    backend = tokenizers.Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, bos_token_id=None, eos_token_id=EOS, vocab_size=VOCAB)


class Harness:
    def __init__(self, tokenizer, *, num_blocks=64, block_size=4, max_num_seqs=8, budget=256, chunk_seconds=0.0,
                 prefix_caching=False):
        self.tokenizer = tokenizer
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, chunk_seconds=chunk_seconds), self.blocks)
        self.arrival = 0.0

    def add(self, prompt_len: int, priority: int = 0, max_tokens: int = 16, first: int = 10) -> Request:
        self.arrival += 1.0
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        prompt = [first + i % 40 for i in range(prompt_len)]
        r = Request(prompt, params, priority=priority, arrival_time=self.arrival)
        r.sampler = new_state(params, prompt, "cpu")
        self.sched.add(r, OutputProcessor(r.request_id, self.tokenizer, params))
        return r

    def step(self, token: int = 20, results: dict | None = None):
        """Schedule, then hand back `token` (or results[request]) for every request that samples."""
        out = self.sched.schedule()
        sampled = []
        for s in out.scheduled:
            if not s.samples:
                sampled.append(None)
            elif results and s.request in results:
                sampled.append([(t, None) for t in results[s.request]])
            else:
                sampled.append([(token, None)])
        return out, self.sched.update_from_output(out, sampled)


def who(out) -> list[tuple[Request, int]]:
    return [(s.request, s.num_new_tokens) for s in out.scheduled]


def test_priority_then_arrival_order(tokenizer):
    h = Harness(tokenizer)
    a = h.add(5, priority=1)
    b = h.add(5, priority=0)
    c = h.add(5, priority=1)
    late_urgent = h.add(5, priority=0)
    out, _ = h.step()
    assert who(out) == [(b, 5), (late_urgent, 5), (a, 5), (c, 5)]


def test_token_budget_chunks_the_prompt_and_running_requests_go_first(tokenizer):
    h = Harness(tokenizer, budget=8)
    a = h.add(6)
    b = h.add(10)
    out, _ = h.step()
    assert who(out) == [(a, 6), (b, 2)]  # b gets what is left of the budget
    out, res = h.step()
    assert who(out) == [(a, 1), (b, 7)]  # a decodes its first sampled token; b's prompt goes on
    assert b.num_computed_tokens == 9 and b.num_output_tokens == 0 and not any(
        d.request_id == b.request_id for d in res.deltas)


def test_max_num_seqs_caps_the_running_set(tokenizer):
    h = Harness(tokenizer, max_num_seqs=2)
    a, b = h.add(3, max_tokens=1), h.add(3)
    c = h.add(3)
    out, res = h.step()
    assert [r for r, _ in who(out)] == [a, b] and c.status is Status.WAITING
    assert res.finished == [a] and a.finish_reason == "length"  # max_tokens=1: done after one token
    out, _ = h.step()
    assert who(out) == [(b, 1), (c, 3)]  # a's place is free now


def test_preemption_takes_the_lowest_priority_latest_and_admits_nobody(tokenizer):
    # 4 blocks of 4 tokens. Two running requests fill 3 blocks; the first one's next token
    # needs a fourth, the other's needs a fifth: the low-priority one gives way.
    h = Harness(tokenizer, num_blocks=4, block_size=4)
    hi = h.add(7, priority=0)  # 2 blocks
    lo = h.add(4, priority=1)  # 1 block, + 1 for its first sampled token's K/V later
    h.step()
    assert hi.num_computed_tokens == 7 and lo.num_computed_tokens == 4
    waiting = h.add(2, priority=0)  # needs one block
    out, _ = h.step()
    # hi computes its 8th token (its 2nd block has room); lo its 5th, which takes the last
    # free block; waiting finds none.
    assert [r for r, _ in who(out)] == [hi, lo] and h.blocks.num_free_blocks == 0
    out, _ = h.step()  # hi's 9th token needs a new block; none is free: lo (lowest, latest) goes
    assert [r for r, _ in who(out)] == [hi]
    assert h.sched.num_preemptions == 1
    assert lo.status is Status.WAITING and lo.num_computed_tokens == 0
    assert h.blocks.block_table(lo.request_id) == []
    assert waiting.status is Status.WAITING  # nobody admitted after a preemption
    out, _ = h.step()
    assert waiting in [r for r, _ in who(out)]  # the next step admits again (by priority)


def test_a_long_prompt_neither_stalls_decoding_nor_delays_new_prompts(tokenizer):
    """Decoding requests go before prompt chunks; while a request waits to start, running
    prompt chunks take at most half the budget, so it starts in the next step."""
    h = Harness(tokenizer, num_blocks=256, budget=16)
    early = h.add(3)
    h.step()  # early: prompt done, one token pending
    long = h.add(200)
    out, _ = h.step()
    assert who(out) == [(early, 1), (long, 15)]
    short = h.add(5)
    out, _ = h.step()
    assert who(out) == [(early, 1), (long, 8), (short, 5)]  # half the budget left for short
    out, _ = h.step()
    assert who(out) == [(early, 1), (short, 1), (long, 14)]  # nobody waits: no reserve


def test_prompt_chunks_take_about_chunk_seconds_while_someone_waits_on_a_token(tokenizer):
    """While a request decodes, a step's prompt chunks are cut to chunk_seconds at the
    measured time of a row, less the decoding rows: FIRST_CHUNK (64) before any measurement,
    never under MIN_CHUNK (16). With nobody waiting on a token, LONE_CHUNKS (4) times as long."""
    h = Harness(tokenizer, num_blocks=256, budget=256, chunk_seconds=0.5)
    alone = h.add(200)
    out, _ = h.step()
    assert who(out) == [(alone, 64)] and out.prompt_tokens == 64  # no row timed yet: FIRST_CHUNK
    h.sched.timed(out, [None], 64 / 128)  # a row: 1/128 s
    assert h.sched.row_seconds == 1 / 128
    out, _ = h.step()
    assert who(out) == [(alone, 136)]  # nobody else: 4 x 0.5 s is 256 rows (the budget); the rest of it
    h.sched.timed(out, [None], 136 / 128)
    long = h.add(600)
    out, _ = h.step()
    # alone decodes; 0.5 s is 64 rows, one of them alone's; long starts with the other 63
    assert who(out) == [(alone, 1), (long, 63)] and out.prompt_tokens == 63
    h.sched.timed(out, [None, None], 64 / 32)  # a row: 1/32 s now; the average: 5/256 s
    assert h.sched.row_seconds == 5 / 256
    out, _ = h.step()
    assert who(out) == [(alone, 1), (long, 24)]  # 0.5 s is 25.6 rows: 25, less alone's
    h.sched.timed(out, [None, None], 25 * 2.0)  # a row of 2 s: MIN_CHUNK rows still go
    out, _ = h.step()
    assert who(out) == [(alone, 1), (long, 16)]
    h.step(token=EOS)  # alone ends: nobody waits, long's chunks take 4 x 0.5 s
    out, _ = h.step()
    assert who(out) == [(long, 16)]  # rows of about 1 s: MIN_CHUNK
    h.sched.row_seconds = 1 / 64
    out, _ = h.step()
    assert who(out) == [(long, 128)]  # 2 s of rows
    h.sched.row_seconds = 1 / 1024
    out, _ = h.step()
    assert who(out) == [(long, 256)]  # never past the token budget


def test_without_chunk_seconds_a_prompt_takes_the_budget(tokenizer):
    h = Harness(tokenizer, num_blocks=256, budget=256, chunk_seconds=0.0)
    early = h.add(200)
    out, _ = h.step()
    assert who(out) == [(early, 200)]
    h.sched.timed(out, [None], 200.0)  # rows of a second each change nothing
    long = h.add(600)
    out, _ = h.step()
    assert who(out) == [(early, 1), (long, 255)]


def test_prompt_chunks_beside_many_decodes_take_as_many_rows_as_they(tokenizer):
    """However slow a row, prompt chunks get as many rows as the decodes beside them (when
    that is more than MIN_CHUNK): under many streams new prompts still start."""
    h = Harness(tokenizer, num_blocks=256, max_num_seqs=32, budget=256, chunk_seconds=0.5)
    streams = [h.add(3) for _ in range(20)]
    out, _ = h.step()
    h.sched.timed(out, [None] * 20, 60.0)  # 60 rows in 60 s: 0.5 s is no row at all
    late = h.add(100)
    out, _ = h.step()
    assert who(out) == [(r, 1) for r in streams] + [(late, 20)]


def test_before_any_measurement_a_prompt_beside_a_decode_takes_first_chunk(tokenizer):
    h = Harness(tokenizer, num_blocks=256, budget=256, chunk_seconds=0.5)
    early = h.add(3)
    out, _ = h.step()
    h.sched.timed(out, [None], 1.0)  # 3 rows: too few to time a row by
    assert h.sched.row_seconds is None
    long = h.add(200)
    out, _ = h.step()
    assert who(out) == [(early, 1), (long, 64)]


def test_a_prompt_waiting_behind_a_running_prompt_shares_chunk_seconds(tokenizer):
    """Nobody decodes, but short waits to start behind long's prompt: the step is still cut
    to chunk_seconds, and long's chunk to half of it."""
    h = Harness(tokenizer, num_blocks=256, budget=256, chunk_seconds=1.0)
    long = h.add(600)
    out, _ = h.step()
    assert who(out) == [(long, 64)]
    h.sched.timed(out, [None], 64 / 64)  # a row: 1/64 s, 1 s: 64 rows
    short = h.add(40)
    out, _ = h.step()
    assert who(out) == [(long, 32), (short, 32)]


def test_chunk_seconds_is_checked():
    for bad in (-1, float("nan"), float("inf"), "1", True):
        with pytest.raises(MinervaError, match="--prefill-chunk-seconds must be a finite number >= 0"):
            SchedulerConfig(chunk_seconds=bad)


def test_a_preempted_request_gives_back_the_token_it_was_given(tokenizer):
    # 4 blocks of 4 tokens. A decoding request is given its token before a running prompt's
    # chunk; it is also the lowest priority and latest, so it gives way (and its token is
    # taken back) when that chunk needs its block.
    h = Harness(tokenizer, num_blocks=4, block_size=4, budget=8)
    first = h.add(16, priority=0)
    h.step()  # 8 of its 16 prompt tokens: 2 blocks
    late = h.add(2, priority=1)
    out, _ = h.step()  # first: 4 more (half the budget, late waits): its 3rd block; late: the 4th
    assert who(out) == [(first, 4), (late, 2)] and h.blocks.num_free_blocks == 0
    out, _ = h.step()  # late's token first, then first's last 4 need a 4th block: late goes
    assert who(out) == [(first, 4)] and late.status is Status.WAITING and h.sched.num_preemptions == 1
    assert h.blocks.block_table(late.request_id) == []


def test_guesses_are_trimmed_to_the_budget(tokenizer):
    h = Harness(tokenizer, budget=3)
    r = h.add(2)
    h.step()
    h.step()  # one decode step: r now has 1 output token pending
    r.draft_token_ids = [30, 31, 32, 33]
    out, _ = h.step(results={r: [30, 31, 40]})
    # budget 3 = the pending token + 2 guesses; the other 2 guesses were dropped before running
    assert who(out) == [(r, 3)]
    assert r.output_token_ids == [20, 20, 30, 31, 40]
    assert r.num_computed_tokens == r.num_tokens - 1 and r.draft_token_ids == []


def test_guesses_never_preempt_another_request(tokenizer):
    h = Harness(tokenizer, num_blocks=2, block_size=4)
    a = h.add(3, priority=0)
    b = h.add(3, priority=1)
    h.step()  # each holds one block; a has 4 tokens, b has 4
    a.draft_token_ids = [30, 31, 32]  # would need a second block for a: none is free
    out, _ = h.step()
    assert who(out) == [(a, 1), (b, 1)] and h.sched.num_preemptions == 0 and a.draft_token_ids == []


def test_rejected_guesses_roll_back(tokenizer):
    h = Harness(tokenizer, block_size=4)
    r = h.add(3)
    h.step()  # 3 prompt tokens computed, 1 output token
    r.draft_token_ids = [30, 31, 32, 33, 34]
    out, res = h.step(results={r: [30, 45]})  # first guess accepted, second rejected -> 45
    assert who(out) == [(r, 6)]
    assert res.verified == [(r, 5, 1)]
    assert r.output_token_ids == [20, 30, 45]
    # K/V is kept for prompt (3) + the pending token + the accepted guess; 45 is pending
    assert r.num_computed_tokens == 5
    assert len(h.blocks.block_table(r.request_id)) == 2  # 5 tokens in blocks of 4: the third is given back


def test_eos_inside_accepted_guesses_ends_the_request(tokenizer):
    h = Harness(tokenizer)
    r = h.add(3)
    other = h.add(3)
    h.step()
    r.draft_token_ids = [30, EOS, 31]
    out, res = h.step(results={r: [30, EOS, 31, 32]})  # all accepted, plus a bonus token
    assert res.finished == [r] and r.finish_reason == "stop" and r.status is Status.FINISHED
    assert r.output_token_ids == [20, 30]  # EOS is not kept, nothing after it either
    delta = next(d for d in res.deltas if d.request_id == r.request_id)
    # token 20 went out in the first step's delta; this one carries 30 and the finish
    assert delta.token_ids == [30] and delta.finish_reason == "stop" and delta.text.strip() == "w30"
    assert h.blocks.block_table(r.request_id) == [] and r.request_id not in h.sched.outputs
    assert h.sched.running == [other]


def test_a_prompt_beginning_with_blocks_a_running_prompt_computes_waits_for_them(tokenizer):
    """Rule: with prefix caching, a new request whose prompt begins with the next block (and
    those before it) of a running request's prompt waits until they are computed, then takes
    them from the cache; an unrelated one starts as ever. Budget 8, blocks of 4: `a` (20
    tokens) computes 8, 8, 4; `b` (the same 20, then 2 more) starts after, with 20 cached."""
    h = Harness(tokenizer, budget=8, prefix_caching=True)
    a, b = h.add(20), h.add(22)
    plan = []
    for _ in range(4):
        out, _ = h.step()
        plan.append([(s.request, s.num_new_tokens) for s in out.scheduled])
    assert plan == [[(a, 8)], [(a, 8)], [(a, 4)], [(a, 1), (b, 2)]]
    assert h.blocks.prefix_hits == 20
    # an unrelated prompt (other tokens) and one sharing less than the block being computed start at once
    h = Harness(tokenizer, budget=8, prefix_caching=True)
    a, c, d = h.add(20), h.add(6, first=50), h.add(3)
    plan = [[(s.request, s.num_new_tokens) for s in h.step()[0].scheduled] for _ in range(3)]
    # c starts as soon as the budget allows (a's chunk halved for it), d too (it shares no whole block)
    assert plan[:2] == [[(a, 8)], [(a, 4), (c, 4)]] and (d, 3) in plan[2], plan
    # without prefix caching: nothing to wait for
    h = Harness(tokenizer, budget=8)
    a, b = h.add(20), h.add(22)
    plan = [[(s.request, s.num_new_tokens) for s in h.step()[0].scheduled] for _ in range(2)]
    assert plan == [[(a, 8)], [(a, 4), (b, 4)]]
