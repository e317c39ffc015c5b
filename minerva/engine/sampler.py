"""Sampling parameters and the sampler that applies them to a row of logits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from minerva.engine.structured import StructuredOutput
from minerva.errors import MinervaError
from minerva.kernels import native


MAX_LOGPROBS = 20
MAX_SPECULATIVE = 16
GREEDY_BELOW = 1e-5  # temperatures this small divide logits into overflow; treat them as greedy


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy."""

    max_tokens: int = 256
    n: int = 1  # completions per prompt
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # prompt and output tokens (transformers / llama.cpp style)
    presence_penalty: float = 0.0  # OpenAI style: on tokens already generated
    frequency_penalty: float = 0.0  # OpenAI style: times each token was generated
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: int | None = None  # return the sampled token's logprob and this many alternatives
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    speculative_tokens: int | None = None  # guesses per step: None = the engine's setting, 0 = off
    # Leave special tokens out of the text; a chat reply whose reasoning parser reads markers
    # that are special tokens (harmony's) keeps them (see minerva/parsers/reasoning.py).
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # constrain the output (JSON schema, regex, choice, grammar)
    # Keep the last prompt token's final hidden state, L2-normalized, as Request.embedding
    # (what /v1/embeddings returns: last-token pooling)
    embedding: bool = False
    adapter: str | None = None  # the LoRA adapter to run with (its name when loaded; None: the base model)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name, what in (("stop", "a string or a list of strings"), ("stop_token_ids", "a list of token ids")):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise MinervaError(f"invalid sampling parameter {name}={getattr(self, name)!r}: must be {what}")
            object.__setattr__(self, name, tuple(getattr(self, name)))
        rules = [
            ("max_tokens", _integer(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("n", _integer(self.n) and self.n >= 1, "an integer >= 1"),
            ("temperature", _finite(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_k", _integer(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", _finite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", _finite(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", _finite(self.repetition_penalty) and self.repetition_penalty > 0,
             "a number > 0"),
            ("presence_penalty", _finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "in [-2, 2]"),
            ("frequency_penalty", _finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "in [-2, 2]"),
            ("logit_bias", isinstance(self.logit_bias, dict) and all(
                isinstance(k, int) and k >= 0 and _finite(v) and -100 <= v <= 100
                for k, v in self.logit_bias.items()), "a map of token id -> bias in [-100, 100]"),
            ("seed", self.seed is None or (_integer(self.seed) and -2**63 <= self.seed < 2**63),
             "an integer in [-2^63, 2^63)"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int)
                                                   and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"an integer in [0, {MAX_LOGPROBS}]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "token ids >= 0"),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool), "true or false"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "true or false"),
            ("structured", self.structured is None or isinstance(self.structured, StructuredOutput),
             "a minerva.engine.structured.StructuredOutput"),
            ("speculative_tokens", self.speculative_tokens is None or (
                isinstance(self.speculative_tokens, int) and 0 <= self.speculative_tokens <= MAX_SPECULATIVE),
             f"an integer in [0, {MAX_SPECULATIVE}]"),
        ]
        for name, ok, what in rules:
            if not ok:
                raise MinervaError(f"invalid sampling parameter {name}={getattr(self, name)!r}: "
                                   f"must be {what}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplerState:
    """What one request's sampler remembers: its own generator and the tokens seen."""

    params: SamplingParams
    generator: torch.Generator
    seen: dict[int, None] = field(default_factory=dict)  # prompt and generated tokens, once each
    generated: dict[int, int] = field(default_factory=dict)  # token -> times generated
    matcher: Any = None  # the llguidance matcher of a constrained request (minerva.engine.structured)

    def record(self, token: int) -> None:
        self.seen[token] = None
        self.generated[token] = self.generated.get(token, 0) + 1


def generator_seed(seed: int) -> int:
    """What a request's `seed` (any int64) seeds a CPU generator with: torch's CPU generator
    keeps a seed's low 32 bits only (5 and 5 + 2^32 drew alike, 0 and -2^63 too), so both halves
    go into them. Seeds in [0, 2^32) are themselves; 2^64 seeds onto 2^32 still meet somewhere,
    but no longer where seeds differ only in their high half or sign."""
    u = seed % 2**64
    return (u + (u >> 32) * 0x9E3779B1) % 2**32


def new_state(params: SamplingParams, prompt_ids: list[int], device: torch.device) -> SamplerState:
    gen = torch.Generator(device=device)
    if params.seed is not None:  # (a GPU's generator keeps all 64 bits)
        gen.manual_seed(generator_seed(params.seed) if gen.device.type == "cpu" else params.seed % 2**64)
    else:
        gen.seed()
    return SamplerState(params, gen, dict.fromkeys(prompt_ids))


# What to try when a model's logits come out NaN/inf, by the dtype it ran in: float16
# overflows past 65504, bfloat16 has float32's range but only 8 bits of mantissa. Weights that
# hold NaN give the same logits in every dtype: the last resort names them.
_OVERFLOW_ADVICE = {
    torch.float16: "numeric overflow in float16; run with --dtype bfloat16 or float32, and if that fails too, "
                   "the model's weights may be damaged",
    torch.bfloat16: "numeric overflow in bfloat16, or damaged weights; run with --dtype float32, and if that fails "
                    "too, the model's weights are damaged",
}


def check_logits(logits: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse logits with NaN or +inf, or a row of -inf (no token possible), with advice that
    fits `dtype`, the dtype the model ran in."""
    if not bool(torch.isfinite(logits.amax(-1)).all()):  # NaN propagates through amax, as does +inf
        advice = _OVERFLOW_ADVICE.get(dtype, f"it ran in {str(dtype).removeprefix('torch.')}, so no wider dtype "
                                             "helps: the model's weights may be damaged")
        raise MinervaError(f"the model produced NaN/inf logits ({advice})")


def _rows(states: list[SamplerState], want) -> list[int]:
    return [i for i, s in enumerate(states) if want(s)]


def _flat(rows: list[int], per_row, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, column) tensors for the token ids each row names."""
    r, c = [], []
    for i in rows:
        ids = per_row(i)
        r += [i] * len(ids)
        c += ids
    return (torch.tensor(r, dtype=torch.int64, device=device),
            torch.tensor(c, dtype=torch.int64, device=device))


TOP_P_HEAD = 256  # tokens first sorted for top_p; 8 times more while they hold less than top_p of the mass
TOP_P_GROWTH = 8


def _top_k(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    k = torch.tensor([p.top_k for p in ps], device=x.device)
    kth = torch.topk(x, int(k.max())).values.gather(1, (k - 1)[:, None])
    return x.masked_fill(x < kth, -math.inf)


def _top_p(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """A token stays while the probability ranked above it is under top_p (as transformers'
    warper; the most likely token always). Only the head of each row is sorted, as far as the
    top_p mass reaches: sorting whole rows took 3.8 ms a row over 49152 tokens. Each row takes
    the head or the whole-row sort by its own values, never by its batch's: the two ways can
    round a token at the top_p boundary differently, and a row's tokens must not depend on
    the rows beside it."""
    dev, vocab = x.device, x.shape[-1]
    limit = torch.tensor([p.top_p for p in ps], device=dev)[:, None]
    below = torch.tensor([1 - p.top_p for p in ps], device=dev)[:, None]  # the mass the sort drops (as transformers)
    probs = torch.softmax(x, -1)
    out = torch.full_like(x, -math.inf)
    rows = torch.arange(x.shape[0], device=dev)  # those not yet cut
    k = TOP_P_HEAD
    while rows.numel() and k <= vocab // TOP_P_GROWTH:  # a head of more than 1/8 of the row: sorting it all costs as much
        top, order = probs[rows].topk(k, dim=-1)
        reach = top.cumsum(-1)
        done = reach[:, -1] >= limit[rows, 0]
        if bool(done.any()):
            keep = (reach[done] - top[done]) < limit[rows[done]]
            keep[:, 0] = True
            at, o = rows[done], order[done]
            out[at] = out[at].scatter_(1, o, x[at].gather(1, o).masked_fill(~keep, -math.inf))
        going = ~done & (reach[:, -1] >= limit[rows, 0] / 2)  # far from top_p (a flat row): a larger head would not do
        flat = rows[~done & ~going]
        if flat.numel():
            out[flat] = _top_p_sorted(x[flat], below[flat])
        rows = rows[going]
        k *= TOP_P_GROWTH
    if rows.numel():  # rows as flat as this (or a small vocabulary): the whole row sorted, as transformers does
        out[rows] = _top_p_sorted(x[rows], below[rows])
    return out


def _top_p_sorted(x: torch.Tensor, below: torch.Tensor) -> torch.Tensor:
    ascending, order = torch.sort(x, dim=-1)
    drop = torch.softmax(ascending, -1).cumsum(-1) <= below
    drop[:, -1] = False  # always keep the most likely token
    return x.masked_fill(drop.scatter(1, order, drop), -math.inf)


def _min_p(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    probs = torch.softmax(x, -1)
    floor = torch.tensor([p.min_p for p in ps], device=x.device)[:, None] * probs.amax(-1, keepdim=True)
    return x.masked_fill(probs < floor, -math.inf)


def penalize(logits: torch.Tensor, states: list[SamplerState]) -> tuple[torch.Tensor, bool]:
    """float32 logits [B, vocab] after each row's repetition penalty, presence/frequency
    penalties and logit bias (as vLLM applies them), and whether any applied: then they are a
    copy, and the caller's logits stay as they are."""
    logits = logits.float()
    params = [s.params for s in states]
    if not any(_penalizes(p) for p in params):
        return logits, False
    dev, vocab = logits.device, logits.shape[-1]
    logits = logits.clone()
    rows = _rows(states, lambda s: s.params.repetition_penalty != 1.0 and s.seen)
    if rows:
        r, c = _flat(rows, lambda i: list(states[i].seen), dev)
        pen = torch.tensor([params[i].repetition_penalty for i in r.tolist()], device=dev)
        picked = logits[r, c]
        logits[r, c] = torch.where(picked > 0, picked / pen, picked * pen)

    rows = _rows(states, lambda s: (s.params.presence_penalty or s.params.frequency_penalty)
                 and s.generated)
    if rows:
        r, c = _flat(rows, lambda i: list(states[i].generated), dev)
        counts = torch.tensor([n for i in rows for n in states[i].generated.values()],
                              device=dev, dtype=logits.dtype)
        pres = torch.tensor([params[i].presence_penalty for i in r.tolist()], device=dev)
        freq = torch.tensor([params[i].frequency_penalty for i in r.tolist()], device=dev)
        logits[r, c] -= pres + freq * counts

    rows = _rows(states, lambda s: s.params.logit_bias)
    if rows:
        r, c = _flat(rows, lambda i: list(params[i].logit_bias), dev)
        bias = torch.tensor([b for i in rows for b in params[i].logit_bias.values()], device=dev)
        keep = c < vocab
        logits.index_put_((r[keep], c[keep]), bias[keep], accumulate=True)

    return logits, True


def process_batch(logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
    """Apply each row's parameters to float32 logits [B, vocab]; removed tokens become -inf.

    Order: the penalties and logit bias (`penalize`), then as in transformers' generation:
    temperature, top-k, top-p, min-p. Greedy rows stop after the bias. Every operation works
    row by row, so a row's result does not depend on which other rows share the batch.
    """
    logits, penalized = penalize(logits, states)
    params = [s.params for s in states]
    dev, vocab = logits.device, logits.shape[-1]
    rows = _rows(states, lambda s: not s.params.greedy)
    if not rows:
        return logits
    # Rows are copied out and back only where some of the batch is greedy: over a 49152-token
    # vocabulary each of those copies took 1-2 ms for 32 rows.
    every = len(rows) == len(states)
    idx = None if every else torch.tensor(rows, device=dev)
    temps = torch.tensor([params[i].temperature for i in rows], device=dev)
    sub = (logits if every else logits[idx]) / temps[:, None]  # a new tensor either way

    def apply(want, fn):
        nonlocal sub
        picked = [j for j, i in enumerate(rows) if want(params[i])]
        if len(picked) == len(rows):
            sub = fn(sub, [params[i] for i in rows])
        elif picked:
            j = torch.tensor(picked, device=dev)
            sub[j] = fn(sub[j], [params[rows[k]] for k in picked])

    apply(lambda p: 0 < p.top_k < vocab, _top_k)
    apply(lambda p: p.top_p < 1.0, _top_p)
    apply(lambda p: p.min_p > 0, _min_p)
    if every:
        return sub
    if not penalized:
        logits = logits.clone()
    logits[idx] = sub
    return logits


def process_logits(logits: torch.Tensor, state: SamplerState) -> torch.Tensor:
    """process_batch for one row of logits [vocab]."""
    return process_batch(logits[None], [state])[0]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of [N, V] float32, by the native kernel on a CPU (torch's argmax took 43 us
    over a 49152-token row, and 1.3 ms over 32 of them, where its max took 6 us a row)."""
    kernels = native.for_tensor(x)
    if kernels is not None and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and x.shape[-1]:
        return kernels.argmax_rows(x)
    return x.argmax(-1)


def _penalizes(p: SamplingParams) -> bool:
    return bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.logit_bias)


def plain(s: SamplerState) -> bool:
    """Whether the row's token depends on its logits (and generator) alone: no penalties or
    bias, which read the tokens before it, and no grammar."""
    return s.matcher is None and not _penalizes(s.params)


def plain_greedy(s: SamplerState) -> bool:
    """Whether the row's token is its logits' argmax: greedy, no penalties or bias, no grammar."""
    return s.params.greedy and plain(s)


def greedy_tokens(logits: torch.Tensor, dtype: torch.dtype, cpu: bool) -> list[int]:
    """Each row's argmax of float32 logits [B, vocab] that `check_logits` has not seen, refusing
    what it refuses (NaN, +inf, a row of -inf); on a CPU (`cpu`, the runner's device) one
    native call does both."""
    kernels = native.load() if cpu else None
    if kernels is None or logits.dtype != torch.float32 or not logits.is_contiguous() or not logits.shape[-1]:
        check_logits(logits, dtype)
        return argmax_rows(logits.float()).tolist()
    tokens = kernels.greedy_rows(logits)
    if -1 in tokens:
        check_logits(logits, dtype)  # raises, with its advice
    return tokens


def sample_batch(logits: torch.Tensor, states: list[SamplerState]) -> list[int]:
    """Pick each row's next token from float32 logits [B, vocab], each with its own generator.

    Sampling inverts the cumulative distribution at one uniform draw from the row's
    generator, so a seeded request draws the same tokens whatever else is in the batch.
    On a CPU with the native kernels, temperature, top-k, top-p, min-p and the draw run as
    one kernel over each row (`sample_rows` in minerva/kernels/csrc/sampling.cpp): torch's
    ops took 27 ms for 32 rows of a 49152-token vocabulary with top_p, the kernel 1.8 ms.
    Greedy rows without penalties or bias take their argmax straight away (what the general
    path computes for them, with less Python: decode steps run this once a token).
    """
    if all(s.params.greedy and not _penalizes(s.params) for s in states):
        return argmax_rows(logits.float()).tolist()
    rows = _rows(states, lambda s: not s.params.greedy)
    kernels = native.for_tensor(logits)
    if not rows or kernels is None or logits.dim() != 2 or not logits.shape[-1]:
        processed = process_batch(logits, states)
        if not rows:
            return argmax_rows(processed).tolist()
        return _draw(processed, states, rows)
    penalized, _ = penalize(logits, states)
    dev, vocab = logits.device, logits.shape[-1]
    every = len(rows) == len(states)
    ps = [states[i].params for i in rows]
    tokens = kernels.sample_rows(
        (penalized if every else penalized[torch.tensor(rows, device=dev)]).contiguous(),
        torch.tensor([p.temperature for p in ps], dtype=torch.float32),
        torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in ps], dtype=torch.int64),
        torch.tensor([p.top_p for p in ps], dtype=torch.float64),
        torch.tensor([p.min_p for p in ps], dtype=torch.float32), _uniforms(states, rows, dev)).tolist()
    if every:
        return tokens
    out = argmax_rows(penalized).tolist()
    for i, t in zip(rows, tokens):
        out[i] = t
    return out


def _uniforms(states: list[SamplerState], rows: list[int], device) -> torch.Tensor:
    """One float64 draw in [0, 1) from each of the rows' generators."""
    return torch.cat([torch.rand(1, generator=states[i].generator, dtype=torch.float64, device=device)
                      for i in rows])


def _draw(processed: torch.Tensor, states: list[SamplerState], rows: list[int]) -> list[int]:
    """sample_batch with torch ops, from logits `process_batch` made."""
    u = _uniforms(states, rows, processed.device)
    if len(rows) == len(states):
        return invert_cdf(torch.softmax(processed, -1), u).tolist()
    tokens = argmax_rows(processed)
    idx = torch.tensor(rows, device=processed.device)
    tokens[idx] = invert_cdf(torch.softmax(processed[idx], -1), u)
    return tokens.tolist()


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of (unnormalized) probabilities [B, vocab] the token where its CDF first
    exceeds u [B] (float64 uniforms in [0, 1)) times the row's total."""
    kernels = native.for_tensor(probs)
    if kernels is not None and probs.dtype in (torch.float32, torch.float64) and probs.dim() == 2 and probs.shape[-1]:
        # the same answer (tested against invert_cdf_torch), without a float64 copy of the rows
        return kernels.invert_cdf_rows(probs.contiguous(), u.to(torch.float64).contiguous())
    return invert_cdf_torch(probs, u)


def invert_cdf_torch(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """invert_cdf in torch ops: on devices without the native kernel."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u[:, None] * total, right=True)
    # u * total can round up to total; the last token with mass is then the answer
    last = (cdf < total).sum(-1, keepdim=True)
    return torch.minimum(drawn, last)[:, 0]


def sample(logits: torch.Tensor, state: SamplerState) -> int:
    """Pick the next token from float32 logits [vocab]."""
    return sample_batch(logits[None], [state])[0]


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability under the model's distribution (raw logits, before
    any sampling transform) and the `logprobs` most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """For rows of raw logits [B, vocab]: each chosen token's logprob and its row's top ks[i]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    kmax = max(ks)
    top_v, top_i = (torch.topk(logp, kmax) if kmax else (logp[:, :0], logp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprob(t, lp, _top(logp[row], top_i[row][:k], top_v[row][:k]))
            for row, (t, lp, k) in enumerate(zip(tokens, chosen, ks))]


def _top(logp: torch.Tensor, ids: list[int], values: list[float]) -> tuple[tuple[int, float], ...]:
    """A row's top k (ids, values of a top-k of at least k), the same whatever k the batch's
    other rows want: equal values in id order, and of the tokens tied at the k-th value the
    lowest ids (topk alone picks among ties as the size it was asked for falls)."""
    if not ids:
        return ()
    edge = values[-1]
    above = sorted(((i, v) for i, v in zip(ids, values) if v > edge), key=lambda p: (-p[1], p[0]))
    tied = (logp == edge).nonzero()[:, 0][:len(ids) - len(above)].tolist()
    return tuple(above + [(i, edge) for i in tied])

