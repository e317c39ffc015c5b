"""What flows through the engine: a request in, deltas and outputs back."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from minerva.engine.sampler import SamplerState, SamplingParams, TokenLogprob

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated. There is no prefill or decode phase: the engine
    computes tokens [num_computed_tokens, num_tokens) in as many steps as it likes."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # why it cannot go on (finish_reason "error"): its output constraint could not be followed
    error: str | None = None
    sampler: SamplerState | None = None  # set by the engine when the request is added
    first_token_time: float | None = None
    # Sibling completions (n > 1) wait until this request's prompt is in the cache, then share it.
    wait_for: Request | None = None
    # Speculative guesses for the tokens after all_token_ids, computed and verified in the
    # next step (see minerva/engine/speculative.py); draft_probs [k, vocab] are the
    # distributions they were drawn from, None when chosen deterministically.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: object = None
    embedding: object = None  # float32 [hidden], with params.embedding: set when the prompt is computed
    # The compiled start state of params.structured (an llguidance matcher), set when the engine
    # checks the request; the request's sampler runs a copy of it.
    grammar: object = None
    adapter: int = 0  # its LoRA adapter's index (params.adapter's; 0: the base model), set by the engine
    # The prompt, then every kept output token: one list that grows in place (read it, never
    # keep it: it changes as the request runs).
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self):
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def pending_token_ids(self) -> list[int]:
        """The tokens to compute: all_token_ids and any guesses after them."""
        return self.all_token_ids + self.draft_token_ids if self.draft_token_ids else self.all_token_ids

    @property
    def num_pending(self) -> int:
        return self.num_tokens + len(self.draft_token_ids)

    def clear_drafts(self) -> None:
        self.draft_token_ids, self.draft_probs = [], None

    @property
    def blocked(self) -> bool:
        w = self.wait_for
        return (w is not None and w.status is not Status.FINISHED
                and w.num_computed_tokens < len(w.prompt_token_ids))

    @property
    def order(self) -> tuple[int, float]:
        """Scheduling order: priority, then arrival."""
        return (self.priority, self.arrival_time)


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # one per token when asked for
    reasoning: str | None = None  # what `LLM.chat` split off as reasoning (text is then the answer)
    tool_calls: list | None = None  # the `parsers.tools.ToolCall`s `LLM.chat` read out of the reply


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # n completions of the same prompt

    # The first completion, for convenience.
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
    logprobs: list[TokenLogprob] = field(default_factory=list)  # for token_ids, when asked for
    # with finish_reason "stop": the stop string that ended it, or the stop token id from
    # params.stop_token_ids (None: the model's end of sequence), as vLLM's `stop_reason`
    stop_reason: str | int | None = None
    error: str | None = None  # with finish_reason "error": why (the client gets it as an error, not a finish)
