"""What flows through the engine: a request in, outputs back."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from minerva.engine.sampler import SamplingParams

_ids = itertools.count()


@dataclass
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | None while running


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    # The first (and for now only) completion, for convenience.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass(frozen=True)
class StreamDelta:
    """New text and tokens of one request since the last delta."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
