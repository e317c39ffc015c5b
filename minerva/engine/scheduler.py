"""Which tokens of which requests to compute in the next step.

No prefill or decode phase: every request has `num_computed_tokens`, and each step
gives running requests their next token(s) and new prompts chunks of their prompt,
within a token budget and a cap on running requests. Order is priority, then
arrival. When KV blocks run out, the lowest-priority, latest running request is
preempted: its blocks are freed and it is recomputed later (mostly from the prefix
cache).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from minerva.engine.block_manager import BlockManager
from minerva.engine.request import Request, Status
from minerva.errors import MinervaError


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise MinervaError(f"--{name.replace('_', '-')} must be an integer >= 1")


@dataclass(frozen=True)
class Scheduled:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """After this step all of the request's tokens (and guesses) are computed: sample."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_pending


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: list[Request] = []  # kept sorted by Request.order
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.order)

    def abort(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)
        request.status = Status.FINISHED

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.request_id)
        request.status = Status.FINISHED

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
        self.add(request)

    def schedule(self) -> list[Scheduled]:
        budget = self.config.max_num_batched_tokens
        out: list[Scheduled] = []
        preempted = False
        self.running.sort(key=lambda r: r.order)
        for req in list(self.running):
            if req not in self.running or budget == 0:
                continue  # preempted by an earlier request in this loop
            need = req.num_tokens - req.num_computed_tokens
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
                if victim is req:
                    break
            if req in self.running:
                out.append(Scheduled(req, n))
                budget -= n
        # New requests only when nobody had to give way this step.
        for req in list(self.waiting):
            if preempted or budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if req.blocked:
                continue
            rid, tokens = req.request_id, req.all_token_ids
            hit = self.blocks.allocate(rid, tokens, 0)  # take the cached prefix, if any
            if hit is None:
                break
            n = min(len(tokens) - hit, budget)
            if self.blocks.allocate(rid, tokens, hit + n) is None:
                self.blocks.free(rid)
                break
            self.waiting.remove(req)
            req.num_computed_tokens = hit
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(Scheduled(req, n))
            budget -= n
        return out
