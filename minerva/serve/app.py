"""The HTTP side: a FastAPI app with the OpenAI routes, errors in OpenAI's shape, and guards.

`build_app(llm, config)` wires an `AsyncEngine` (the engine's own thread) into the
routes. Every error a client can cause is a 4xx with `{"error": {...}}`; the guard
middleware answers 401 (missing key) and 413 (body too large) before any route runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from minerva.engine.request import Request
from minerva.engine.sampler import SamplingParams, TokenLogprob
from minerva.errors import MinervaError
from minerva.serve import protocol as P
from minerva.serve.async_engine import AsyncEngine, EngineDead, QueueFull, Tracked
from minerva.serve.metrics import Metrics

log = logging.getLogger("minerva.serve")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting: int = 256  # requests queued before the engine takes them; more get 503
    max_body_bytes: int = 4 << 20
    shutdown_timeout: float = 10.0  # seconds in-flight requests get on shutdown

    def __post_init__(self):
        if not isinstance(self.max_waiting, int) or self.max_waiting < 1:
            raise MinervaError(f"--max-waiting must be an integer >= 1, got {self.max_waiting!r}")
        if not self.shutdown_timeout >= 0:
            raise MinervaError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout!r}")
        if not self.served_model_name:
            raise MinervaError("--served-model-name must not be empty")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.headers = status, message, param, type, headers


def error_response(status: int, message: str, param: str | None = None,
                   type: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


ERRORS = {code: {"model": P.ErrorResponse, "description": what} for code, what in [
    (400, "Invalid request: a field out of range, or a prompt beyond the context"),
    (401, "Missing or wrong API key (when the server runs with --api-key)"),
    (404, "Unknown model"),
    (413, "Request body too large"),
    (503, "Waiting queue full (see Retry-After) or shutting down"),
]}


# ------------------------------------------------------------------ guards


class Guard:
    """ASGI middleware: the API key (401) and the body size (413), checked before routing.

    The body is read here (at most max_body_bytes of it) and replayed to the app, so a
    chunked upload cannot grow past the limit either.
    """

    PUBLIC = ("/health", "/metrics", "/docs", "/redoc", "/openapi.json")

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and not scope["path"].startswith(self.PUBLIC):
            if headers.get("authorization", "") != f"Bearer {self.api_key}":
                return await error_response(401, "missing or wrong API key: send the header "
                                                 "'Authorization: Bearer <key>' with the server's --api-key",
                                            type="authentication_error",
                                            headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        length = headers.get("content-length")
        too_big = error_response(413, f"the request body is larger than the limit of {self.max_body} bytes")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await too_big(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return await too_big(scope, receive, send)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)


async def _abort_on_disconnect(raw: HTTPRequest, engine: AsyncEngine, group) -> None:
    """Wait for the client to go away, then abort its requests (their KV blocks are freed)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            engine.abort(group)
            return


# ------------------------------------------------------------------ the app


def build_app(llm, config: ServerConfig, threads: int | None = None) -> FastAPI:
    """The app serving `llm`; `threads` is the engine thread's CPU thread count (default: the caller's)."""
    metrics = Metrics(config.served_model_name)
    engine = AsyncEngine(llm, metrics, max_waiting=config.max_waiting, threads=threads)
    tokenizer = llm.tokenizer
    max_model_len = llm.engine.max_model_len
    vocab = llm.config.vocab_size
    created = int(time.time())
    token_text_cache: dict[int, str] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.accepting = False  # new requests get 503 from here on
        deadline = time.monotonic() + config.shutdown_timeout
        while engine.num_unfinished and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_unfinished:
            log.warning("aborting %d requests still running after %.0f s", engine.num_unfinished,
                        config.shutdown_timeout)
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="Minerva", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server of the Minerva inference engine.")
    app.state.engine, app.state.metrics, app.state.llm = engine, metrics, llm
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes)

    # -------------------------------------------------------------- errors

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.type, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(where) or None
        msg = first.get("msg", "invalid request")
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        text = f"invalid field '{param}': {msg}{more}" if param else f"invalid request body: {msg}{more}"
        return error_response(400, text, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    # -------------------------------------------------------------- helpers

    def check_model(name: str | None) -> None:
        if name is not None and name != config.served_model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{config.served_model_name}' (see /v1/models)", "model")

    def sampling(body: P._Sampling, max_tokens: int, logprobs: int | None) -> SamplingParams:
        bias = {}
        for key, value in (body.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < vocab:
                raise APIError(400, f"logit_bias key '{key}' is not a token id in [0, {vocab})", "logit_bias")
            bias[token] = value
        try:
            return SamplingParams(max_tokens=max_tokens, n=body.n, temperature=body.temperature,
                                  top_k=max(body.top_k, 0), top_p=body.top_p, min_p=body.min_p,
                                  repetition_penalty=body.repetition_penalty,
                                  presence_penalty=body.presence_penalty,
                                  frequency_penalty=body.frequency_penalty, logit_bias=bias, seed=body.seed,
                                  logprobs=logprobs, stop=body.stop_list(), ignore_eos=body.ignore_eos,
                                  speculative_tokens=body.speculative_tokens)
        except MinervaError as exc:
            raise APIError(400, str(exc)) from None

    def encode(prompt: str | list[int]) -> list[int]:
        try:
            ids = llm.encode_prompt(prompt)
        except MinervaError as exc:
            raise APIError(400, str(exc), "prompt") from None
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization; give at least one token", "prompt")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is out of range: ids must be in [0, {vocab})", "prompt")
        return ids

    def build(prompts: list[list[int]], body: P._Sampling, max_tokens: int | None,
              logprobs: int | None) -> list[Request]:
        """Engine requests for every prompt (n each), checked against the limits."""
        requests = []
        for ids in prompts:
            room = max_model_len - len(ids)
            if room < 1 or (max_tokens is not None and max_tokens > room):
                asked = f" and max_tokens asks for {max_tokens} more" if max_tokens is not None else ""
                raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but the "
                                    f"prompt has {len(ids)} tokens{asked}; shorten the prompt or lower "
                                    f"max_tokens", "messages" if hasattr(body, "messages") else "prompt")
            try:
                requests += llm.make_requests(ids, sampling(body, max_tokens or room, logprobs))
            except MinervaError as exc:
                raise APIError(400, str(exc)) from None
        return requests

    def submit(requests: list[Request]):
        try:
            return engine.submit(requests)
        except QueueFull as exc:
            raise APIError(503, f"the server is busy: {exc}; retry later", type="server_overloaded",
                           headers={"Retry-After": "1"}) from None
        except EngineDead as exc:
            raise APIError(503, str(exc), type="server_unavailable", headers={"Retry-After": "5"}) from None

    def token_text(token_id: int) -> str:
        text = token_text_cache.get(token_id)
        if text is None:
            text = token_text_cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def finite(x: float) -> float:
        return x if math.isfinite(x) else -9999.0

    def chat_logprobs(items: list[TokenLogprob]) -> list[dict]:
        def one(token_id, lp):
            t = token_text(token_id)
            return {"token": t, "logprob": finite(lp), "bytes": list(t.encode())}
        return [{**one(x.token_id, x.logprob), "top_logprobs": [one(i, lp) for i, lp in x.top]} for x in items]

    def completion_logprobs(items: list[TokenLogprob], offset: int) -> dict:
        tokens = [token_text(x.token_id) for x in items]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [finite(x.logprob) for x in items],
                "top_logprobs": [{token_text(i): finite(lp) for i, lp in x.top} for x in items],
                "text_offset": offsets}

    def timings(tracked: list[Tracked], prompt_n: int, predicted_n: int) -> dict | None:
        sched = [t.scheduled_time for t in tracked if t.scheduled_time is not None]
        firsts = [t.request.first_token_time for t in tracked if t.request.first_token_time is not None]
        ends = [t.finish_time for t in tracked if t.finish_time is not None]
        if not (sched and firsts and ends):
            return None
        prompt_ms = max(min(firsts) - min(sched), 0.0) * 1e3
        predicted_ms = max(max(ends) - min(firsts), 0.0) * 1e3

        def rate(n, ms):
            return (ms / n if n else 0.0), (n / ms * 1e3 if ms > 0 else 0.0)

        (ppt, pps), (gpt, gps) = rate(prompt_n, prompt_ms), rate(predicted_n, predicted_ms)
        return {"prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": ppt,
                "prompt_per_second": pps, "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": gpt, "predicted_per_second": gps}

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def run(raw: HTTPRequest, requests: list[Request], chat: bool, body: P._Sampling,
                  prompt_tokens: int, prefixes: list[str], want_logprobs: bool):
        """Submit, then answer with one JSON body or an SSE stream."""
        group = submit(requests)
        watch = asyncio.ensure_future(_abort_on_disconnect(raw, engine, group))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": config.served_model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(group, watch, head, chat, include_usage, prompt_tokens, prefixes,
                                            want_logprobs),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts = [[p] for p in prefixes]
        logprobs: list[list[TokenLogprob]] = [[] for _ in requests]
        finish: list[str | None] = [None] * len(requests)
        completion_tokens = 0
        done = False
        try:
            async for t, d in engine.stream(group):
                texts[t.index].append(d.text)
                logprobs[t.index] += d.logprobs
                completion_tokens += len(d.token_ids)
                finish[t.index] = d.finish_reason or finish[t.index]
            done = True
        except MinervaError as exc:
            raise APIError(400, str(exc)) from None
        except RuntimeError as exc:  # the engine failed: a bug, reported as one, and the server goes on
            raise APIError(500, str(exc), type="server_error") from None
        finally:
            watch.cancel()
            if not done:
                engine.abort(group)
        choices = []
        for i, parts in enumerate(texts):
            text = "".join(parts)
            if chat:
                lp = {"content": chat_logprobs(logprobs[i])} if want_logprobs else None
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": finish[i]})
            else:
                lp = completion_logprobs(logprobs[i], len(prefixes[i])) if want_logprobs else None
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish[i]})
        return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens),
                "timings": timings(group.tracked, prompt_tokens, completion_tokens)}

    async def stream(group, watch, head: dict, chat: bool, include_usage: bool, prompt_tokens: int,
                     prefixes: list[str], want_logprobs: bool) -> AsyncIterator[str]:
        def event(choices: list[dict], **extra) -> str:
            return f"data: {json.dumps({**head, 'choices': choices, **extra}, allow_nan=False)}\n\n"

        def choice(i: int, text: str, finish: str | None, lps: list[TokenLogprob], offset: int) -> dict:
            if chat:
                lp = {"content": chat_logprobs(lps)} if want_logprobs else None
                return {"index": i, "delta": {"content": text} if text or not finish else {},
                        "logprobs": lp, "finish_reason": finish}
            lp = completion_logprobs(lps, offset) if want_logprobs else None
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

        completion_tokens = 0
        offsets = [len(p) for p in prefixes]
        done = False
        try:
            if chat:
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(group.requests))])
            elif any(prefixes):
                yield event([choice(i, p, None, [], 0) for i, p in enumerate(prefixes) if p])
            async for t, d in engine.stream(group):
                completion_tokens += len(d.token_ids)
                if d.text or d.token_ids or d.finish_reason:
                    yield event([choice(t.index, d.text, d.finish_reason, d.logprobs, offsets[t.index])])
                    offsets[t.index] += len(d.text)
            if include_usage:
                yield event([], usage=usage(prompt_tokens, completion_tokens),
                            timings=timings(group.tracked, prompt_tokens, completion_tokens))
            done = True
        except (MinervaError, RuntimeError) as exc:
            done = True
            code, kind = (400, "invalid_request_error") if isinstance(exc, MinervaError) else (500, "server_error")
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': kind, 'code': code}})}\n\n"
        finally:
            watch.cancel()
            if not done:  # the client went away (the response was cancelled): free its KV blocks
                engine.abort(group)
        yield "data: [DONE]\n\n"

    # -------------------------------------------------------------- routes

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=ERRORS,
              summary="Chat completion (streamed as server-sent events with stream: true)")
    async def chat_completions(body: P.ChatCompletionRequest, raw: HTTPRequest):
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = llm.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except MinervaError as exc:
            raise APIError(400, str(exc), "messages") from None
        ids = encode(prompt)
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requests = build([ids], body, max_tokens, logprobs)
        result = await run(raw, requests, True, body, len(ids), [""] * len(requests), body.logprobs)
        return _json(result)

    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=ERRORS,
              summary="Text completion (streamed as server-sent events with stream: true)")
    async def completions(body: P.CompletionRequest, raw: HTTPRequest):
        check_model(body.model)
        prompts = body.prompts()
        if not prompts or len(prompts) > P.MAX_PROMPTS:
            raise APIError(400, f"give between 1 and {P.MAX_PROMPTS} prompts", "prompt")
        if body.suffix:
            raise APIError(400, "suffix is not supported: put the text in the prompt", "suffix")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (no prompt logprobs); drop one of them",
                           "echo")
        ids = [encode(p) for p in prompts]
        requests = build(ids, body, body.max_tokens, body.logprobs)
        prefixes = [""] * len(requests)
        if body.echo:
            prefixes = [p if isinstance(p, str) else tokenizer.decode(i)
                        for p, i in zip(prompts, ids) for _ in range(body.n)]
        result = await run(raw, requests, False, body, sum(map(len, ids)), prefixes, body.logprobs is not None)
        return _json(result)

    @app.get("/v1/models", response_model=P.ModelList, responses={401: ERRORS[401]})
    async def models():
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model",
                                            "created": created, "owned_by": "minerva",
                                            "max_model_len": max_model_len}]}

    @app.get("/health", response_model=P.Health, responses={503: ERRORS[503]})
    async def health():
        if not engine.alive or not engine.accepting:
            return error_response(503, "the engine is not running", type="server_unavailable")
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse,
             summary="Prometheus metrics (minerva:* names, like vLLM's vllm:*)")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=ERRORS)
    async def tokenize(body: P.TokenizeRequest):
        check_model(body.model)
        if body.messages is not None:
            try:
                text = llm.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages],
                                               add_generation_prompt=body.add_generation_prompt)
            except MinervaError as exc:
                raise APIError(400, str(exc), "messages") from None
            ids = llm.encode_prompt(text)
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: P.DetokenizeRequest):
        check_model(body.model)
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range: ids must be in [0, {vocab})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    return app


def _json(result):
    """A handler's result: a ready response (stream) or a dict sent without re-validation."""
    if isinstance(result, Response):
        return result
    return JSONResponse(result)
