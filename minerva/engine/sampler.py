"""Sampling parameters and the sampler that applies them to a row of logits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from minerva.errors import MinervaError


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
    repetition_penalty: float = 1.0
    seed: int | None = None
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
            ("seed", self.seed is None or isinstance(self.seed, int), "an integer"),
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
    seen: list[int] = field(default_factory=list)


def new_state(params: SamplingParams, prompt_ids: list[int], device: torch.device) -> SamplerState:
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return SamplerState(params, gen, list(prompt_ids))


def process_logits(logits: torch.Tensor, state: SamplerState) -> torch.Tensor:
    """Apply the request's parameters to float32 logits [vocab]; removed tokens become -inf.

    Order as in transformers' generation: repetition penalty, temperature, top-k, top-p, min-p.
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
