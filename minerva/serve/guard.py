"""What answers before and around the routes: the guard middleware (API key 401, body size
413, body deadline 408) and the exception handlers that turn every error a client can cause
into OpenAI's `{"error": {...}}` body."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time

from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import Counter
from starlette.routing import Match
from starlette.exceptions import HTTPException as StarletteHTTPException

from minerva.errors import MinervaError
from minerva.serve import anthropic, convert, lenient, metrics, ollama
from minerva.serve.convert import ACCESS
from minerva.serve.convert import APIError
from minerva.serve.json_response import JSONResponse

log = logging.getLogger("minerva.serve")
access_log = logging.getLogger("minerva.access")


def error_response(status: int, message: str, param: str | None = None,
                   type: str = "invalid_request_error", headers: dict | None = None,
                   path: str | None = None) -> JSONResponse:
    """OpenAI's error body, or Anthropic's or Ollama's for their routes (`path`); what it echoes of a request
    is made encodable here, once for every route (a lone surrogate is written as its escape,
    `\\ud800`)."""
    if path is not None and path.startswith(anthropic.PATH):
        return JSONResponse(anthropic.error_body(status, encodable(message)), status_code=status, headers=headers)
    if path is not None and path.startswith(ollama.PREFIX):
        return JSONResponse(ollama.error_body(encodable(message)), status_code=status, headers=headers)
    body = convert.error_body(status, encodable(message), None if param is None else encodable(param), type)
    return JSONResponse(body, status_code=status, headers=headers)


def encodable(text: str) -> str:
    """`text` with every code point UTF-8 cannot encode (a lone surrogate) as its escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")  # a JSON escape that may be half a pair
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(body: bytes) -> tuple[str, str | None] | None:
    """The 400 message and field for a JSON body holding a lone surrogate (`"\\ud800"`, which is no Unicode
    text: nothing could encode it, not a tokenizer, not a response), naming the field; None
    for any other body (one that is not JSON is left to the routes' parser)."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[tuple, object]] = [((), value)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    return _surrogate_message((*where, key), key, "a key")
                stack.append(((*where, key), item))
        elif isinstance(value, list):
            stack += [((*where, i), item) for i, item in enumerate(value)]
        elif isinstance(value, str) and _SURROGATE.search(value):
            return _surrogate_message(where, value, "text")
    return None


def _surrogate_message(where: tuple, text: str, what: str) -> tuple[str, str | None]:
    field = encodable(".".join(map(str, where)))
    code = ord(_SURROGATE.search(text).group())
    place = f"invalid field '{field}'" if field else "invalid request body"
    subject = "its name" if what == "a key" else "its text"
    return (f"{place}: {subject} holds a lone surrogate U+{code:04X}, which is not Unicode; "
            f"send whole characters (a surrogate pair, or the character itself as UTF-8)"), field or None


# ------------------------------------------------------------------ guards


def headless(send):
    """`send` with every piece of the body left out (a HEAD's answer)."""
    async def send_headers(message):
        await send({**message, "body": b""} if message["type"] == "http.response.body" else message)
    return send_headers


class Guard:
    """ASGI middleware: the API key (401), the body size (413) and the body's deadline (408),
    checked before routing.

    The body is read here (at most max_body_bytes of it, all within body_timeout seconds) and
    replayed to the app, so a chunked upload cannot grow past the limit, nor a slow one hold
    its connection, either.
    """

    # What answers without the key: the health check, and the chat page with its files (they
    # hold nothing; the page asks for the key). Everything else, /metrics and the API's own
    # docs (/docs, /redoc, /openapi.json) included, needs it.
    PUBLIC = frozenset({"/", "/health"})
    PUBLIC_UNDER = "/ui/"

    def __init__(self, app, api_key: str | None, max_body_bytes: int, body_timeout: float):
        self.app, self.api_key, self.max_body, self.body_timeout = app, api_key, max_body_bytes, body_timeout

    def authorized(self, headers: dict) -> bool:
        """`Authorization: Bearer KEY`, the scheme in any case (RFC 7235), or Anthropic's
        `x-api-key: KEY`; the key compared in constant time."""
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            return True
        return hmac.compare_digest(headers.get("x-api-key", "").strip().encode(), self.api_key.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and not (scope["path"] in self.PUBLIC or scope["path"].startswith(self.PUBLIC_UNDER)):
            if sum(k.lower() == b"authorization" for k, _ in scope["headers"]) > 1:
                return await error_response(400, "the request has more than one Authorization header; "
                                                 "send one: 'Authorization: Bearer <key>'",
                                            type="authentication_error", path=scope["path"])(scope, receive, send)
            if not self.authorized(headers):
                return await error_response(401, "missing or wrong API key: send the header "
                                                 "'Authorization: Bearer <key>' (or 'x-api-key: <key>') with the "
                                                 "server's --api-key",
                                            type="authentication_error", path=scope["path"],
                                            headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        length = headers.get("content-length")
        too_big = error_response(413, f"the request body is larger than the limit of {self.max_body} bytes",
                                 path=scope["path"], headers={"Connection": "close"})  # its rest goes unread
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await too_big(scope, receive, send)
        if scope["method"] == "HEAD":  # a GET's status and headers without its body (RFC 9110; Ollama's CLI checks HEAD /)
            return await self.app({**scope, "method": "GET"}, receive, headless(send))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                return await error_response(408, f"the request body did not arrive within {self.body_timeout:g} s "
                                                 f"(the server's --body-timeout)", path=scope["path"],
                                            headers={"Connection": "close"})(scope, receive, send)
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return await too_big(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        unreadable = lone_surrogate(body)
        if unreadable is not None:
            return await error_response(400, *unreadable, path=scope["path"])(scope, receive, send)
        if body:
            relaxed, ignored, retyped = lenient.relax(body, headers.get("content-type"),
                                                      drop=scope["path"] in lenient.ROUTES)
            if ignored or retyped:
                body, scope = relaxed, lenient.with_headers(scope, relaxed, retyped)
            if ignored:
                send = lenient.naming(send, ignored)
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)


class AccessLog:
    """ASGI middleware: one INFO line on `minerva.access` per HTTP request once it has ended
    (answered, or left by its client): client, method, route, status, and for completions the
    prompt and completion tokens and the time to the first token, then the whole duration.

        127.0.0.1:50312 "POST /v1/chat/completions" 200 prompt=31 completion=64 ttft=0.041s 0.388s

    With a `registry`, every request also counts in `minerva:http_requests_total` by route
    (the route's template, e.g. `/v1/responses/{response_id}`; `other` for none), method and status.
    """

    def __init__(self, app, routes=None, registry=None):
        self.app, self.routes = app, routes
        self.requests = None if registry is None else metrics.family(
            registry, Counter, "minerva:http_requests", "HTTP requests by route, method and status.",
            ["route", "method", "status"])

    def route_of(self, scope) -> str:
        for route in self.routes() if self.routes is not None else ():
            if getattr(route, "path", None) and route.matches(scope)[0] == Match.FULL:
                return route.path
        return "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        record = scope[ACCESS] = {}
        status = []

        async def sent(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            if self.requests is not None:
                self.requests.labels(route=self.route_of(scope), method=scope["method"],
                                     status=str(status[0]) if status else "-").inc()
            if access_log.isEnabledFor(logging.INFO):
                self.log(scope, record, status, start)

    @staticmethod
    def log(scope, record: dict, status: list, start: float) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        usage = f" load={record['load']:.3f}s" if "load" in record else ""  # the model loaded for it
        if "prompt" in record:
            usage += f" prompt={record['prompt']} completion={record.get('completion', 0)}"
            if "first" in record:
                usage += f" ttft={record['first'] - start:.3f}s"
        path = "".join(c if c.isprintable() else repr(c)[1:-1] for c in scope["path"])  # one line, always
        access_log.info('%s "%s %s" %s%s %.3fs', who, scope["method"], path,
                        status[0] if status else "-", usage, time.perf_counter() - start)


# ------------------------------------------------------------------ errors


async def _api_error(request, exc: APIError):
    return error_response(exc.status, exc.message, exc.param, exc.type, exc.headers, request.url.path)


async def _minerva_error(request, exc: MinervaError):
    """The engine's and the tokenizer's verdict on a request (a prompt beyond the KV pool, a
    token id beyond the vocabulary, a sampling value out of range): the client's fault, naming
    the field it is about where it is about one."""
    return error_response(400, str(exc), exc.field, path=request.url.path)


async def _validation_error(request, exc: RequestValidationError):
    errors = exc.errors()
    first = convert.telling_error(errors) if errors else {}
    param = convert.error_field(first) or None
    msg = convert.error_message(first)
    others = len({convert.error_field(e).split(".")[0] for e in errors} - {(param or "").split(".")[0]})
    more = f" (and {others} more field{'s' if others > 1 else ''} with problems)" if others else ""
    text = f"invalid field '{param}': {msg}{more}" if param else f"invalid request body: {msg}{more}"
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        text = "the request body is empty; send one JSON object with the request's fields"
    elif first.get("type") == "extra_forbidden":
        text = f"unknown field '{param}': this server does not implement it; leave it out{more}"
    elif first.get("type") == "json_invalid":  # its location is a character offset, not a field
        param = None
        text = (f"the body is not valid JSON ({(first.get('ctx') or {}).get('error', msg)} at character "
                f"{first.get('loc', ('', '?'))[-1]}); send one JSON object")
    return error_response(400, text, param, path=request.url.path)


async def _http_error(request, exc: StarletteHTTPException):
    """Starlette's own errors, worded for a client: an unknown route (404), a route that does not
    take the method (405)."""
    path = request.url.path
    where = f"{request.method} {convert.clipped(path)}"
    message = str(exc.detail)
    if exc.status_code == 404 and exc.detail == "Not Found":
        bare = path.rstrip("/")  # routes have one spelling, as OpenAI's: no redirect to the one without the /
        if bare != path and any(getattr(route, "path", None) and route.matches({**request.scope, "path": bare})[0]
                                != Match.NONE for route in request.app.router.routes):
            message = f"Invalid URL ({where}): no such route; did you mean {convert.clipped(bare)}, without the '/'?"
        else:
            message = f"Invalid URL ({where}): no such route; the routes are listed at /docs"
    elif exc.status_code == 400 and exc.detail == "There was an error parsing the body":
        encoding = request.headers.get("content-encoding")
        message = (f"the body is {encoding}-encoded, which this server does not read; send it uncompressed"
                   if encoding and encoding != "identity" else
                   "the body could not be read as JSON (UTF-8 text, nested at most a few hundred levels, numbers "
                   "of at most a few thousand digits); send one JSON object")
    elif exc.status_code == 405:  # every route of this path, not only the first one's methods
        methods = sorted({m for route in request.app.router.routes if getattr(route, "methods", None)
                          and route.matches(request.scope)[0] != Match.NONE for m in route.methods} - {"HEAD"})
        allowed = ", ".join(methods) or (exc.headers or {}).get("Allow")
        exc.headers = {**(exc.headers or {}), "Allow": allowed} if allowed else exc.headers
        message = f"Invalid method ({where})" + (f": this route takes {allowed}" if allowed else "")
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None), path=request.url.path)


HANDLERS = {APIError: _api_error, MinervaError: _minerva_error, RequestValidationError: _validation_error,
            StarletteHTTPException: _http_error}


# the pages of this machine: what a browser may call the API from by default (as Ollama)
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]+)?"


def install(app, config, registry=None) -> None:
    """The middleware and error handlers of every app: from the outside in, the access log
    (and `minerva:http_requests_total` in `registry`), CORS (`config.allowed_origins`; it
    answers browsers' preflight requests, which carry no API key), then the guard."""
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       body_timeout=config.body_timeout)
    origins = config.allowed_origins
    app.add_middleware(CORSMiddleware, allow_origins=list(origins or ()),
                       allow_origin_regex=LOCAL_ORIGINS if origins is None else None,
                       allow_methods=["*"], allow_headers=["*"],
                       expose_headers=["retry-after", lenient.HEADER.decode()])
    app.add_middleware(AccessLog, routes=lambda: app.routes, registry=registry)  # outermost: sees the guard's answers too
    app.router.redirect_slashes = False  # a path with a '/' too many is a 404 naming the route, not an empty 307
    for exc_type, handler in HANDLERS.items():
        app.add_exception_handler(exc_type, handler)
