"""The server's conversions, apart from HTTP: request bodies to `SamplingParams`, the API's own
request rules, and engine results to OpenAI's response and stream-chunk shapes.

Everything here is a plain function of its arguments (no FastAPI, no engine), so each is tested
alone. Limits the engine enforces anyway (prompt token ids, the vocabulary, the KV pool, the
sampling ranges) are not repeated here: `LLM.make_requests` raises them as `MinervaError`,
which the app answers with a 400.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import time
import uuid
from typing import AsyncIterator, Callable, Sequence

import pydantic_core
import torch

from minerva.engine.sampler import SamplingParams, TokenLogprob
from minerva.engine.structured import StructuredOutput
from minerva.errors import MinervaError
from minerva.formats.chat import RESERVED_VARIABLES
from minerva.formats.generation import FIELDS as GENERATION_FIELDS
from minerva.parsers.tool_calls import CallPiece, ToolCall
from minerva.parsers.tools import ToolFormat, ToolPlan, make_plan
from minerva.serve import protocol as P
from minerva.serve import response_bodies as R

DONE = "data: [DONE]\n\n"
ACCESS = "minerva.access"  # the scope key of a request's access record, which the routes fill in


class APIError(Exception):
    """An error answered as `{"error": {...}}` with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.headers = status, message, param, type, headers


class ContextError(APIError):
    """A 400 for a prompt (with the tokens asked for) that does not fit the model's context."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(400, message, param)


def clipped(text: str, limit: int = 200) -> str:
    """`text` as an error echoes what a client sent: at most `limit` characters, then an ellipsis."""
    return text if len(text) <= limit else text[:limit] + "..."


def error_body(status: int, message: str, param: str | None = None,
               type: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": status}}


# ------------------------------------------------------------------ requests


_UNION_TAGS = {"body", "str", "int", "float", "bool", "list", "dict", "none"}


def _is_field(part) -> bool:
    """Whether a part of a pydantic error location names a field or an index (not the
    member of a union that failed, such as 'constrained-str' or 'list[int]')."""
    return isinstance(part, int) or (part.isidentifier() and part not in _UNION_TAGS)


def error_field(error: dict) -> str:
    """The field (dotted, with indices) a pydantic error is about."""
    return ".".join(str(x) for x in error.get("loc", ()) if _is_field(x))


def telling_error(errors: list[dict]) -> dict:
    """The error to report: the first field's, and of a field a union tried several ways (a
    string or a list of them), the one that is not just "not this type" where there is one
    (a list that is too long, an empty string in it) rather than the first member's."""
    first = errors[0]
    top = error_field(first).split(".")[0]
    same = [e for e in errors if error_field(e).split(".")[0] == top] if top else [first]
    return next((e for e in same if not e.get("type", "").endswith("_type")), first)


def error_message(error: dict) -> str:
    value = error.get("input")
    if isinstance(value, float) and not math.isfinite(value):  # pydantic calls NaN out of range
        return f"Input should be a finite number, got {value}"
    return error.get("msg", "invalid request").removeprefix("Value error, ")  # (a validator's ValueError)


def validated(model, fields: dict, names: dict[str, str] | None = None):
    """`fields` read by the pydantic `model` as a JSON body is (a converted request meets the
    same checks as one sent to its route); a 400 naming the problem, its field under the name
    the client sent (`names`: the converted request's top-level field -> the client's)."""
    try:
        return model.model_validate_json(json.dumps(fields))
    except ValueError as exc:
        errors = exc.errors() if hasattr(exc, "errors") else []
        first = telling_error(errors) if errors else {}
        where = error_field(first)
        top, dot, rest = where.partition(".")
        if names and top in names:
            where = names[top] + dot + rest
        raise APIError(400, f"invalid request: {where + ': ' if where else ''}{error_message(first) if first else exc}",
                       where or None) from None


def chat_messages(messages: Sequence[P.ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them (content parts joined into one text; the
    tool calls an assistant made and the call a tool result answers kept)."""
    out = []
    for m in messages:
        message = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def prefill(messages: list[dict]) -> dict:
    """The chat request's fields for a conversation whose last message is an assistant's text:
    the reply goes on from that text (Anthropic's and Ollama's prefill), not in a new message."""
    last = messages[-1] if messages else {}
    text = last.get("content")
    if last.get("role") == "assistant" and isinstance(text, str) and text.strip() and not last.get("tool_calls"):
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {}


def tool_plan(body: P.ChatCompletionRequest, fmt: ToolFormat) -> ToolPlan | None:
    """What a chat request asks of tools (None: nothing); a 400 for a choice that names nothing
    offered, or tools for a model whose calls this server cannot read."""
    try:
        plan = make_plan([t.model_dump(exclude_none=True) for t in body.tools or ()],
                         body.tool_choice.model_dump() if isinstance(body.tool_choice, P.NamedToolChoice)
                         else body.tool_choice, body.parallel_tool_calls)
    except MinervaError as exc:  # a problem of the choice, or of the tools themselves (a name given twice)
        raise APIError(400, str(exc), exc.field or "tool_choice") from None
    return plan


def template_variables(body: P.ChatCompletionRequest) -> dict:
    """The chat template's extra variables: `chat_template_kwargs`, and `reasoning_effort` over them."""
    variables = dict(body.chat_template_kwargs or {})
    clash = sorted(RESERVED_VARIABLES & set(variables))
    if clash:
        raise APIError(400, f"chat_template_kwargs may not set '{clash[0]}': the server sets it itself "
                            f"(send messages and add_generation_prompt as fields of their own)",
                       "chat_template_kwargs")
    if body.reasoning_effort is not None:
        variables["reasoning_effort"] = body.reasoning_effort
    return variables


def logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's string keys as token ids; their range is the engine's to check."""
    bias = {}
    for key, value in (raw or {}).items():
        # Only plain ASCII digits: int() would also take " 1 ", "1_0" and other scripts' digits.
        if not (key.isascii() and key.isdigit()) or (len(key) > 1 and key[0] == "0") or len(key) > 19:
            raise APIError(400, f"logit_bias key {key!r} is not a token id (digits 0-9, no sign, "
                                f"spaces or leading zeros)", "logit_bias")
        bias[int(key)] = value
    return bias


def check_supported(body: P._Sampling) -> None:
    """A 400 naming the first OpenAI field set to something Minerva does not implement yet."""
    name = body.unsupported()
    if name is not None:
        raise APIError(400, f"'{name}' is not supported by this server yet; leave it out "
                            f"(or send {json.dumps(P.UNSUPPORTED[name][1])})", name)


def sampling_params(body: P._Sampling, max_tokens: int, logprobs: int | None,
                    forced: StructuredOutput | None = None, defaults: dict | None = None) -> SamplingParams:
    """The engine's parameters for one completion of `body` (SamplingParams checks the ranges);
    a forced tool call (`forced`) constrains the output as structured output does. A reply held
    to JSON (a schema, a JSON object, a forced call) ends where the JSON does: stop strings,
    which could cut it anywhere, do not apply to it. The sampling fields the body leaves out
    take the model's `defaults` (its generation config), else the route's (Ollama's)."""
    constraint = structured(body, forced)
    to_json = forced is not None or (constraint is not None and (constraint.json is not None or constraint.json_object))
    chosen = {**body._fallback, **(defaults or {}), **{name: getattr(body, name) for name in GENERATION_FIELDS
                                                       if name in body.model_fields_set}}
    value = {name: chosen.get(name, getattr(body, name)) for name in GENERATION_FIELDS}
    return SamplingParams(max_tokens=max_tokens, n=body.n, temperature=value["temperature"],
                          top_k=max(value["top_k"], 0), top_p=value["top_p"], min_p=value["min_p"],
                          repetition_penalty=value["repetition_penalty"], presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty, logit_bias=logit_bias(body.logit_bias),
                          seed=body.seed, logprobs=logprobs, stop=() if to_json else body.stop_list(),
                          ignore_eos=body.ignore_eos,
                          stop_token_ids=tuple(body.stop_token_ids or ()),
                          speculative_tokens=body.speculative_tokens, structured=constraint)


def _constraints(body: P._Sampling) -> dict:
    """The request's output constraints by field."""
    return {name: value for name, value in (
        ("response_format", body.response_format if body.response_format and body.response_format.type != "text"
         else None),
        ("guided_json", body.guided_json), ("guided_regex", body.guided_regex), ("guided_choice", body.guided_choice),
        ("guided_grammar", body.guided_grammar), ("json_schema", body.json_schema), ("grammar", body.grammar),
    ) if value is not None}


def constraint_field(body: P._Sampling, forced: StructuredOutput | None = None) -> str | None:
    """The field the request's output constraint came from ("tools" for a forced call)."""
    return "tools" if forced is not None else next(iter(_constraints(body)), None)


def structured(body: P._Sampling, forced: StructuredOutput | None = None) -> StructuredOutput | None:
    """The output constraint of a request: OpenAI's response_format, or vLLM's guided_* or
    llama.cpp's json_schema/grammar fields, or a forced tool call; a 400 when more than one is given."""
    given = _constraints(body)
    if forced is not None:  # a forced tool call's constraint
        if given:
            raise APIError(400, f"a forced tool call (tool_choice \"required\" or a named function) already "
                                f"constrains the output; leave out {next(iter(given))}", next(iter(given)))
        return forced
    if len(given) > 1:
        raise APIError(400, f"give at most one output constraint; got {', '.join(given)}", next(iter(given)))
    if not given:
        return None
    (name, value), = given.items()
    if name == "response_format":  # (its schema a JSON object: the protocol checks it)
        return StructuredOutput(**({"json_object": True} if value.type == "json_object" else
                                   {"json": value.json_schema.schema_}))
    kind = "json" if name == "json_schema" else name.removeprefix("guided_")  # json, regex, choice or grammar
    try:
        return StructuredOutput(**{kind: tuple(value) if kind == "choice" else value})
    except MinervaError as exc:  # a value no constraint is made of (an empty grammar, the schema `true`)
        raise APIError(400, f"invalid field '{name}': {exc}", name) from None


def chat_max_tokens(body: P.ChatCompletionRequest) -> int | None:
    return body.max_completion_tokens or body.max_tokens


def chat_logprobs_count(body: P.ChatCompletionRequest) -> int | None:
    """The engine's `logprobs` (top alternatives per token), None when none are wanted."""
    return (body.top_logprobs or 0) if body.logprobs else None


def max_tokens_within(prompt_len: int, max_tokens: int | None, max_model_len: int, param: str,
                      to_context: bool = False) -> int:
    """`max_tokens`, or all the room the context leaves; a 400 when the prompt and the tokens
    asked for do not fit. Unlike the engine, which cuts a completion at the context, the API
    refuses a max_tokens beyond it, as OpenAI does; `to_context` cuts it there (Ollama's way)."""
    room = max_model_len - prompt_len
    if to_context and max_tokens is not None and room >= 1:
        max_tokens = min(max_tokens, room)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = f" and max_tokens asks for {max_tokens} more" if max_tokens is not None and not to_context else ""
        advice = "shorten the prompt" if to_context else "shorten the prompt or lower max_tokens"  # (cut: no limit to lower)
        raise ContextError(f"this model's maximum context length is {max_model_len} tokens, but the prompt "
                           f"has {prompt_len} tokens{asked}; {advice}", param)
    return max_tokens or room


def completion_prompts(body: P.CompletionRequest) -> list[str | list[int]]:
    """The prompts of a text completion, after the rules of the features Minerva lacks."""
    prompts = body.prompts()
    if not prompts or len(prompts) > P.MAX_PROMPTS:
        raise APIError(400, f"give between 1 and {P.MAX_PROMPTS} prompts", "prompt")
    if body.suffix:
        raise APIError(400, "suffix is not supported: put the text in the prompt", "suffix")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (no prompt logprobs); drop one of them", "echo")
    return prompts


def embedding_params() -> SamplingParams:
    """An embedding request: the prompt computed, its last token's hidden state kept, one greedy
    token (nothing more is sampled, nor guessed)."""
    return SamplingParams(max_tokens=1, temperature=0, embedding=True, speculative_tokens=0)


def embedding_vector(vector, encoding_format: str) -> list[float] | str:
    """One embedding as OpenAI sends it: floats, or their float32 bytes (little-endian) in base64."""
    values = vector.detach().to("cpu", torch.float32).numpy()
    if encoding_format == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    return values.tolist()


# ------------------------------------------------------------------ numbers


def finite(x: float) -> float:
    """JSON has no -inf: a token the sampler ruled out gets OpenAI's -9999."""
    return x if math.isfinite(x) else -9999.0


def shown_token(data: bytes) -> str:
    """A token as the logprobs name it: its text, or for bytes that are no whole UTF-8 (a piece
    of a character) "bytes:" and the bytes, as OpenAI writes them, so that different pieces
    stay different keys."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def chat_logprobs(items: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes]) -> list[dict]:
    """The chat shape: each token's text and its own bytes (which, joined, give the reply's UTF-8
    even where a character spans tokens)."""
    def one(token_id: int, lp: float) -> dict:
        data = token_bytes(token_id)
        return {"token": shown_token(data), "logprob": finite(lp), "bytes": list(data)}

    return [{**one(x.token_id, x.logprob), "top_logprobs": [one(i, lp) for i, lp in x.top]} for x in items]


def completion_logprobs(items: Sequence[TokenLogprob], offset: int, token_text: Callable[[int], str],
                        token_bytes: Callable[[int], bytes]) -> dict:
    """The legacy shape; `offset` is where the first token's text starts in the choice's text
    (a token's share of it: `token_text`, its text as decoded alone)."""
    offsets = []
    for x in items:
        offsets.append(offset)
        offset += len(token_text(x.token_id))
    return {"tokens": [shown_token(token_bytes(x.token_id)) for x in items],
            "token_logprobs": [finite(x.logprob) for x in items],
            "top_logprobs": [{shown_token(token_bytes(i)): finite(lp) for i, lp in x.top} for x in items],
            "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def timings(scheduled: Sequence[float], first_tokens: Sequence[float], ends: Sequence[float],
            prompt_n: int, predicted_n: int) -> dict | None:
    """llama.cpp's timings of a group of requests: prompt from the first scheduling to the first
    token, generation from there to the last end; None until each has happened once."""
    if not (scheduled and first_tokens and ends):
        return None
    prompt_ms = max(min(first_tokens) - min(scheduled), 0.0) * 1e3
    predicted_ms = max(max(ends) - min(first_tokens), 0.0) * 1e3

    def rate(n, ms):
        return (ms / n if n else 0.0), (n / ms * 1e3 if ms > 0 else 0.0)

    (ppt, pps), (gpt, gps) = rate(prompt_n, prompt_ms), rate(predicted_n, predicted_ms)
    return {"prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": ppt,
            "prompt_per_second": pps, "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": gpt, "predicted_per_second": gps}


def group_timings(tracked, prompt_n: int, predicted_n: int) -> dict | None:
    """`timings` of the async engine's `Tracked` records of one HTTP request."""
    return timings([t.scheduled_time for t in tracked if t.scheduled_time is not None],
                   [t.request.first_token_time for t in tracked if t.request.first_token_time is not None],
                   [t.finish_time for t in tracked if t.finish_time is not None], prompt_n, predicted_n)


# ------------------------------------------------------------------ responses


@dataclasses.dataclass(frozen=True)
class Reply:
    """How one request's results are written: a chat or a text completion, whole or as chunks.

    `head` is the id, object, created and model every body and chunk repeats; `token_text`
    and `token_bytes` turn a token id into its text (decoded alone) and its bytes for the
    logprobs (None: the UTF-8 of its text).
    """

    chat: bool
    want_logprobs: bool
    head: dict
    token_text: Callable[[int], str]
    reasoning: bool = False  # chat messages carry reasoning_content (the model's replies are split)
    token_bytes: Callable[[int], bytes] | None = None

    @classmethod
    def new(cls, chat: bool, want_logprobs: bool, model: str, token_text: Callable[[int], str],
            reasoning: bool = False, token_bytes: Callable[[int], bytes] | None = None) -> "Reply":
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model}
        return cls(chat, want_logprobs, head, token_text, reasoning, token_bytes)

    def logprobs(self, items: Sequence[TokenLogprob], offset: int) -> dict | None:
        if not self.want_logprobs:
            return None
        token_bytes = self.token_bytes or (lambda i: self.token_text(i).encode("utf-8"))
        if self.chat:
            return {"content": chat_logprobs(items, token_bytes)}
        return completion_logprobs(items, offset, self.token_text, token_bytes)

    def choice(self, index: int, text: str, finish: str | None, items: Sequence[TokenLogprob],
               offset: int = 0, reasoning: str | None = None, calls: Sequence[ToolCall] = (),
               stop_reason: str | int | None = None) -> dict:
        """One choice of a whole response (`text` the answer, `reasoning` what came before it,
        `calls` the tools it called: then the content is null when empty; `stop_reason`, as
        vLLM's, the stop string or token id that ended it, given only then)."""
        lp = self.logprobs(items, offset)
        if self.chat:
            message = {"role": "assistant", "content": text or (None if calls else "")}
            if self.reasoning:
                message["reasoning_content"] = reasoning or None
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
            out = {"index": index, "message": message, "logprobs": lp, "finish_reason": finish_reason(finish, calls)}
        else:
            out = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        return out if stop_reason is None else {**out, "stop_reason": stop_reason}

    def response(self, choices: list[dict], usage: dict, timings: dict | None) -> dict:
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": choices, "usage": usage, "timings": timings}

    def delta(self, index: int, text: str, finish: str | None, items: Sequence[TokenLogprob],
              offset: int = 0, reasoning: str = "", pieces: Sequence[CallPiece] = (),
              stop_reason: str | int | None = None) -> R.ChatChunkChoice | R.CompletionChoice:
        """One choice of a stream chunk (a chat delta carries no content once it has finished;
        with reasoning or tool calls, only the fields that have something new)."""
        lp = self.logprobs(items, offset)
        if self.chat:
            delta = {}
            if self.reasoning and reasoning:
                delta["reasoning_content"] = reasoning
            if text or not (finish or reasoning or pieces):
                delta["content"] = text
            if pieces:
                delta["tool_calls"] = [piece_delta(p) for p in pieces]
            extra = {} if stop_reason is None else {"stop_reason": stop_reason}
            return R.ChatChunkChoice(index=index, delta=R.ChatDelta(**delta), logprobs=lp,
                                     finish_reason=finish, **extra)
        extra = {} if stop_reason is None else {"stop_reason": stop_reason}
        return R.CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish, **extra)

    def opening(self, prefixes: list[str]) -> list:
        """The choices of the first chunk: the assistant role of every chat choice, or the echoed
        prompts of a text completion; none when there is nothing to say yet."""
        if self.chat:
            return [R.ChatChunkChoice(index=i, delta=R.ChatDelta(role="assistant", content=""),
                                             logprobs=None, finish_reason=None) for i in range(len(prefixes))]
        return [self.delta(i, p, None, []) for i, p in enumerate(prefixes) if p]

    def chunk(self, choices: list, **extra) -> str:
        """A server-sent event with one chunk (`extra`: usage and timings, with no choices)."""
        kind = R.ChatCompletionChunk if self.chat else R.CompletionChunk
        body = kind(**self.head, choices=choices, **extra).model_dump(exclude_unset=True)
        return f"data: {json.dumps(body, allow_nan=False)}\n\n"


def finish_reason(finish: str | None, calls: Sequence | bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that called tools and stopped by itself."""
    return "tool_calls" if calls and finish == "stop" else finish


def piece_delta(p: CallPiece) -> R.ToolCallDelta:
    """A stream's tool-call delta: the id, type and name with the first piece of a call."""
    if p.name is None:
        return R.ToolCallDelta(index=p.index, function=R.FunctionCallDelta(arguments=p.arguments))
    return R.ToolCallDelta(index=p.index, id=p.id, type="function",
                                  function=R.FunctionCallDelta(name=p.name, arguments=p.arguments))


def arguments_object(text: str) -> dict:
    """A tool call's arguments (JSON text) as the object other APIs carry; {} for what is not one.
    Arguments cut short (max_tokens) keep what was written whole, as the SDKs assemble the same
    arguments streamed (a string cut in the middle is left out)."""
    try:  # (strict JSON: no NaN or Infinity, which no JSON response can carry)
        value = pydantic_core.from_json(text, allow_partial=True, allow_inf_nan=False)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def chunks(response) -> AsyncIterator[dict]:
    """The chunks of a chat or text completion streamed by the routes (a StreamingResponse of
    server-sent events), parsed: what the other APIs' converters rewrite in their own shape."""
    async for part in response.body_iterator:
        text = part if isinstance(part, str) else part.decode()
        for line in text.splitlines():
            if line.startswith("data: ") and line != DONE.strip():
                yield json.loads(line[6:])


def stream_error(exc: Exception) -> str:
    """The event that ends a stream whose requests failed: the input's fault (400) or a bug (500)."""
    code, kind = (400, "invalid_request_error") if isinstance(exc, MinervaError) else (500, "server_error")
    param = getattr(exc, "field", None)
    return f"data: {json.dumps({'error': {'message': str(exc), 'type': kind, 'param': param, 'code': code}})}\n\n"
