"""Turning a request's sampled tokens into text deltas: detokenization and stop rules."""

from __future__ import annotations

from minerva.engine.request import StreamDelta
from minerva.engine.sampler import SamplingParams, TokenLogprob
from minerva.formats.tokenizer import IncrementalDetokenizer, Tokenizer


class StopChecker:
    """Finds stop strings in the text so far and holds back what could start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.firsts = {s[0] for s in stops if s}

    def find(self, text: str, new_from: int) -> int | None:
        """Index where the earliest stop string starts, searching the newly added region."""
        hits = [i for s in self.stops
                if (i := text.find(s, max(0, new_from - len(s) + 1))) != -1]
        return min(hits) if hits else None

    def held(self, text: str) -> int:
        """How many characters at the end of `text` to hold back: the longest end of the text
        that a stop string starts with, which the next tokens could complete. Only the last
        `longest - 1` characters can be one (a whole stop string has been cut already)."""
        tail = text[max(0, len(text) - self.longest + 1):] if self.longest > 1 else ""
        for i, ch in enumerate(tail):  # leftmost first: the longest end
            if ch in self.firsts and any(s.startswith(tail[i:]) for s in self.stops):
                return len(tail) - i
        return 0


class OutputProcessor:
    """Per request: ids -> text, EOS / stop ids / stop strings / length, and what to stream."""

    def __init__(self, request_id: str, tokenizer: Tokenizer, params: SamplingParams):
        self.request_id = request_id
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stop_ids = set(params.stop_token_ids)
        self.stop_reason: str | int | None = None  # what stopped it (StreamDelta.stop_reason)
        self.asked_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids |= set(tokenizer.eos_token_ids)
        self.stops = StopChecker(params.stop)
        self.text = ""
        self.emitted = 0
        self.pending: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []

    def add(self, token: int, last_allowed: bool,
            logprob: TokenLogprob | None = None) -> tuple[bool, str | None]:
        """Account for a sampled token: (keep it in the output?, finish reason or None).

        `last_allowed` says the request has no room for another token after this one.
        """
        if token in self.stop_ids:
            self.text += self.detok.flush()
            self.stop_reason = token if token in self.asked_ids else None
            return False, "stop"
        self.pending.append(token)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        before = len(self.text)
        self.text += self.detok.add(token)
        cut = self.stops.find(self.text, before) if self.stops.stops else None
        if cut is not None:
            self.stop_reason = next(x for x in self.stops.stops if self.text.startswith(x, cut))
            self.text = self.text[:cut]
            return True, "stop"
        if last_allowed:
            self.text += self.detok.flush()  # an incomplete character at the very end
            return True, "length"
        return True, None

    def delta(self, finish: str | None) -> StreamDelta | None:
        """What is new since the last delta (text held back while it could start a stop string)."""
        end = len(self.text) if finish else max(self.emitted, len(self.text) - self.stops.held(self.text))
        if not (finish or end > self.emitted or self.pending):
            return None
        delta = StreamDelta(self.request_id, self.text[self.emitted:end], self.pending, finish,
                            self.pending_logprobs, self.stop_reason if finish == "stop" else None)
        self.emitted, self.pending, self.pending_logprobs = end, [], []
        return delta
