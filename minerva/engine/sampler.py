"""Sampling parameters and the sampler that applies them to a row of logits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from minerva.errors import MinervaError


MAX_LOGPROBS = 20
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

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        rules = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
            ("n", isinstance(self.n, int) and self.n >= 1, "an integer >= 1"),
            ("temperature", _finite(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
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
            ("seed", self.seed is None or isinstance(self.seed, int), "an integer"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int)
                                                   and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"an integer in [0, {MAX_LOGPROBS}]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "token ids >= 0"),
        ]
        for name, ok, what in rules:
            if not ok:
                raise MinervaError(f"invalid sampling parameter {name}={getattr(self, name)!r}: "
                                   f"must be {what}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplerState:
    """What one request's sampler remembers: its own generator and the tokens seen."""

    params: SamplingParams
    generator: torch.Generator
    seen: list[int] = field(default_factory=list)  # prompt and generated tokens
    generated: dict[int, int] = field(default_factory=dict)  # token -> times generated

    def record(self, token: int) -> None:
        self.seen.append(token)
        self.generated[token] = self.generated.get(token, 0) + 1


def new_state(params: SamplingParams, prompt_ids: list[int], device: torch.device) -> SamplerState:
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return SamplerState(params, gen, list(prompt_ids))


def process_logits(logits: torch.Tensor, state: SamplerState) -> torch.Tensor:
    """Apply the request's parameters to float32 logits [vocab]; removed tokens become -inf.

    Order: repetition penalty, presence/frequency penalties, logit bias (as vLLM applies
    them), then as in transformers' generation: temperature, top-k, top-p, min-p.
    """
    p = state.params
    logits = logits.float()
    if bool((torch.isnan(logits) | torch.isposinf(logits)).any()):
        raise MinervaError("the model produced NaN/inf logits (numeric overflow); "
                           "run with --dtype bfloat16 or float32")
    if p.repetition_penalty != 1.0 and state.seen:
        ids = torch.tensor(sorted(set(state.seen)), device=logits.device)
        picked = logits[ids]
        logits = logits.clone()
        logits[ids] = torch.where(picked > 0, picked / p.repetition_penalty,
                                  picked * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and state.generated:
        ids = torch.tensor(list(state.generated), device=logits.device)
        counts = torch.tensor(list(state.generated.values()), device=logits.device, dtype=logits.dtype)
        logits = logits.clone()
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
    if p.logit_bias:
        ids = torch.tensor([t for t in p.logit_bias if t < logits.shape[-1]], device=logits.device,
                           dtype=torch.int64)
        bias = torch.tensor([p.logit_bias[t] for t in p.logit_bias if t < logits.shape[-1]],
                            device=logits.device, dtype=logits.dtype)
        logits = logits.index_add(0, ids, bias)
    if p.greedy:
        return logits
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if p.top_p < 1.0:
        ascending, order = torch.sort(logits)
        drop = torch.softmax(ascending, -1).cumsum(-1) <= 1 - p.top_p
        drop[-1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(0, order, drop), -math.inf)
    if p.min_p > 0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), -math.inf)
    return logits


def sample(logits: torch.Tensor, state: SamplerState) -> int:
    """Pick the next token from float32 logits [vocab]."""
    logits = process_logits(logits, state)
    if state.params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=state.generator))


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability under the model's distribution (raw logits, before
    any sampling transform) and the `logprobs` most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, k) if k else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return TokenLogprob(token, float(logp[token]), pairs)
