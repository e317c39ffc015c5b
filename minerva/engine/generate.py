"""One request at a time: prefill, then decode with a KV cache, sampling each token.

The batched engine (scheduler, paged KV, continuous batching) replaces this
loop behind the same `stream`/`run` interface.
"""

from __future__ import annotations

from typing import Iterator

import torch

from minerva.engine.kv_cache import ContiguousKVCache
from minerva.engine.request import CompletionOutput, Request, RequestOutput, StreamDelta
from minerva.engine.sampler import new_state, sample
from minerva.errors import MinervaError
from minerva.formats.tokenizer import IncrementalDetokenizer, Tokenizer
from minerva.models.layers import AttentionContext, CausalLM


class StopChecker:
    """Finds stop strings in the text so far and holds back what could start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def find(self, text: str, new_from: int) -> int | None:
        """Index where the earliest stop string starts, searching the newly added region."""
        hits = [i for s in self.stops
                if (i := text.find(s, max(0, new_from - len(s) + 1))) != -1]
        return min(hits) if hits else None


@torch.inference_mode()
def run_tokens(model: CausalLM, cache: ContiguousKVCache, ids: list[int], start: int = 0,
               chunk: int = 512) -> torch.Tensor:
    """Run tokens at positions start.. through the model in chunks; hidden states [T, hidden]."""
    device = cache.k.device
    out = []
    for i in range(0, len(ids), chunk):
        piece = ids[i:i + chunk]
        cache.begin(start + i + len(piece))
        pos = torch.arange(start + i, start + i + len(piece), device=device)
        out.append(model(torch.tensor(piece, device=device), AttentionContext(pos, cache)))
    return torch.cat(out) if len(out) > 1 else out[0]


class SimpleGenerator:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, device: torch.device,
                 dtype: torch.dtype, prefill_chunk: int = 512):
        self.model, self.tokenizer = model, tokenizer
        self.device, self.dtype = device, dtype
        self.config = model.config
        self.prefill_chunk = prefill_chunk

    def check(self, request: Request) -> None:
        n, ctx = len(request.prompt_token_ids), self.config.max_position
        if n == 0:
            raise MinervaError("the prompt is empty after tokenization; give at least one token")
        if n >= ctx:
            raise MinervaError(f"the prompt has {n} tokens but the model's context is {ctx}; "
                               f"shorten it to at most {ctx - 1} tokens")
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise MinervaError(f"prompt token ids must be in [0, {vocab})")

    def forward(self, cache: ContiguousKVCache, ids: list[int], start: int) -> torch.Tensor:
        """Logits of the last of `ids` (at positions start..)."""
        with torch.inference_mode():
            return self.model.logits(run_tokens(self.model, cache, ids, start, self.prefill_chunk)[-1:])[0]

    def stream(self, request: Request) -> Iterator[StreamDelta]:
        self.check(request)
        p = request.params
        prompt = request.prompt_token_ids
        budget = min(p.max_tokens, self.config.max_position - len(prompt))
        cache = ContiguousKVCache(self.config, len(prompt) + budget, self.device, self.dtype)
        state = new_state(p, prompt, self.device)
        detok = IncrementalDetokenizer(self.tokenizer)
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.tokenizer.eos_token_ids))
        stops = StopChecker(p.stop)
        text, emitted, pending = "", 0, []
        logits = self.forward(cache, prompt, 0)
        while True:
            token = sample(logits, state)
            state.seen.append(token)
            finish, cut = None, None
            if token in stop_ids:
                finish = "stop"
            else:
                request.output_token_ids.append(token)
                pending.append(token)
                before = len(text)
                text += detok.add(token)
                cut = stops.find(text, before) if p.stop else None
                if cut is not None:
                    text, finish = text[:cut], "stop"
                elif len(request.output_token_ids) >= budget:
                    finish = "length"
            if finish and cut is None:
                text += detok.flush()  # an incomplete character at the very end
            end = len(text) if finish else max(emitted, len(text) - stops.holdback)
            if finish or end > emitted or pending:
                request.output_text = text
                request.finish_reason = finish
                yield StreamDelta(request.request_id, text[emitted:end], pending, finish)
                emitted, pending = end, []
            if finish:
                return
            logits = self.forward(cache, [token], len(prompt) + len(request.output_token_ids) - 1)

    def run(self, request: Request) -> RequestOutput:
        for _ in self.stream(request):
            pass
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [CompletionOutput(0, request.output_text, list(request.output_token_ids),
                                               request.finish_reason)])
