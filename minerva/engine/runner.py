"""Builds one flat batch from the scheduled requests, runs the model, samples.

All scheduled tokens of all requests go through one forward: token ids, their
positions, the KV slot each new token writes, each request's block table and
key count, and which rows need logits. Prefill chunks, decode steps and
speculative verification (1 + k tokens) all take this same path.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from minerva.engine.rejection import accepted, greedy_verify, probabilities, sample_along, states_along, verify
from minerva.engine.sampler import check_logits, greedy_tokens, plain, plain_greedy, sample_batch, token_logprobs
from minerva.engine.scheduler import Sampled, Scheduled, SchedulerOutput
from minerva.engine.step_batch import DRAFT, FORWARD, STOP, Seq, StepBatch
from minerva.engine.structured import apply_mask_, constraint_failed, fill_masks
from minerva.kernels.attention import EMPTY, PagedKVCache, attention_kernel, paged_attention
from minerva.models.causal_lm import CausalLM
from minerva.models.layers import AttentionContext


@dataclass
class PagedBackend:
    """Attention metadata of one step, handed to every layer through AttentionContext. The
    slots and tables are per group of the cache's layout (`minerva.kernels.kv_layout`):
    a layer writes and reads through its own group's."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [G, T] slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int64
    seq_lens: torch.Tensor  # [B] int64, keys per request after this step
    block_tables: torch.Tensor  # [G, B, max blocks] int64, zero-padded
    positions: torch.Tensor  # [T]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        g = self.cache.layout.layer_group[layer]
        self.cache.write(layer, k, v, self.slot_mapping[g])
        return paged_attention(q, self.cache, layer, query_start_loc=self.query_start_loc,
                               seq_lens=self.seq_lens, block_tables=self.block_tables[g],
                               positions=self.positions, window=window, scale=scale, sinks=sinks)

    def stack_args(self, num_layers: int, dtype: torch.dtype) -> tuple | None:
        """What the fused decoder layers 0 .. num_layers - 1 need to store and attend over this
        step's K/V (each layer's pools, scales, slots and block tables as lists, then the
        step's lengths and positions), or None when the backend's attention kernel does not
        cover this pool or dtype."""
        c = self.cache
        static = c.stack_static.get((num_layers, dtype))
        if static is None:  # the pools, scales and groups are the same every step: listed once
            static = ()
            if attention_kernel(dtype, c) is not None:
                ks, vs = c.scales["k"], c.scales["v"]
                none = [EMPTY] * num_layers
                static = (c.data["k"][:num_layers], c.data["v"][:num_layers], none if ks is None else ks[:num_layers],
                          none if vs is None else vs[:num_layers], c.layout.layer_group[:num_layers])
            c.stack_static[(num_layers, dtype)] = static
        if not static:
            return None
        *pools, groups = static
        slots, tables = self.slot_mapping.unbind(0), self.block_tables.unbind(0)
        return (*pools, [slots[g] for g in groups], [tables[g] for g in groups],
                self.seq_lens, self.query_start_loc, self.positions)

    def kernel_args(self, layer: int, dtype: torch.dtype) -> tuple | None:
        """stack_args for one layer: its own pools, scales, slots and table."""
        args = self.stack_args(layer + 1, dtype)
        return None if args is None else (*(per_layer[layer] for per_layer in args[:6]), *args[6:])


def burstable(r) -> bool:
    """Whether a request's decode steps can run in a burst (`ModelRunner._burst`): each token
    sampled from its logits alone (`plain`), no logprobs, not an embedding."""
    return plain(r.sampler) and r.params.logprobs is None and not r.params.embedding


_MASKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minerva-masks")  # see ModelRunner.execute
__all__ = ["DRAFT", "FORWARD", "ModelRunner", "PagedBackend", "Seq"]


def prepare(output: SchedulerOutput) -> list[Seq]:
    """Each scheduled request's part of the forward: its new tokens from where its KV stops,
    its block tables, and the rows that need logits (1 + its guesses when it samples)."""
    seqs = []
    for s, tables in zip(output.scheduled, output.block_tables):
        r = s.request
        lo = r.num_computed_tokens
        rows = (1 + len(r.draft_token_ids)) if s.samples else 0
        seqs.append(Seq(r.pending_token_ids[lo:lo + s.num_new_tokens], lo, tables, rows, r.adapter))
    return seqs

class ModelRunner:
    """Runs forwards over the paged pool. Under tensor parallelism (`comm`) the leader
    (rank 0) broadcasts each forward's batch as one int64 vector and every rank runs it on
    its shard; the followers do so in `follow` until the leader's `stop`. `kind` tells the
    target's forwards (FORWARD) from those of a draft that shares its shards (DRAFT: the
    early exit of `--speculative self`, over a pool of its own)."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, device: torch.device, comm=None,
                 kind: int = FORWARD):
        self.model, self.cache, self.device = model, cache, device
        self._step: StepBatch | None = None  # the last forward's batch (`forward`)
        self._last: tuple | None = None  # its token ids and context, when they view that buffer
        self.block_size = cache.block_size
        self.comm, self.kind = comm, kind
        self.hidden_rows: torch.Tensor | None = None
        # only a windowed group's tables hold NULL (-1) entries (minerva/engine/block_manager.py)
        self.windowed = any(w is not None for w in cache.layout.group_windows)
        self.cpu = device.type == "cpu"
        self.adapters = None  # the model's LoRA adapters (minerva.models.lora.Adapters), when it has any

    def forward(self, seqs: list[Seq], check: bool = True, keep: bool = False) -> torch.Tensor | None:
        """One forward over every sequence's tokens; float32 logits of the rows asked for, in
        order (None if none), refused if NaN/+inf unless `check` is False (the caller checks).
        The rows' LoRA adapters stay selected after it with `keep` (a burst's next forwards;
        the caller clears them)."""
        batch = self._step = StepBatch.pack(seqs, self.cache.layout.num_groups, self.block_size, self.kind)
        if self.comm is not None:
            self.comm.broadcast(batch.tensor)
        if self.adapters is None:
            return self._run(batch.tensor, batch.header, check)
        self.adapters.select([s.adapter for s in seqs], [len(s.token_ids) for s in seqs], self.device)
        try:
            return self._run(batch.tensor, batch.header, check)
        finally:
            if not keep:
                self.adapters.clear()

    @torch.inference_mode()
    def _run(self, step: torch.Tensor, header: list[int] | None = None, check: bool = True) -> torch.Tensor | None:
        """prepare (the step's views and attention metadata) -> forward -> the logits asked for."""
        v = StepBatch.unpack(step, self.cache.layout.num_groups, self.device, header)
        ids, pos, logit_rows, T, L = v.ids, v.positions, v.logit_rows, v.ids.shape[0], v.logit_rows.shape[0]
        # a windowed group's entries behind its window (NULL) are never read: 0 stands in
        backend = PagedBackend(self.cache, v.slots, v.query_start_loc, v.seq_lens,
                               v.tables.clamp(min=0) if self.windowed else v.tables, pos)
        ctx = AttentionContext(pos, backend)
        self._last = None
        if L == T:  # every row (decode steps, as the rows are asked for in order): with the layers
            hidden, logits = self.model.forward_logits(ids, ctx)
            self.hidden_rows = hidden  # the final hidden states the logits come from (embeddings)
            self._last = None if v.copied else (ids, ctx)  # views of the buffer a burst advances
        else:
            hidden = self.model(ids, ctx)
            if not L:
                return None
            self.hidden_rows = hidden[logit_rows]
            logits = self.model.logits(self.hidden_rows)
        if check and logits is not None:  # None on a tensor-parallel follower: the leader gathers them
            check_logits(logits, hidden.dtype)  # hidden is in the model's dtype; logits are float32
        return logits

    def follow(self, draft: ModelRunner | None = None) -> None:
        """A tensor-parallel follower's loop: run each forward the leader broadcasts (on
        `draft` for a draft's step), until it stops."""
        runners = {FORWARD: self, DRAFT: draft}
        while True:
            step = self.comm.broadcast(None)
            kind = StepBatch.kind_of(step)
            if kind == STOP:
                return
            runners[kind]._run(step)

    def stop(self) -> None:
        """The leader's last broadcast: the followers leave `follow`."""
        if self.comm is not None:
            self.comm.broadcast(StepBatch.stop())

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, interrupt=None) -> list[Sampled | None]:
        """Run the step; for each request that samples, its new tokens (with logprobs if
        asked): one token, with guesses (request.draft_token_ids) the accepted guesses and
        one more, in a burst (Scheduled.steps) one per forward. `interrupt()` true ends a
        burst after the forward in progress (the server: a request arrived)."""
        batch = output.scheduled
        seqs = prepare(output)
        steps = min(s.steps for s in batch)
        if steps > 1 and self.comm is None and all(burstable(s.request) for s in batch):
            try:
                return self._burst(batch, seqs, steps, interrupt)
            finally:
                if self.adapters is not None:
                    self.adapters.clear()
        if all(seq.logit_rows >= 1 and s.request.params.greedy and burstable(s.request) for s, seq in zip(batch, seqs)):
            # plain greedy rows, nothing else asked (most decode steps, and greedy verification):
            # each row's argmax, with the NaN/inf check, in one native call, and a request's
            # guesses kept while each is its row's argmax (what the path below computes, with
            # less Python)
            logits = self.forward(seqs, check=False)
            if logits is None:
                return [None] * len(batch)
            best = greedy_tokens(logits, self.hidden_rows.dtype, self.cpu)
            out, row = [], 0
            for s, seq in zip(batch, seqs):
                drafts = s.request.draft_token_ids if seq.logit_rows > 1 else []
                out.append([(t, None) for t in accepted(best[row:row + seq.logit_rows], drafts)])
                row += seq.logit_rows
            return out
        # Structured output: the masks of this step's sampling rows depend only on the tokens
        # before it, so llguidance fills them on a worker thread while the forward runs.
        masked = [s.request.sampler.matcher for s, seq in zip(batch, seqs)
                  if seq.logit_rows == 1 and s.request.sampler.matcher is not None]
        width = self.model.config.vocab_size
        early = _MASKS.submit(fill_masks, masked, width) if masked else None
        try:
            logits = self.forward(seqs)
        except BaseException:
            if early is not None:  # the matchers are the worker's until it is done with them
                early.exception()
            raise
        return self._sample(batch, seqs, logits, early)

    def _sample(self, batch: list[Scheduled], seqs: list[Seq], logits: torch.Tensor | None, early) -> list[Sampled | None]:
        """Each sampling request's tokens from its rows of `logits`: one row sampled (masked by
        its grammar, whose masks `early` computed during the forward), several verified."""
        out: list[Sampled | None] = [None] * len(batch)
        if logits is None:
            return out
        width = self.model.config.vocab_size
        plain, row = [], 0  # (batch index, logits row)
        for i, (s, seq) in enumerate(zip(batch, seqs)):
            if seq.logit_rows == 1:
                plain.append((i, row))
            elif seq.logit_rows > 1:
                out[i] = self._verify(s.request, logits[row:row + seq.logit_rows])
            row += seq.logit_rows
        if plain:
            rows = [r for _, r in plain]
            requests = [batch[i].request for i, _ in plain]
            # every row in order (decode steps): the logits themselves, not a copy (~40 us a step)
            selected = logits if rows == list(range(logits.shape[0])) else logits[torch.tensor(rows, device=self.device)]
            for j, r in enumerate(requests):
                if r.params.embedding and r.embedding is None:  # its first row is its last prompt token's
                    r.embedding = torch.nn.functional.normalize(self.hidden_rows[plain[j][1]].float(), dim=0)
            constrained = [j for j, r in enumerate(requests) if r.sampler.matcher is not None]
            if constrained:  # structured output: tokens the grammar forbids get -inf
                where = torch.tensor(constrained, device=self.device)
                masks = early.result()
                if selected.shape[-1] != width:  # logits of another width than the config's vocabulary
                    masks = fill_masks([requests[j].sampler.matcher for j in constrained], selected.shape[-1])
                selected[where] = apply_mask_(selected[where], masks)
            tokens = sample_batch(selected, [r.sampler for r in requests])
            for j in constrained:
                requests[j].sampler.matcher.consume_token(tokens[j])
                constraint_failed(requests[j])
            for (i, r), token in zip(plain, tokens):
                out[i] = [(token, None)]
            asked = [j for j, r in enumerate(requests) if r.params.logprobs is not None]
            if asked:
                lps = token_logprobs(selected[asked], [tokens[a] for a in asked],
                                     [requests[a].params.logprobs for a in asked])
                for a, lp in zip(asked, lps):
                    out[plain[a][0]] = [(tokens[a], lp)]
        return out

    def _burst(self, batch: list[Scheduled], seqs: list[Seq], steps: int, interrupt) -> list[Sampled]:
        """Up to `steps` forwards of one token per sequence, each sampled token fed back in,
        until a sequence samples a stop id of any of them (stop strings are the scheduler's,
        after the burst: tokens past one are computed and dropped) or `interrupt()`. The
        forwards after the first change its step buffer in place (each sequence's token,
        position, slots and length) and run on the tensors over it: greedy ones in one native
        call where the model takes it (CausalLM.greedy_steps), others one by one from here."""
        states = [s.request.sampler for s in batch]
        greedy = all(plain_greedy(st) for st in states)
        stops = set().union(*(s.stop_ids for s in batch))

        def pick(logits: torch.Tensor) -> list[int]:
            return greedy_tokens(logits, self.hidden_rows.dtype, self.cpu) if greedy else sample_batch(logits, states)

        def ends(tokens: list[int]) -> bool:
            return any(t in stops for t in tokens) or (interrupt is not None and interrupt())

        tokens = pick(self.forward(seqs, check=not greedy, keep=True))  # the same rows' adapters throughout
        out: list[Sampled] = [[(t, None)] for t in tokens]
        if ends(tokens):
            return out
        if greedy and self._last is not None:
            ran = self.model.greedy_steps(steps - 1, tokens, sorted(stops), self.block_size, interrupt, *self._last)
            if ran is not None:
                each, self.hidden_rows, logits = ran
                if -1 in each[-1]:
                    check_logits(logits, self.hidden_rows.dtype)  # raises, with its advice
                for tokens in each:
                    for o, t in zip(out, tokens):
                        o.append((t, None))
                return out
        for _ in range(steps - 1):
            self._step.advance(tokens, self.block_size)
            tokens = pick(self._next(check=not greedy))
            for o, t in zip(out, tokens):
                o.append((t, None))
            if ends(tokens):
                break
        return out

    def _next(self, check: bool) -> torch.Tensor:
        """The logits of the step buffer's forward again, after `_burst` changed it."""
        if self._last is None:  # its tensors are copies (another device): made anew
            return self._run(self._step.tensor, self._step.header, check)
        ids, ctx = self._last
        ctx.rope.clear()  # cos/sin of the positions before
        hidden, logits = self.model.forward_logits(ids, ctx)
        self.hidden_rows = hidden
        if check:
            check_logits(logits, hidden.dtype)
        return logits

    def _verify(self, r, logits: torch.Tensor) -> Sampled:
        drafts = r.draft_token_ids
        matcher, consumed = r.sampler.matcher, 0
        if matcher is not None:  # each row masked by the grammar's state after the guesses before it
            masks = []
            for j in range(len(drafts) + 1):
                masks.append(fill_masks([matcher], logits.shape[-1]))
                if j == len(drafts) or matcher.try_consume_tokens([drafts[j]]) != 1:
                    break  # a guess the grammar forbids has probability 0 in its row: rejected there
                consumed += 1
            apply_mask_(logits[:len(masks)], torch.cat(masks))
        states = states_along(r.sampler, drafts)
        if r.params.greedy:
            tokens = greedy_verify(logits, drafts, states)
        elif r.draft_probs is None:  # guessed deterministically
            tokens = sample_along(logits, drafts, states)
        else:
            tokens = verify(probabilities(logits, states), drafts, r.draft_probs, r.sampler.generator)
        if matcher is not None:
            matcher.rollback(consumed - (len(tokens) - 1))
            matcher.consume_token(tokens[-1])
            constraint_failed(r)
        if r.params.logprobs is None:
            return [(t, None) for t in tokens]
        lps = token_logprobs(logits[:len(tokens)], tokens, [r.params.logprobs] * len(tokens))
        return list(zip(tokens, lps))
