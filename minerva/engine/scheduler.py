"""Which tokens of which requests to compute in the next step.

No prefill or decode phase: every request has `num_computed_tokens`, and each step
gives running requests their next token(s) and new prompts chunks of their prompt,
within a token budget and a cap on running requests. Order is priority, then
arrival, with two exceptions that keep latency bounded under long prompts: requests
past their prompt get their next token(s) before any prompt chunk, and while requests
wait to start, running prompt chunks take at most half the budget. While someone waits on
a token (a request decoding, or a new one waiting behind a running prompt), a step's
prompt chunks are also cut to about `chunk_seconds` of compute at the measured speed of a
row, so streams keep getting tokens while a long prompt is prefilled; with nobody waiting,
to about four times that, so a request that arrives waits no longer. A new request whose
prompt begins with blocks a running prompt is still computing waits for them, and takes
them from the prefix cache. When KV blocks run
out, the lowest-priority, latest running request is preempted: its blocks are freed and
it is recomputed later (mostly from the prefix cache).

A step is `schedule()` -> the runner computes it -> `update_from_output()`, which
owns what follows a forward: rolling back the K/V of rejected guesses, committing
newly full blocks to the prefix cache, appending tokens through each request's
`OutputProcessor` (detokenization and stop rules), and finishing requests.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field, replace

from minerva.engine.block_manager import BlockManager
from minerva.engine.output import OutputProcessor
from minerva.engine.request import Request, Status, StreamDelta
from minerva.engine.sampler import TokenLogprob
from minerva.errors import MinervaError

Sampled = list[tuple[int, TokenLogprob | None]]  # a request's new tokens in one step
# A burst lasts about this long at most (from the last decode step's time a forward), so that
# streams still get tokens about ten times a second: bursts pay where forwards are short and
# the Python between them is a large share; a 7B model's 0.15 s forwards run one at a time.
BURST_SECONDS = 0.1
# A step's prompt chunks while someone waits on a token: at least this many tokens (so prompts
# go on however slow a row is), and this many before a row's time has been measured.
MIN_CHUNK = 16
FIRST_CHUNK = 64
# With nobody waiting on a token, a step's prompt chunks take about this many times
# `chunk_seconds` (at least MIN_CHUNK tokens): a request that arrives during a long prompt's
# prefill waits for no longer a step (a 2048-token chunk deep into an 8K-token prompt took 8 s
# on 2 cores), and the prompt loses next to nothing (a CPU's prefill speed barely depends on
# the chunk's size from a hundred rows or so).
LONE_CHUNKS = 4


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 1 << 62  # prompt + output tokens a request may reach
    decode_steps: int = 1  # tokens each running request may decode in one step (a burst; see `_burst`)
    # while someone waits on a token, a step's prompt chunks take about this long (0: no limit
    # but the token budget)
    chunk_seconds: float = 0.0

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "decode_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise MinervaError(f"--{name.replace('_', '-')} must be an integer >= 1")
        if (not isinstance(self.chunk_seconds, (int, float)) or isinstance(self.chunk_seconds, bool)
                or not 0 <= self.chunk_seconds < float("inf")):
            raise MinervaError(f"--prefill-chunk-seconds must be a finite number >= 0 (0: chunks of the whole "
                               f"--max-num-batched-tokens), got {self.chunk_seconds!r}")


@dataclass(frozen=True)
class Scheduled:
    request: Request
    num_new_tokens: int
    # a decode burst: up to `steps` forwards of one token each, the K/V blocks of all of them
    # allocated, ending early at one of `stop_ids` (EOS and the request's stop tokens)
    steps: int = 1
    stop_ids: frozenset[int] | set[int] = frozenset()

    @property
    def samples(self) -> bool:
        """After this step all of the request's tokens (and guesses) are computed: sample."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_pending


@dataclass
class SchedulerOutput:
    """One step's work: who computes how many tokens, over which blocks."""

    scheduled: list[Scheduled]
    block_tables: list[list[list[int]]]  # per scheduled request, after allocation: a table per group
    prompt_tokens: int = 0  # of prompt chunks (and recomputation) among the tokens

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class StepResult:
    """What `update_from_output` did: the stream deltas, the requests that finished, and
    (request, guesses, accepted guesses) of each request that verified guesses."""

    deltas: list[StreamDelta] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    verified: list[tuple[Request, int, int]] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: list[Request] = []  # kept sorted by Request.order
        self.running: list[Request] = []
        self.outputs: dict[str, OutputProcessor] = {}  # request id -> its detokenizer and stop rules
        self.num_preemptions = 0
        self.forward_seconds: float | None = None  # of the last step of decodes, a forward (`timed`)
        self.row_seconds: float | None = None  # a token's share of a step with a prompt chunk (`timed`)

    def add(self, request: Request, output: OutputProcessor) -> None:
        self.outputs[request.request_id] = output
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        request.status = Status.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.order)

    def abort(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)

    def _release(self, request: Request) -> None:
        self.blocks.free(request.request_id)
        self.outputs.pop(request.request_id, None)
        request.status = Status.FINISHED

    def max_output_tokens(self, request: Request) -> int:
        """Output tokens the request may have in all (max_tokens, context)."""
        return min(request.params.max_tokens, self.config.max_model_len - len(request.prompt_token_ids))

    def room(self, request: Request) -> int:
        """How many more tokens the request may produce."""
        return self.max_output_tokens(request) - request.num_output_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @staticmethod
    def _trim_drafts(request: Request, keep: int) -> None:
        del request.draft_token_ids[keep:]
        if request.draft_probs is not None:
            request.draft_probs = request.draft_probs[:keep] if keep else None
        if not request.draft_token_ids:
            request.clear_drafts()

    def _preempt(self, request: Request) -> None:
        request.clear_drafts()
        self.running.remove(request)
        self.blocks.free(request.request_id)
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        self._enqueue(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out: list[Scheduled] = []
        preempted = False
        self.running.sort(key=lambda r: r.order)
        starting = len(self.running) < self.config.max_num_seqs and any(
            not r.blocked and not self._shares_prompt(r) for r in self.waiting)
        prompt_budget = self._prompt_budget(budget, starting)
        # While requests wait to start, running prompt chunks take at most half of it, so a
        # new prompt starts in the next step however long the prompt ahead of it is.
        running_prompt = prompt_budget - prompt_budget // 2 if starting else prompt_budget
        # Requests past their prompt (a token and any guesses to compute) go before prompt
        # chunks, so a long prompt never stalls the others' decoding.
        for req in sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.order)):
            if req not in self.running or budget == 0:
                continue  # preempted by an earlier request in this loop
            need = req.num_tokens - req.num_computed_tokens
            if need > 1:  # a prompt chunk (or a preempted request's recomputation)
                n = min(need, budget, running_prompt)
                if n == 0:
                    continue
                running_prompt -= n
                prompt_budget -= n
            else:
                if req.draft_token_ids and need + len(req.draft_token_ids) > budget:
                    self._trim_drafts(req, max(0, budget - need))
                n = min(need + len(req.draft_token_ids), budget)
            while self.blocks.allocate(req.request_id, req.pending_token_ids, req.num_computed_tokens + n) is None:
                if req.draft_token_ids:  # guesses never cost another request its place
                    req.clear_drafts()
                    n = min(need, budget)
                    continue
                victim = self.running[-1]  # lowest priority, latest arrival
                self._preempt(victim)
                preempted = True
                # it may have been given its token earlier in this loop (requests past their
                # prompt go first): take that back
                given = next((i for i, g in enumerate(out) if g.request is victim), None)
                if given is not None:
                    budget += out.pop(given).num_new_tokens
                if victim is req:
                    break
            if req in self.running:
                out.append(Scheduled(req, n))
                budget -= n
        # New requests only when nobody had to give way this step.
        for req in list(self.waiting):
            if preempted or min(budget, prompt_budget) == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if req.blocked or self._shares_prompt(req):
                continue
            rid, tokens = req.request_id, req.all_token_ids
            salt = b"lora:%d" % req.adapter if req.adapter else b""  # an adapter's K/V are its own
            hit = self.blocks.allocate(rid, tokens, 0, salt)  # take the cached prefix, if any
            if hit is None:
                break
            n = min(len(tokens) - hit, budget, prompt_budget)
            if self.blocks.allocate(rid, tokens, hit + n) is None:
                self.blocks.free(rid)
                break
            self.waiting.remove(req)
            req.num_computed_tokens = hit
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(Scheduled(req, n))
            budget -= n
            prompt_budget -= n
        if self.config.decode_steps > 1 and out and not preempted:
            out = self._burst(out)
        prompt_tokens = sum(s.num_new_tokens for s in out if s.request.num_tokens - s.request.num_computed_tokens > 1)
        return SchedulerOutput(out, [self.blocks.block_tables(s.request.request_id) for s in out], prompt_tokens)

    def _shares_prompt(self, req: Request) -> bool:
        """Whether a waiting request's prompt begins with a block or more that a running request
        is still to compute in its own prompt (two requests with one long system prompt, sent
        together): it starts once they are computed, from the prefix cache, instead of
        computing them a second time beside it."""
        if not self.blocks.enable_prefix_caching:
            return False
        bs, tokens = self.blocks.block_size, req.all_token_ids
        usable = (len(tokens) - 1) // bs  # its last token it computes itself, for its logits
        for r in self.running:
            if r.num_computed_tokens >= len(r.prompt_token_ids) or r.adapter != req.adapter:
                continue
            # the next block r computes, and those before it, are shared: worth waiting for
            upto = (r.num_computed_tokens // bs + 1) * bs
            if upto <= min(usable * bs, len(r.prompt_token_ids)) and tokens[:upto] == r.all_token_ids[:upto]:
                return True
        return False

    def _prompt_budget(self, budget: int, starting: bool) -> int:
        """The prompt tokens this step may compute: while someone waits on a token (a request
        past its prompt, or one waiting to start behind a running prompt), about
        `chunk_seconds` of rows less the decoding requests' rows (at least MIN_CHUNK, and at
        least as many as those rows); else about LONE_CHUNKS times that (at least MIN_CHUNK);
        FIRST_CHUNK before a row has been timed; never more than the token budget."""
        if not self.config.chunk_seconds:
            return budget
        if self.row_seconds is None:
            return min(budget, FIRST_CHUNK)
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        if not (decoding or (starting and self.running)):
            return min(budget, max(MIN_CHUNK, int(LONE_CHUNKS * self.config.chunk_seconds / self.row_seconds)))
        rows = sum(1 + len(r.draft_token_ids) for r in decoding)
        # never fewer rows than the decodes beside them: under many streams prompts still start
        return min(budget, max(MIN_CHUNK, rows, int(self.config.chunk_seconds / self.row_seconds) - rows))

    def _burst(self, out: list[Scheduled]) -> list[Scheduled]:
        """Let a step of decodes only run up to `decode_steps` forwards in a row (the runner
        feeds each request's sampled token back in and returns them all), when nothing waits
        to start: the Python between two forwards (scheduling, detokenizing, streaming, ~0.6-
        0.9 ms a step on 2 cores) then comes once per burst. Each request gets the K/V blocks
        of all its steps now, or the step stays a single one; none is preempted for it."""
        if any(not r.blocked for r in self.waiting) or self.forward_seconds is None:
            return out  # a new prompt starts next step, not a burst later; or a step to time first
        steps = min(self.config.decode_steps, max(1, int(BURST_SECONDS / max(self.forward_seconds, 1e-6))))
        for s in out:
            r = s.request
            if s.num_new_tokens != 1 or r.draft_token_ids or r.num_tokens - r.num_computed_tokens != 1:
                return out
            steps = min(steps, self.room(r))
        if steps < 2:
            return out
        for s in out:
            r = s.request
            if self.blocks.allocate(r.request_id, r.all_token_ids, r.num_computed_tokens + steps) is None:
                return out  # what was allocated serves the next steps
        return [Scheduled(s.request, 1, steps, self.outputs[s.request.request_id].stop_ids) for s in out]

    # ------------------------------------------------------------ after the forward

    def timed(self, output: SchedulerOutput, sampled: list[Sampled | None], seconds: float) -> None:
        """Note how long the runner took for a step of decodes only (one token each, bursts
        included), a forward: what `_burst` sizes bursts by; and for a step with a prompt
        chunk of enough rows, a row's share (averaged with the last): what prompt chunks are
        cut to while someone waits on a token."""
        rows = sum(s.num_new_tokens for s in output.scheduled)
        if output.prompt_tokens and rows >= MIN_CHUNK:
            per_row = seconds / rows
            self.row_seconds = per_row if self.row_seconds is None else (self.row_seconds + per_row) / 2
        if all(s.num_new_tokens == 1 for s in output.scheduled):
            self.forward_seconds = seconds / max(1, max(len(t) for t in sampled if t) if any(sampled) else 1)

    def decode_rows(self, output: SchedulerOutput, sampled: list[Sampled | None]) -> int:
        """The rows of a step that decoded every running request once (each its pending token
        and its guesses, no prompt chunk, no burst), else 0: what speculation's k is chosen by."""
        rows = 0
        for s, tokens in zip(output.scheduled, sampled):
            drafts = len(s.request.draft_token_ids)
            if tokens is None or s.num_new_tokens != 1 + drafts or len(tokens) > 1 + drafts:
                return 0
            rows += s.num_new_tokens
        return rows if len(output.scheduled) == len(self.running) else 0

    def update_from_output(self, output: SchedulerOutput, sampled: list[Sampled | None]) -> StepResult:
        """Advance each scheduled request by what the step computed and, for those that
        sampled, by their new tokens (with guesses: the accepted ones and one more)."""
        result = StepResult()
        now = time.monotonic()
        for s, tokens in zip(output.scheduled, sampled):
            r = s.request
            computed = r.num_computed_tokens + s.num_new_tokens
            drafts = len(r.draft_token_ids) if s.samples else 0
            if drafts and tokens is not None:  # K/V of rejected guesses is dropped
                accepted = len(tokens) - 1
                computed -= drafts - accepted
                self.blocks.rollback(r.request_id, computed)
                result.verified.append((r, drafts, accepted))
            elif tokens is not None:  # a burst: K/V of every token fed back in
                computed += len(tokens) - 1
            r.clear_drafts()
            r.num_computed_tokens = computed
            if tokens is None:  # a prompt chunk short of the end
                self.blocks.commit(r.request_id, r.all_token_ids, computed)
                continue
            r.first_token_time = r.first_token_time or now
            out = self.outputs[r.request_id]
            finish = self._append(r, out, tokens)
            if r.error is not None:  # its constraint could not be followed: what it wrote is not kept to it
                finish = "error"
            self.blocks.commit(r.request_id, r.all_token_ids, min(computed, r.num_tokens))
            if finish:
                r.finish_reason = finish
                self.finish(r)
                result.finished.append(r)
            delta = out.delta(finish)
            if delta is not None:
                result.deltas.append(delta if r.error is None else replace(delta, error=r.error))
        return result

    def _append(self, r: Request, out: OutputProcessor, tokens: Sampled) -> str | None:
        """Record the request's new tokens, keeping those its stop rules keep; the finish
        reason, if one of them ends it."""
        room = self.max_output_tokens(r)
        for token, logprob in tokens:
            r.sampler.record(token)
            keep, finish = out.add(token, last_allowed=r.num_output_tokens + 1 >= room, logprob=logprob)
            if keep:
                r.all_token_ids.append(token)
            if finish:
                return finish
        return None
