"""Speculative decoding: propose k tokens cheaply, verify them in one target forward.

A proposer guesses the next k tokens of a decoding request; the engine computes the
request's pending token and the k guesses in one forward of the target (the normal batch:
requests with and without guesses share the step), and the runner keeps a prefix of the
guesses by rejection sampling (`minerva/engine/rejection.py`), so each emitted token is
distributed exactly as without speculation.

Proposers:
- `ngram` (prompt lookup): the tokens that followed the most recent earlier occurrence of
  the longest suffix (up to 4 tokens) of the request's own prompt and output.
- `draft:MODEL`: a second model with the same vocabulary drafts k tokens, sampling with
  the request's parameters (its most likely tokens for a greedy or seeded request), over
  its own paged KV cache kept in step with the request.
- `self`: the target's own first layers with its final norm and head (early exit),
  as a draft model with its own KV for those layers.

How many guesses a step verifies adapts to what they buy (`Speculator.choose_k`): for each
request the engine keeps how far its runs of guesses got accepted (a Kaplan-Meier estimate,
runs that were all accepted counting as cut short, with recent steps weighing most), and for
the machine how long a step of so many rows took (guesses proposed and verified); it takes
the k that gives the most tokens per second, k = 0 (no guesses) included. One step in
EXPLORE verifies the most guesses allowed or, in turn, each smaller k, so both estimates keep
reaching every k. A seeded sampling request's guesses are deterministic and checked with the
sampler's own draws (`rejection.sample_along`), so its output is the same whatever k.

Speculation stands down where it would cost throughput: for a request whose guesses
are mostly rejected (it retries after a back-off), and for a step with more running
requests than `speculative_max_batch` (a large batch already keeps the compute busy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minerva.engine.block_manager import BlockManager
from minerva.engine.rejection import draw, probabilities, states_along
from minerva.engine.request import Request, Status
from minerva.engine.runner import DRAFT, ModelRunner, Seq
from minerva.engine.sampler import MAX_SPECULATIVE
from minerva.errors import MinervaError
from minerva.kernels.attention import PagedKVCache
from minerva.models.loader import LoadedModel

NGRAM_MAX, NGRAM_MIN = 4, 1


# -------------------------------------------------------------------- proposers

class NgramProposer:
    """Prompt lookup: continue the longest recent n-gram match in the request's own tokens."""

    def __init__(self, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, requests: list[Request], ks: list[int]) -> None:
        for r, k in zip(requests, ks):
            r.draft_token_ids = self.lookup(r.all_token_ids, k)
            r.draft_probs = None

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        n_tokens = len(tokens)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[n_tokens - n:]
            first = suffix[0]
            # most recent earlier occurrence that has at least one token after it
            for start in range(n_tokens - n - 1, -1, -1):
                if tokens[start] == first and tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []

    def finished(self, request: Request) -> None:
        pass


class EarlyExit:
    """The target's first `num_layers` layers, then its final norm and head: a draft model
    that shares every weight with the target."""

    def __init__(self, model, num_layers: int):
        self.model, self.num_layers = model, num_layers
        self.config = model.config

    def __call__(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        return self.model(input_ids, ctx, num_layers=self.num_layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def forward_logits(self, input_ids: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self(input_ids, ctx)
        return hidden, self.logits(hidden)


class ModelProposer:
    """A draft model (a second model, or the target's first layers) over its own paged KV
    pool: for each request it catches up on the tokens it has not seen, then drafts k
    tokens one step at a time, sampling with the request's parameters.

    It remembers which tokens its K/V were computed for, so whatever happened to its
    guesses (accepted, rejected, never verified), the next proposal reuses exactly the
    prefix that still matches the request and recomputes the rest.
    """

    def __init__(self, runner: ModelRunner, blocks: BlockManager):
        """`runner` runs the draft over its own pool, whose blocks `blocks` hands out."""
        self.runner, self.blocks = runner, blocks
        self.computed: dict[str, list[int]] = {}  # request id -> tokens whose K/V the draft holds

    def _valid(self, r: Request) -> int:
        held, real = self.computed.get(r.request_id, []), r.all_token_ids
        n = min(len(held), len(real) - 1)  # the last real token is always fed again
        i = 0
        while i < n and held[i] == real[i]:
            i += 1
        return i

    def propose(self, requests: list[Request], ks: list[int]) -> None:
        live = []
        for r, k in zip(requests, ks):
            r.clear_drafts()
            if self.blocks.allocate(r.request_id, r.all_token_ids, r.num_tokens + k - 1) is None:
                self.finished(r)  # no room in the draft pool: no guesses
                continue
            valid = self._valid(r)
            self.computed[r.request_id] = r.all_token_ids[:valid]
            live.append((r, k, []))
        while live:
            seqs = []
            for r, _, _ in live:
                held = self.computed[r.request_id]
                seqs.append(Seq((r.all_token_ids + r.draft_token_ids)[len(held):], len(held),
                                self.blocks.block_tables(r.request_id), 1))
            logits = self.runner.forward(seqs)
            probs = probabilities(logits, [states_along(r.sampler, r.draft_token_ids)[-1] for r, _, _ in live])
            nxt = []
            for i, (r, k, qs) in enumerate(live):
                self.computed[r.request_id] = r.all_token_ids + r.draft_token_ids
                token = int(probs[i].argmax()) if deterministic(r) else draw(probs[i], r.sampler.generator)
                r.draft_token_ids.append(token)
                qs.append(probs[i])
                if len(r.draft_token_ids) < k:
                    nxt.append((r, k, qs))
                else:
                    r.draft_probs = None if deterministic(r) else torch.stack(qs)
            live = nxt

    def finished(self, request: Request) -> None:
        self.computed.pop(request.request_id, None)
        self.blocks.free(request.request_id)


# --------------------------------------------------------------------- control

@dataclass
class SpecStats:
    """Counters for /metrics and `minerva bench`."""

    num_steps: int = 0  # request-steps that verified guesses
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_length: list[int] = field(default_factory=list)  # [i]: steps that accepted i guesses

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying step (accepted guesses + the one drawn)."""
        return 1 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0


class Acceptance:
    """How far runs of guesses get accepted: for each guess position i (1-based), the decayed
    count of verifications that reached it (`risk`: the guesses before it all accepted) and of
    those that rejected it there (`rejected`). A run accepted to its end is cut short (censored),
    not a rejection, so the estimate of long runs does not depend on the k that was asked."""

    def __init__(self, k: int, decay: float):
        self.decay = decay
        self.risk, self.rejected = [0.0] * (k + 1), [0.0] * (k + 1)

    def add(self, drafts: int, accepted: int) -> None:
        for i in range(1, len(self.risk)):
            self.risk[i] *= self.decay
            self.rejected[i] *= self.decay
        for i in range(1, min(accepted + 1, drafts, len(self.risk) - 1) + 1):
            self.risk[i] += 1.0
        if accepted < drafts and accepted + 1 < len(self.risk):
            self.rejected[accepted + 1] += 1.0

    def hazards(self, prior: list[float], weight: float) -> list[float]:
        """[i]: the chance that guess i is rejected given the ones before it were accepted,
        `prior` counting as `weight` verifications at each position."""
        return [0.0] + [(self.rejected[i] + weight * prior[i]) / (self.risk[i] + weight)
                        for i in range(1, len(self.risk))]


def expected_tokens(hazards: list[float], k: int) -> float:
    """Tokens a verifying step of k guesses emits on average: the one drawn, plus guess i for
    each i whose run survives (the product of 1 - hazard up to i)."""
    total, alive = 1.0, 1.0
    for i in range(1, k + 1):
        alive *= 1.0 - hazards[i]
        total += alive
    return total


class StepCosts:
    """Seconds a step of so many rows takes (guesses proposed and verified), a moving average
    per row count; counts never seen are interpolated between the nearest seen ones."""

    ALPHA = 0.25

    def __init__(self):
        self.seconds: dict[int, float] = {}

    def add(self, rows: int, seconds: float) -> None:
        was = self.seconds.get(rows)
        self.seconds[rows] = seconds if was is None else was + self.ALPHA * (seconds - was)

    def estimate(self, rows: int) -> float | None:
        if rows in self.seconds:
            return self.seconds[rows]
        below = [r for r in self.seconds if r < rows]
        above = [r for r in self.seconds if r > rows]
        if below and above:
            lo, hi = max(below), min(above)
            return self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (rows - lo) / (hi - lo)
        return None


@dataclass
class _Track:
    proposed: float = 0.0  # decayed counts of this request's guesses
    accepted: float = 0.0
    pause: int = 0  # steps to sit out
    backoffs: int = 0  # times in a row acceptance was poor: each doubles the next pause
    runs: Acceptance | None = None  # how far its runs of guesses get accepted


def deterministic(r: Request) -> bool:
    """A request whose draft guesses are its draft's most likely tokens (q one-hot): a greedy
    one, and a seeded one, whose output then does not depend on its guesses (`sample_along`)."""
    return r.params.greedy or r.params.seed is not None


class Speculator:
    """Chooses which decoding requests get guesses this step and how many, and keeps the stats."""

    DECAY = 0.8
    MIN_ACCEPTANCE = 0.25  # below this (decayed) a request's guesses cost more than they give
    BACKOFF = 16  # steps a request sits out after poor acceptance, doubling each time up to
    MAX_BACKOFF = 512
    RUN_DECAY = 0.95  # the acceptance runs' counts: the last ~20 verifications weigh most
    PRIOR = 0.2  # the rejection chance at each position before a request's own counts, ...
    PRIOR_WEIGHT = 2.0  # ... worth this many verifications
    EXPLORE = 8  # one step in this many verifies the most guesses allowed

    def __init__(self, proposer, num_tokens: int, max_batch: int):
        self.proposer, self.k, self.max_batch = proposer, num_tokens, max_batch
        self.stats = SpecStats(accepted_length=[0] * (num_tokens + 1))
        self.tracks: dict[str, _Track] = {}
        self.costs = StepCosts()
        self.pooled = Acceptance(num_tokens, self.RUN_DECAY)  # every request's runs: the prior of a new one
        self.steps = 0

    def propose(self, running: list[Request], room) -> None:
        """Set draft_token_ids on the eligible running requests. `room(r)` is how many more
        tokens the request may still produce."""
        crowded = len(running) > self.max_batch
        chosen, ks = [], []
        for r in running:
            k = self.k if r.params.speculative_tokens is None else min(r.params.speculative_tokens, self.k)
            if (k <= 0 or r.status is not Status.RUNNING or not r.output_token_ids
                    or r.num_computed_tokens != r.num_tokens - 1 or crowded):
                continue
            track = self.tracks.setdefault(r.request_id, _Track())
            if track.pause > 0:
                track.pause -= 1
                continue
            k = min(k, room(r) - 1)
            if k > 0:
                chosen.append(r)
                ks.append(k)
        if not chosen:
            return
        best = self.choose_k(chosen, len(running), ks)
        ks = [min(k, best) for k in ks]
        chosen, ks = [r for r, k in zip(chosen, ks) if k > 0], [k for k in ks if k > 0]
        if chosen:
            self.proposer.propose(chosen, ks)

    def choose_k(self, chosen: list[Request], running: int, caps: list[int] | None = None) -> int:
        """The guesses per request that emit the most tokens per second: one k for the step's
        `chosen` requests, each taking at most its cap of `caps`, on top of `running` rows
        (the step's rows without them); the tokens are their expected ones (each request's
        acceptance runs) plus the other requests' (one each), the
        seconds those measured for the step's rows. The most allowed where its cost is not
        known yet; one step in EXPLORE explores (the module's docstring)."""
        caps = caps or [self.k] * len(chosen)
        others = running - len(chosen)
        most = max(caps)
        self.steps += 1
        if self.steps % self.EXPLORE == 0:  # the most guesses, then in turn each smaller k, 0 included
            turn = self.steps // self.EXPLORE
            return most if turn % 2 else (turn // 2) % most
        prior = self.pooled.hazards([self.PRIOR] * (self.k + 1), self.PRIOR_WEIGHT)
        hazards = [self._runs(r).hazards(prior, self.PRIOR_WEIGHT) for r in chosen]

        def rows(k: int) -> int:
            return running + sum(min(k, c) for c in caps)

        if self.costs.estimate(rows(most)) is None:
            return most  # the most guesses' cost not known yet: measure it
        best, best_rate = most, None
        for k in range(most + 1):
            seconds = self.costs.estimate(rows(k))
            if seconds is None or seconds <= 0:
                continue
            tokens = sum(expected_tokens(h, min(k, c)) for h, c in zip(hazards, caps)) + others
            if best_rate is None or tokens / seconds > best_rate:
                best, best_rate = k, tokens / seconds
        return best

    def _runs(self, r: Request) -> Acceptance:
        t = self.tracks.setdefault(r.request_id, _Track())
        if t.runs is None:
            t.runs = Acceptance(self.k, self.RUN_DECAY)
        return t.runs

    def timed(self, rows: int, seconds: float) -> None:
        """A step of decodes only (one row each, plus its guesses) took `seconds`, from the
        guesses' proposal to the step's end."""
        self.costs.add(rows, seconds)

    def verified(self, request: Request, drafts: int, accepted: int) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_draft_tokens += drafts
        s.num_accepted_tokens += accepted
        s.accepted_length[accepted] += 1
        self._runs(request).add(drafts, accepted)
        self.pooled.add(drafts, accepted)
        t = self.tracks[request.request_id]
        t.proposed = t.proposed * self.DECAY + drafts
        t.accepted = t.accepted * self.DECAY + accepted
        if t.proposed >= 4 and t.accepted < self.MIN_ACCEPTANCE * t.proposed:
            t.pause = min(self.BACKOFF << t.backoffs, self.MAX_BACKOFF)
            t.backoffs += 1
            t.proposed = t.accepted = 0.0
        elif t.proposed >= 4:
            t.backoffs = 0

    def finished(self, request: Request) -> None:
        self.tracks.pop(request.request_id, None)
        self.proposer.finished(request)


def parse_method(method: str) -> tuple[str, str | None]:
    if method in ("ngram", "self"):
        return method, None
    if method.startswith("self:") and method[5:].isdigit() and int(method[5:]) > 0:
        return "self", method[5:]
    if method.startswith("draft:") and len(method) > len("draft:"):
        return "draft", method[len("draft:"):]
    raise MinervaError(f"unknown --speculative '{method}'; use ngram, self, self:LAYERS or draft:MODEL")


def check_speculative(method: str, num_tokens: int, max_batch: int) -> None:
    """Reject bad speculative settings before anything is loaded."""
    parse_method(method)
    if not isinstance(num_tokens, int) or not 1 <= num_tokens <= MAX_SPECULATIVE:
        raise MinervaError(f"--num-speculative-tokens must be an integer in [1, {MAX_SPECULATIVE}], got {num_tokens!r}")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise MinervaError(f"--speculative-max-batch must be an integer >= 1, got {max_batch!r}")


def _check_vocabulary(target_tok, draft_tok, name: str) -> None:
    a, b = target_tok.vocab_size, draft_tok.vocab_size
    if a != b or any(target_tok.id_to_token(i) != draft_tok.id_to_token(i) for i in range(a)):
        raise MinervaError(f"draft model '{name}' has a different vocabulary ({b} tokens vs the target's {a}, "
                           "or the same size with different tokens); use a draft from the same model family")


def draft_runner(model, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, comm=None) -> tuple[ModelRunner, BlockManager]:
    """A runner for a draft model over a pool of its own (float K/V, no prefix caching);
    `comm` for a draft whose weights are the tensor-parallel target's shards."""
    cache = PagedKVCache(num_layers, num_blocks, block_size, kv_heads, head_dim, k_format="auto",
                         v_format="auto", dtype=dtype, device=device)
    return (ModelRunner(model, cache, device, comm, kind=DRAFT),
            BlockManager(num_blocks, block_size, enable_prefix_caching=False))


def self_layers(method: str | None, config) -> int | None:
    """How many of the target's layers the early exit of `--speculative self[:LAYERS]` runs
    (None for the other methods)."""
    if not method:
        return None
    kind, arg = parse_method(method)
    if kind != "self":
        return None
    layers = int(arg) if arg else max(1, config.num_layers // 4)
    if layers >= config.num_layers:
        raise MinervaError(f"--speculative self:{layers} must use fewer layers than the model's {config.num_layers}")
    return layers


def early_exit_runner(model, layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, comm=None) -> tuple[ModelRunner, BlockManager]:
    """The runner of `--speculative self`: the target's first `layers` layers over a pool of
    their own. Under tensor parallelism every rank builds it on its shard (`comm`), and the
    followers run its forwards as the leader broadcasts them."""
    mc = model.config
    return draft_runner(EarlyExit(model, layers), layers, mc.num_kv_heads, mc.head_dim, num_blocks, block_size,
                        dtype, device, comm)


def build_speculator(method: str, num_tokens: int, max_batch: int, model, tokenizer, num_blocks: int,
                     block_size: int, dtype: torch.dtype, device: torch.device,
                     draft: LoadedModel | None = None, comm=None) -> Speculator:
    """The Speculator for `--speculative METHOD` (ngram, self[:LAYERS], draft:MODEL); for a
    draft model, `draft` is that model, already loaded (`LLM` loads it, whole, on rank 0);
    `comm`: the tensor-parallel group the target's shards (and so `self`'s) run in."""
    check_speculative(method, num_tokens, max_batch)
    kind, arg = parse_method(method)
    if kind == "ngram":
        return Speculator(NgramProposer(), num_tokens, max_batch)
    if kind == "self":
        parts = early_exit_runner(model, self_layers(method, model.config), num_blocks, block_size, dtype, device,
                                  comm)
    else:
        if draft is None:
            raise MinervaError(f"--speculative {method} needs the draft model loaded; pass it to the engine")
        _check_vocabulary(tokenizer, draft.tokenizer, arg)
        dc = draft.config
        parts = draft_runner(draft.model, dc.num_layers, dc.num_kv_heads, dc.head_dim, num_blocks, block_size,
                             dtype, device)
    return Speculator(ModelProposer(*parts), num_tokens, max_batch)
