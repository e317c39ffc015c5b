"""The HTTP side: a FastAPI app with the OpenAI routes, errors in OpenAI's shape, and guards.

`build_app(llm, config)` wires an `AsyncEngine` (the engine's own thread) into the
routes of `OpenAIRoutes`; what the routes convert (bodies, results) lives in `convert`.
Every error a client can cause is a 4xx with `{"error": {...}}`; the guard middleware
(`guard`) answers 401 (missing key), 413 (body too large) and 408 (body too slow) before any
route runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from minerva.engine.request import Request
from minerva.engine.sampler import SamplingParams, TokenLogprob
from minerva.errors import MinervaError
from minerva.formats.chat import TemplateLimitError
from minerva.engine.structured import StructuredOutput
from minerva.parsers.reasoning import ReasoningParser
from minerva.parsers.tool_calls import ToolParser, join_pieces
from minerva.parsers.tools import ToolPlan
from minerva.serve import convert
from minerva.serve import protocol as P
from minerva.serve.async_engine import AsyncEngine, EngineDead, Group, QueueFull
from minerva.serve.convert import APIError, Reply
from minerva.serve.guard import ACCESS, HANDLERS, AccessLog, Guard, error_response
from minerva.serve.metrics import Metrics

log = logging.getLogger("minerva.serve")
STATIC = Path(__file__).parent / "static"  # the chat page


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

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the model is served under, the first one first, each once."""
        return tuple(dict.fromkeys((self.served_model_name, *self.aliases)))


ERRORS = {code: {"model": P.ErrorResponse, "description": what} for code, what in [
    (400, "Invalid request: a field out of range, or a prompt beyond the context"),
    (401, "Missing or wrong API key (when the server runs with --api-key)"),
    (404, "Unknown model"),
    (408, "The request head or body took longer than --header-timeout / --body-timeout"),
    (413, "Request body too large"),
    (500, "The model's chat template exceeded its limits, or the engine failed on this request"),
    (503, "Waiting queue full (see Retry-After), too many connections, or shutting down"),
]}


async def _abort_on_disconnect(raw: HTTPRequest, engine: AsyncEngine, group) -> None:
    """Wait for the client to go away, then abort its requests (their KV blocks are freed)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            engine.abort(group)
            return


# ------------------------------------------------------------------ the routes


class OpenAIRoutes:
    """The routes over one model and the engine thread they feed.

    A completion handler turns its body into checked engine requests (`convert`,
    `LLM.make_requests`), submits them, and answers with one JSON body or an SSE stream.
    """

    def __init__(self, llm, engine: AsyncEngine, metrics: Metrics, config: ServerConfig):
        self.llm, self.engine, self.metrics, self.config = llm, engine, metrics, config
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.engine.max_model_len
        # A prompt longer than this many characters cannot fit the context, whatever its tokens.
        self.max_prompt_chars = self.max_model_len * llm.tokenizer.max_token_chars
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}

    def register(self, app: FastAPI) -> None:
        app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=ERRORS,
                 summary="Chat completion (streamed as server-sent events with stream: true)")(
            self.chat_completions)
        app.post("/v1/completions", response_model=P.CompletionResponse, responses=ERRORS,
                 summary="Text completion (streamed as server-sent events with stream: true)")(self.completions)
        app.post("/v1/embeddings", response_model=P.EmbeddingResponse, responses=ERRORS,
                 summary="Embeddings: the final hidden state of each input's last token, L2-normalized")(
            self.embeddings)
        app.get("/v1/models", response_model=P.ModelList, responses={401: ERRORS[401]})(self.models)
        app.get("/v1/models/{model_id:path}", response_model=P.ModelCard,
                responses={401: ERRORS[401], 404: ERRORS[404]})(self.model)
        app.get("/health", response_model=P.Health, responses={503: ERRORS[503]})(self.health)
        app.get("/metrics", response_class=PlainTextResponse,
                summary="Prometheus metrics (minerva:* names, like vLLM's vllm:*)")(self.prometheus)
        app.get("/", response_class=HTMLResponse, include_in_schema=False)(self.page)
        app.mount("/ui", StaticFiles(directory=STATIC), name="ui")
        app.post("/tokenize", response_model=P.TokenizeResponse, responses=ERRORS)(self.tokenize)
        app.post("/detokenize", response_model=P.DetokenizeResponse, responses=ERRORS)(self.detokenize)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        """The engine thread runs while the app does. On shutdown (`minerva serve` drains before
        its connections close, see `server.Server`; this covers other hosts), in-flight requests
        get shutdown_timeout to finish before the rest are aborted."""
        self.engine.start()
        yield
        await self.engine.drain(self.config.shutdown_timeout)
        await asyncio.to_thread(self.engine.stop)

    # -------------------------------------------------------------- routes

    async def chat_completions(self, body: P.ChatCompletionRequest, raw: HTTPRequest) -> Response:
        self.check_model(body.model)
        convert.check_supported(body)
        variables = convert.template_variables(body)
        tools = convert.tool_plan(body, self.llm.tool_format)
        if tools is not None and tools.forced:
            await self.check_parameters(tools)
        prompt = await self.chat_prompt(body.messages, body.add_generation_prompt, variables,
                                        tools.prompt_tools if tools else None)
        ids = await self.encode(prompt, "messages")
        requests = await self.requests([ids], body, convert.chat_max_tokens(body), convert.chat_logprobs_count(body),
                                 "messages", chat=True, tools=tools)
        fmt = self.llm.reasoning  # a model that reasons first: each choice split by a parser of its own
        if tools is not None and tools.held_to_json(self.llm.tool_format):
            fmt = None  # the reply is the call's JSON from its first token: there is no reasoning to split
        parsers = [fmt.parser(prompt) for _ in requests] if fmt is not None else None
        callers = None
        if tools is not None and tools.choice != "none":  # harmony's calls are read by its reasoning parser
            callers = [tools.parser(self.llm.tool_format, parsers[i] if parsers else None)
                       for i in range(len(requests))]
        return await self.answer(raw, requests, body, True, body.logprobs, len(ids), [""] * len(requests),
                                 parsers, callers)

    async def completions(self, body: P.CompletionRequest, raw: HTTPRequest) -> Response:
        self.check_model(body.model)
        convert.check_supported(body)
        prompts = convert.completion_prompts(body)
        ids = [await self.encode(p, "prompt") for p in prompts]
        requests = await self.requests(ids, body, body.max_tokens, body.logprobs, "prompt")
        prefixes = [""] * len(requests)
        if body.echo:
            prefixes = [p if isinstance(p, str) else self.tokenizer.decode(i)
                        for p, i in zip(prompts, ids) for _ in range(body.n)]
        return await self.answer(raw, requests, body, False, body.logprobs is not None, sum(map(len, ids)),
                                 prefixes)

    async def embeddings(self, body: P.EmbeddingRequest, raw: HTTPRequest):
        self.check_model(body.model)
        width = self.llm.config.hidden_size
        if body.dimensions is not None and body.dimensions != width:
            raise APIError(400, f"this model's embeddings have {width} dimensions; leave out dimensions "
                                f"(got {body.dimensions})", "dimensions")
        ids = [await self.encode(p, "input") for p in body.inputs()]
        requests = await self.requests(ids, body, 1, None, "input", fixed=convert.embedding_params())
        group = self.submit(requests)
        async for _ in self.whole(group, asyncio.ensure_future(_abort_on_disconnect(raw, self.engine, group))):
            pass
        tokens = sum(map(len, ids))
        raw.scope.get(ACCESS, {})["prompt"] = tokens
        return {"object": "list", "model": body.model or self.config.served_model_name,
                "data": [{"object": "embedding", "index": i,
                          "embedding": convert.embedding_vector(r.embedding, body.encoding_format)}
                         for i, r in enumerate(requests)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def models(self):
        return {"object": "list", "data": [self.card(name) for name in self.config.names]}

    async def model(self, model_id: str):
        self.check_model(model_id)
        return self.card(model_id)

    def card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "minerva",
                "root": str(self.llm.path), "max_model_len": self.max_model_len}

    async def page(self):
        """The chat page (static files under /ui, served from the package: it works offline)."""
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

    async def health(self):
        if not self.engine.alive or not self.engine.accepting:
            return error_response(503, "the engine is not running", type="server_unavailable")
        return {"status": "ok"}

    async def prometheus(self):
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, body: P.TokenizeRequest):
        self.check_model(body.model)
        if body.messages is not None:
            ids = await self.encode(await self.chat_prompt(body.messages, body.add_generation_prompt), "messages")
        else:
            ids = await self.encode(body.prompt, "prompt", body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize(self, body: P.DetokenizeRequest):
        self.check_model(body.model)
        return {"prompt": self.tokenizer.decode(body.tokens)}  # an id beyond the vocabulary: a 400

    # -------------------------------------------------------------- requests

    def check_model(self, name: str | None) -> None:
        names = self.config.names
        if name is not None and name not in names:
            served = " or ".join(f"'{n}'" for n in names)
            raise APIError(404, f"the model '{name}' does not exist; this server serves {served} "
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

    async def compile(self, spec: StructuredOutput | None) -> None:
        """Compile an output constraint on the engine's grammar workers, within their budget,
        while this request alone waits (neither the event loop nor the engine's steps do); a
        MinervaError (a 400) when it is refused. The engine's own check then finds it cached."""
        if spec is None:
            return
        grammars = self.llm.engine.grammars
        compiling = asyncio.wrap_future(grammars.submit(spec))
        await asyncio.wait({asyncio.wrap_future(grammars.tokenizer_ready())})  # once an engine: outside the budget
        done, _ = await asyncio.wait({compiling}, timeout=grammars.seconds)  # never cancels the compilation
        _, error = compiling.result() if done else (None, grammars.too_slow(spec))
        if error is not None:
            raise MinervaError(error)

    async def chat_prompt(self, messages: list[P.ChatMessage], add_generation_prompt: bool,
                          variables: dict | None = None, tools: list[dict] | None = None) -> str:
        """The conversation rendered by the model's chat template, on a worker thread: a template
        is code from the model file, and its time is bounded by the renderer, not the event loop."""
        try:
            return await asyncio.to_thread(self.llm.apply_chat_template, convert.chat_messages(messages),
                                           add_generation_prompt=add_generation_prompt, tools=tools,
                                           **(variables or {}))
        except TemplateLimitError as exc:  # the model file's template ran away, not the request
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
        requests = []
        forced = tools.output(self.llm.tool_format) if tools is not None else None
        for i, ids in enumerate(prompts):
            limit = convert.max_tokens_within(len(ids), max_tokens, self.max_model_len, param)
            params = fixed or convert.sampling_params(body, limit, logprobs, forced)
            if i == 0:  # every prompt has the same constraint
                await self.compile(params.structured)
            if chat:
                params = self.llm.chat_params(params, tools=tools is not None and tools.choice == "auto")
            requests += self.llm.make_requests(ids, params)
        if len(requests) > self.config.max_waiting:  # could never be queued: not a matter of retrying
            raise APIError(400, f"this request asks for {len(requests)} completions (prompts x n), more than "
                                f"the server queues at once (--max-waiting {self.config.max_waiting}); "
                                f"split it", "n")
        return requests

    def submit(self, requests: list[Request]) -> Group:
        try:
            return self.engine.submit(requests)
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
        group = self.submit(requests)
        access = raw.scope.get(ACCESS, {})  # what the access log line says of this request
        access["prompt"] = prompt_tokens
        watch = asyncio.ensure_future(_abort_on_disconnect(raw, self.engine, group))
        reply = Reply.new(chat, want_logprobs, body.model or self.config.served_model_name, self.token_text,
                          reasoning=parsers is not None)
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
            raise APIError(400, str(exc)) from None
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
        completion_tokens = 0
        async for t, d in self.whole(group, watch):
            texts[t.index].append(d.text)
            logprobs[t.index] += d.logprobs
            completion_tokens += len(d.token_ids)
            note(access, completion_tokens)
            finish[t.index] = d.finish_reason or finish[t.index]
        choices = []
        for i, parts in enumerate(texts):
            thought, text = parsers[i].feed("".join(parts), end=True) if parsers else ("", "".join(parts))
            calls = []
            if callers:
                text, pieces = callers[i].feed(text, end=True)
                calls = join_pieces(pieces)
            choices.append(reply.choice(i, text, finish[i], logprobs[i], len(prefixes[i]), thought, calls))
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
                pieces, finish, end = [], d.finish_reason, d.finish_reason is not None
                if parsers:  # a chunk only for new text: marker tokens alone say nothing
                    thought, text = parsers[t.index].feed(d.text, end=end)
                    news = thought or text or d.logprobs
                if callers:  # text inside a call is held until the call is whole
                    text, pieces = callers[t.index].feed(text, end=end)
                    news = thought or text or pieces or d.logprobs
                    finish = convert.finish_reason(finish, callers[t.index].called)
                if news or finish:
                    yield reply.chunk([reply.delta(t.index, text, finish, d.logprobs, offsets[t.index],
                                                   thought, pieces)])
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


# ------------------------------------------------------------------ the app


def build_app(llm, config: ServerConfig, threads: int | None = None) -> FastAPI:
    """The app serving `llm`; `threads` is the engine thread's CPU thread count (default: the caller's)."""
    metrics = Metrics(config.served_model_name)
    engine = AsyncEngine(llm, metrics, max_waiting=config.max_waiting, threads=threads)
    routes = OpenAIRoutes(llm, engine, metrics, config)
    app = FastAPI(title="Minerva", version="0.1.0", lifespan=routes.lifespan,
                  description="OpenAI-compatible server of the Minerva inference engine.")
    app.state.engine, app.state.metrics, app.state.llm = engine, metrics, llm
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       body_timeout=config.body_timeout)
    app.add_middleware(AccessLog)  # outermost: it sees the guard's answers too
    for exc_type, handler in HANDLERS.items():
        app.add_exception_handler(exc_type, handler)
    routes.register(app)
    return app
