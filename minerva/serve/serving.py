"""The base of the API handlers, as vLLM's `serving_engine.py` under its `serving_chat.py` and
`serving_completion.py`: what every route that runs the model shares. A handler
(`serving_chat`, `serving_completion`, `serving_embedding`) turns its body into checked engine
requests (`convert`, `LLM.make_requests`); this base admits them (the waiting queue's limit,
503 when full or when the engine is gone), compiles their output constraints off the event
loop, renders chat templates and tokenizes on worker threads, and answers with one JSON body
or a server-sent event stream, aborting a request whose client went away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from minerva.engine.request import Request
from minerva.engine.sampler import SamplingParams, TokenLogprob
from minerva.engine.structured import StructuredOutput
from minerva.errors import MinervaError
from minerva.formats.chat import TemplateCompileError, TemplateLimitError
from minerva.parsers.reasoning import ReasoningParser
from minerva.parsers.tool_calls import ToolParser, join_pieces
from minerva.parsers.tools import ToolPlan
from minerva.serve import convert
from minerva.serve import protocol as P
from minerva.serve.async_engine import AsyncEngine, EngineDead, Group, QueueFull
from minerva.serve.convert import APIError, Reply
from minerva.serve.guard import ACCESS
from minerva.serve.json_response import JSONResponse
from minerva.serve.metrics import Metrics

log = logging.getLogger("minerva.serve")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting: int = 256  # requests queued before the engine takes them; more get 503
    max_body_bytes: int = 4 << 20
    shutdown_timeout: float = 10.0  # seconds in-flight requests get on shutdown
    header_timeout: float = 10.0  # seconds a connection has to send a complete request head; then 408
    body_timeout: float = 60.0  # seconds a request has to send its whole body after its head; then 408
    max_connections: int = 1024  # open connections; one more gets 503 at once
    aliases: tuple[str, ...] = ()  # more names clients may send for the model (listed after the first)
    # origins a browser page may call the API from (CORS): None = this machine's pages only
    # (http(s)://localhost, 127.0.0.1, [::1], any port), ("*",) = any
    allowed_origins: tuple[str, ...] | None = None

    def __post_init__(self):
        for flag, value in (("header-timeout", self.header_timeout), ("body-timeout", self.body_timeout)):
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise MinervaError(f"--{flag} must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise MinervaError(f"--max-connections must be an integer >= 1, got {self.max_connections!r}")
        if not isinstance(self.max_waiting, int) or self.max_waiting < 1:
            raise MinervaError(f"--max-waiting must be an integer >= 1, got {self.max_waiting!r}")
        if not self.shutdown_timeout >= 0:
            raise MinervaError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout!r}")
        if not self.served_model_name or not all(self.aliases):
            raise MinervaError("--served-model-name must not be empty")
        if self.api_key is not None and not self.api_key.strip():  # `--api-key "$KEY"` with KEY unset
            raise MinervaError("--api-key is empty; give the key clients must send, or leave --api-key out to "
                               "serve without one")
        if self.api_key is not None and self.api_key != self.api_key.strip():
            raise MinervaError("--api-key begins or ends with whitespace, which clients' keys are read without; "
                               "remove it")

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the model is served under, the first one first, each once."""
        return tuple(dict.fromkeys((self.served_model_name, *self.aliases)))


async def _abort_on_disconnect(raw: HTTPRequest, engine: AsyncEngine, group) -> None:
    """Wait for the client to go away, then abort its requests (their KV blocks are freed)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            engine.abort(group)
            return


class Serving:
    """The model, its engine thread and the server's settings, with what the handlers share."""

    def __init__(self, llm, engine: AsyncEngine, metrics: Metrics, config: ServerConfig):
        self.llm, self.engine, self.metrics, self.config = llm, engine, metrics, config
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.engine.max_model_len
        # A prompt longer than this many characters cannot fit the context, whatever its tokens.
        self.max_prompt_chars = self.max_model_len * llm.tokenizer.max_token_chars
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters' names: each a model id of its own (vLLM's convention)."""
        return list(self.llm.adapter_paths)

    def check_model(self, name: str | None) -> None:
        names = (*self.config.names, *self.adapters)
        if name is not None and name not in names:
            served = " or ".join(f"'{n}'" for n in names)
            raise APIError(404, f"the model '{convert.clipped(name)}' does not exist; this server serves {served} "
                                f"(see /v1/models)", "model")

    async def check_parameters(self, tools: ToolPlan) -> None:
        """A 400 naming the function whose parameters schema a forced call cannot be held to."""
        for tool in tools.tools if tools.choice == "required" else [{"function": tools.function(tools.choice)}]:
            function = tool["function"]
            schema = function.get("parameters") or {"type": "object"}
            try:
                await self.compile(StructuredOutput(json=schema))
            except MinervaError as exc:
                raise APIError(400, f"the parameters of the function '{function['name']}' are not a usable JSON "
                                    f"schema: {exc}", "tools") from None

    async def compile(self, spec: StructuredOutput | None, field: str | None = None) -> None:
        """Compile an output constraint on the engine's grammar workers, within their budget,
        while this request alone waits (neither the event loop nor the engine's steps do); a
        MinervaError (a 400, naming `field`, the request's field it came from) when it is
        refused. The engine's own check then finds it cached."""
        if spec is None:
            return
        grammars = self.llm.engine.grammars
        compiling = asyncio.wrap_future(grammars.submit(spec))
        await asyncio.wait({asyncio.wrap_future(grammars.tokenizer_ready())})  # once an engine: outside the budget
        done, _ = await asyncio.wait({compiling}, timeout=grammars.seconds)  # never cancels the compilation
        _, error = compiling.result() if done else (None, grammars.too_slow(spec))
        if error is not None:
            raise MinervaError(f"invalid field '{field}': {error}" if field else error, field)

    async def chat_prompt(self, messages: list[P.ChatMessage], add_generation_prompt: bool,
                          variables: dict | None = None, tools: list[dict] | None = None,
                          continue_final_message: bool = False) -> str:
        """The conversation rendered by the model's chat template, on a worker thread: a template
        is code from the model file, and its time is bounded by the renderer, not the event loop.
        A conversation that cannot fit the context is refused before it is rendered."""
        if len(messages) > self.max_model_len:  # every message takes a token at least
            raise convert.ContextError(f"the conversation (messages) has {len(messages)} items, more than this "
                                       f"model's context of {self.max_model_len} tokens can hold; send fewer",
                                       "messages")
        chars = sum(len(m.content) if isinstance(m.content, str) else 0 for m in messages)
        if chars > self.max_prompt_chars:
            raise convert.ContextError(f"the conversation (messages) holds {chars} characters, more than this "
                                       f"model's maximum context length of {self.max_model_len} tokens can hold (at most "
                                       f"{self.max_prompt_chars}); shorten it", "messages")
        try:
            return await asyncio.to_thread(self.llm.apply_chat_template, convert.chat_messages(messages),
                                           add_generation_prompt=add_generation_prompt, tools=tools,
                                           continue_final_message=continue_final_message, **(variables or {}))
        except (TemplateLimitError, TemplateCompileError) as exc:  # the template's fault, not the request's
            log.error("%s", exc)
            raise APIError(500, f"{exc}; the model's chat template is broken or hostile: fix it, or "
                                f"send a prompt to /v1/completions", type="server_error") from None
        except MinervaError as exc:
            raise APIError(400, str(exc), "messages") from None

    async def encode(self, prompt: str | list[int], param: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of a prompt. Text longer than the context could hold is refused before any
        tokenizing; the rest is tokenized on a worker thread (the tokenizer lets go of the GIL),
        so a long prompt does not stall other requests' streams."""
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
            raise APIError(400, f"the prompt has {len(prompt)} characters, more than this model's maximum "
                                f"context length of {self.max_model_len} tokens can hold (at most "
                                f"{self.max_prompt_chars}); shorten the prompt", param)
        try:
            if add_special_tokens is None:
                return await asyncio.to_thread(self.llm.encode_prompt, prompt)
            return await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens)
        except MinervaError as exc:
            raise APIError(400, str(exc), param) from None

    async def requests(self, prompts: list[list[int]], body, max_tokens: int | None, logprobs: int | None,
                       param: str, chat: bool = False, tools=None,
                       fixed: SamplingParams | None = None) -> list[Request]:
        """Engine requests for every prompt (n each), checked by the API's rules and the engine's;
        `fixed` parameters instead of the body's sampling fields (an embedding's)."""
        if getattr(body, "speculative_tokens", None) and self.llm.engine.speculator is None:
            raise APIError(400, f"speculative_tokens {body.speculative_tokens} asks for guesses, and this server runs "
                                "without speculative decoding (start it with --speculative); leave it out, or 0",
                           "speculative_tokens")
        requests = []
        forced = tools.output(self.llm.tool_format) if tools is not None else None
        own = max_tokens is None and self.llm.sampling_defaults.get("max_tokens")  # the model's, cut at the context
        for i, ids in enumerate(prompts):
            limit = convert.max_tokens_within(len(ids), own or max_tokens, self.max_model_len, param,
                                              bool(own) or getattr(body, "_to_context", False))
            params = fixed or convert.sampling_params(body, limit, logprobs, forced, self.llm.sampling_defaults)
            if body.model in self.llm.adapter_paths:  # the base model with that adapter
                params = dataclasses.replace(params, adapter=body.model)
            if i == 0 and params.structured is not None:  # every prompt has the same constraint
                await self.compile(params.structured, convert.constraint_field(body, forced))
            if chat:
                params = self.llm.chat_params(params, tools=tools is not None and tools.choice == "auto")
            try:
                requests += self.llm.make_requests(ids, params)
            except MinervaError as exc:  # the engine's checks: a token id out of range, in the prompt or logit_bias
                raise APIError(400, str(exc), exc.field or param) from None
        if len(requests) > self.config.max_waiting:  # could never be queued: not a matter of retrying
            embeds = fixed is not None and fixed.embedding
            raise APIError(400, f"this request asks for {len(requests)} "
                                f"{'embeddings (inputs)' if embeds else 'completions (prompts x n)'}, more than "
                                f"the server queues at once (--max-waiting {self.config.max_waiting}); "
                                f"split it", "input" if embeds else "n")
        return requests

    def submit(self, requests: list[Request], constraint_field: str | None = None) -> Group:
        try:
            return self.engine.submit(requests, constraint_field)
        except QueueFull as exc:
            raise APIError(503, f"the server is busy: {exc}; retry later", type="server_overloaded",
                           headers={"Retry-After": "1"}) from None
        except EngineDead as exc:
            raise APIError(503, str(exc), type="server_unavailable", headers={"Retry-After": "5"}) from None

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    # -------------------------------------------------------------- answers

    async def answer(self, raw: HTTPRequest, requests: list[Request], body: P._Sampling, chat: bool,
                     want_logprobs: bool, prompt_tokens: int, prefixes: list[str],
                     parsers: list[ReasoningParser] | None = None,
                     callers: list[ToolParser] | None = None) -> Response:
        """Submit, then answer with one JSON body or an SSE stream; `parsers` (one per request)
        split each reply into reasoning and content, and `callers` read tool calls out of the content."""
        # an error of the output constraint (one the grammar engine cannot follow) names its field
        group = self.submit(requests, convert.constraint_field(body) or (
            "tools" if requests and requests[0].params.structured is not None else None))
        access = raw.scope.get(ACCESS, {})  # what the access log line says of this request
        access["prompt"] = prompt_tokens
        watch = asyncio.ensure_future(_abort_on_disconnect(raw, self.engine, group))
        reply = Reply.new(chat, want_logprobs, body.model or self.config.served_model_name, self.token_text,
                          reasoning=parsers is not None, token_bytes=self.tokenizer.token_bytes)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.stream(group, watch, reply, include_usage, prompt_tokens, prefixes,
                                                 parsers, callers, access),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await self.collect(group, watch, reply, prompt_tokens, prefixes, parsers, callers,
                                               access))

    async def whole(self, group: Group, watch: asyncio.Future) -> AsyncIterator[tuple]:
        """The group's deltas for an answer given whole: an engine error is the input's (400) or
        a bug (500, and the server goes on); requests left unfinished are aborted."""
        done = False
        try:
            async for item in self.engine.stream(group):
                yield item
            done = True
        except MinervaError as exc:
            raise APIError(400, str(exc), exc.field) from None
        except RuntimeError as exc:
            raise APIError(500, str(exc), type="server_error") from None
        finally:
            watch.cancel()
            if not done:
                self.engine.abort(group)

    async def collect(self, group: Group, watch: asyncio.Future, reply: Reply, prompt_tokens: int,
                      prefixes: list[str], parsers: list[ReasoningParser] | None,
                      callers: list[ToolParser] | None = None, access: dict | None = None) -> dict:
        """The whole response, once every request of the group has finished."""
        texts = [[p] for p in prefixes]
        logprobs: list[list[TokenLogprob]] = [[] for _ in prefixes]
        finish: list[str | None] = [None] * len(prefixes)
        stops: list[str | int | None] = [None] * len(prefixes)
        completion_tokens = 0
        async for t, d in self.whole(group, watch):
            texts[t.index].append(d.text)
            logprobs[t.index] += d.logprobs
            completion_tokens += len(d.token_ids)
            note(access, completion_tokens)
            finish[t.index] = d.finish_reason or finish[t.index]
            stops[t.index] = d.stop_reason if d.finish_reason else stops[t.index]
        choices = []
        for i, parts in enumerate(texts):
            thought, text = parsers[i].feed("".join(parts), end=True) if parsers else ("", "".join(parts))
            calls = []
            if callers:
                text, pieces = callers[i].feed(text, end=True)
                calls = join_pieces(pieces)
            choices.append(reply.choice(i, text, finish[i], logprobs[i], len(prefixes[i]), thought, calls, stops[i]))
        return reply.response(choices, convert.usage(prompt_tokens, completion_tokens),
                              convert.group_timings(group.tracked, prompt_tokens, completion_tokens))

    async def stream(self, group: Group, watch: asyncio.Future, reply: Reply, include_usage: bool,
                     prompt_tokens: int, prefixes: list[str], parsers: list[ReasoningParser] | None,
                     callers: list[ToolParser] | None = None, access: dict | None = None) -> AsyncIterator[str]:
        completion_tokens = 0
        offsets = [len(p) for p in prefixes]
        done = False
        try:
            opening = reply.opening(prefixes)
            if opening:
                yield reply.chunk(opening)
            async for t, d in self.engine.stream(group):
                completion_tokens += len(d.token_ids)
                note(access, completion_tokens)
                thought, text, news = "", d.text, d.text or d.token_ids
                finish, end = d.finish_reason, d.finish_reason is not None
                if parsers:  # a chunk only for new text: marker tokens alone say nothing
                    thought, text = parsers[t.index].feed(d.text, end=end)
                    news = thought or text or d.logprobs
                runs = [(text, [])]
                if callers:  # text inside a call is held until the call is whole
                    runs = callers[t.index].feed_runs(text, end=end)
                    news = thought or runs or d.logprobs
                    runs = runs or [("", [])]
                    finish = convert.finish_reason(finish, callers[t.index].called)
                if news or finish:
                    # text after a call goes in a chunk of its own: a chunk's content comes before its calls
                    for k, (text, pieces) in enumerate(runs):
                        last = k == len(runs) - 1
                        yield reply.chunk([reply.delta(t.index, text, finish if last else None,
                                                       d.logprobs if k == 0 else [], offsets[t.index],
                                                       thought if k == 0 else "", pieces, d.stop_reason)])
                        offsets[t.index] += len(text)
            if include_usage:
                yield reply.chunk([], usage=convert.usage(prompt_tokens, completion_tokens),
                                  timings=convert.group_timings(group.tracked, prompt_tokens, completion_tokens))
            done = True
        except (MinervaError, RuntimeError) as exc:
            done = True
            yield convert.stream_error(exc)
        finally:
            watch.cancel()
            if not done:  # the client went away (the response was cancelled): free its KV blocks
                self.engine.abort(group)
        yield convert.DONE


def note(access: dict | None, completion_tokens: int) -> None:
    """The access record's completion tokens so far, and when the first one came."""
    if access is not None:
        access["completion"] = completion_tokens
        if completion_tokens:
            access.setdefault("first", time.perf_counter())

