"""Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`): what Open WebUI, editors' Ollama providers and many scripts speak, as a
converter onto the OpenAI routes.

`/api/chat` and `/api/generate` become chat (or, with `raw`, text) completion requests with
Ollama's `options` mapped onto the sampling fields, `format` onto structured output, `think`
onto the template's thinking switch; answers come back as Ollama's objects, streamed as
NDJSON by default, with the timing fields (`total_duration`, `prompt_eval_duration`,
`eval_count`, ...) in nanoseconds from the engine's own timings. Errors are `{"error": ...}`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from minerva import __version__
from minerva.errors import MinervaError
from minerva.formats.generation import sampling_defaults, value_text
from minerva.models.loader import read_config
from minerva.serve import ollama_pull
from minerva.serve import protocol as P
from minerva.serve.convert import ACCESS, APIError, arguments_object, chunks, clipped, prefill, validated
from minerva.serve.json_response import JSONResponse
from minerva.serve.ollama_models import details, shown

PREFIX = "/api/"
# options that cannot change the answer here (the context, threads, batch, memory layout) or
# that ask for nothing (-> the value that does)
IGNORED_OPTIONS = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa",
                   "low_vram", "f16_kv", "vocab_only", "num_keep", "penalize_newline", "repeat_last_n"}
NEUTRAL_OPTIONS = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}
OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
           "min_p": "min_p", "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# the chat request's fields as this API names them, for the errors of the chat route's checks
FIELD_NAMES = {**{field: f"options.{name}" for name, field in OPTIONS.items()}, "response_format": "format"}
RESPONSE_FORMAT = re.compile(r"\bresponse_format(\.json_schema(\.schema)?)?\b")  # `format`, in the chat route's errors
KNOWN_OPTIONS = OPTIONS.keys() | NEUTRAL_OPTIONS.keys() | IGNORED_OPTIONS
# Ollama's defaults for the options a request leaves out (its repeat_penalty 1.1 over the last 64
# tokens is left out: Ollama's own engine applies no repeat penalty, and it would act here on
# the whole conversation)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}


def error_body(message: str) -> dict:
    return {"error": message}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    function: ToolCallFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # tool_name, thinking: not sent back to the model
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None


class _Request(_Body):
    model: str
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None
    think: bool | str | None = None


class ChatRequest(_Request):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Request):
    prompt: str = ""
    system: str | None = None
    suffix: str | None = None
    raw: bool = False
    images: list[str] | None = None
    template: str | None = None
    context: list[int] | None = None


class EmbedRequest(_Body):
    model: str
    input: str | list[str] = ""
    prompt: str | None = None  # /api/embeddings' spelling
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    dimensions: int | None = None


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool = False


def served_name(name: str) -> str:
    """Ollama's `NAME:latest` is NAME."""
    return name[:-len(":latest")] if name.endswith(":latest") else name


def duration(value: str | int | float | None) -> float | None:
    """keep_alive in seconds: a number, or a duration such as 5m, 1h30m, 300ms (-1: forever, None)."""
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise APIError(400, f"keep_alive must be a finite number of seconds (-1: forever), got {value!r}",
                           "keep_alive")
        return None if value < 0 else float(value)
    text = str(value).strip()
    try:
        return duration(float(text))
    except ValueError:
        pass
    parts = re.fullmatch(r"(-)?((?:\d+(?:\.\d+)?(?:ms|h|m|s))+)", text)
    if parts is None:
        raise APIError(400, f"keep_alive must be seconds or a duration such as 5m or 1h, got {value!r}", "keep_alive")
    units = {"ms": 0.001, "h": 3600, "m": 60, "s": 1}
    seconds = sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", parts[2]))
    return None if parts[1] else seconds


# ------------------------------------------------------------------ requests


def sampling(body: _Request) -> dict:
    """Ollama's options and format as chat/completion request fields."""
    fields: dict = {}
    for name, value in (body.options or {}).items():
        if name in OPTIONS:
            if name == "num_predict":
                if not isinstance(value, int) or isinstance(value, bool) or not (value > 0 or value in (-1, -2)):
                    raise APIError(400, "options.num_predict must be a positive integer, -1 (no limit) or -2 (fill "
                                        f"the context), got {value!r}", "options.num_predict")
                # -1 (no limit) and -2 (fill the context): up to the context, past a model's own default
                fields["max_tokens"] = value if value > 0 else 2**31 - 1
                continue
            fields[OPTIONS[name]] = [value] if name == "stop" and isinstance(value, str) else value
        elif name in NEUTRAL_OPTIONS:
            if value != NEUTRAL_OPTIONS[name]:
                raise APIError(400, f"the option '{name}' is not implemented by this server; leave it out (or "
                                    f"{NEUTRAL_OPTIONS[name]})", f"options.{name}")
        elif name not in IGNORED_OPTIONS:
            raise APIError(400, f"unknown option '{name}'", f"options.{name}")
    if body.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
    elif body.format not in (None, ""):
        raise APIError(400, f"format must be \"json\" or a JSON schema, got {body.format!r}", "format")
    if isinstance(body.think, bool):  # Qwen3-style templates read it; others ignore it
        fields["chat_template_kwargs"] = {"enable_thinking": body.think}
    elif body.think in ("low", "medium", "high"):
        fields["reasoning_effort"] = body.think
    elif body.think is not None:
        raise APIError(400, f"think must be true, false, \"low\", \"medium\" or \"high\", got {body.think!r}", "think")
    return {**fields, "stream": body.stream, **({"stream_options": {"include_usage": True}} if body.stream else {})}


def chat_messages(messages: list[Message]) -> list[dict]:
    """Ollama's messages as chat messages: tool calls get ids, and each tool result answers the
    earliest call not answered yet (Ollama's messages carry no ids)."""
    out, pending = [], []
    for i, m in enumerate(messages):
        if m.images:
            raise APIError(400, f"messages.{i}: images are not supported: this server runs text-only models", "messages")
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                args = c.function.arguments
                calls.append({"id": f"call_{i}_{j}", "type": "function", "function": {
                    "name": c.function.name, "arguments": args if isinstance(args, str) else json.dumps(args)}})
            pending += [c["id"] for c in calls]
            out.append({"role": "assistant", "content": m.content or None, "tool_calls": calls})
        elif m.role == "tool":
            out.append({"role": "tool", "tool_call_id": pending.pop(0) if pending else f"call_{i}", "content": m.content})
        elif m.role in ("system", "user", "assistant"):
            out.append({"role": m.role, "content": m.content})
        else:
            raise APIError(400, f"messages.{i}: role must be system, user, assistant or tool, got {m.role!r}",
                           "messages")
    return out


@functools.lru_cache(maxsize=64)
def model_parameters(root: str, digest: str) -> tuple[str, int | None]:
    """The model's own sampling defaults as /api/show's `parameters` (a Modelfile's lines), its trained context;
    kept per `digest` (its /api/tags entry's: the files' path, size and time), as each read parses the header."""
    try:
        defaults, trained = sampling_defaults(Path(root)), read_config(Path(root)).max_position
    except (MinervaError, OSError):  # not a local model (a repo not yet fetched): none known
        return "", None
    names = {option: name for name, option in OPTIONS.items()}
    return "\n".join(f"{names[field]:<30} {value_text(value)}" for field, value in defaults.items()), trained


def to_context(request, think=None):
    """A request whose num_predict is cut at the context, as Ollama's is (the API's 400 otherwise);
    one that asks to `think` is refused by a model that does not reason, as Ollama refuses it; its
    sampling options default to Ollama's where the model has no default of its own."""
    request._to_context = True
    request._fallback = DEFAULTS
    request._thinks = think is True or think in ("low", "medium", "high")
    return request


def chat_request(body: ChatRequest) -> P.ChatCompletionRequest:
    messages = chat_messages(body.messages)
    fields = {"model": served_name(body.model), "messages": messages, **sampling(body), **prefill(messages)}
    if body.tools:
        fields["tools"] = body.tools
    return to_context(validated(P.ChatCompletionRequest, fields, FIELD_NAMES), body.think)


def generate_request(body: GenerateRequest) -> P.ChatCompletionRequest | P.CompletionRequest:
    """A chat request (the prompt as the user's turn, through the template) or, with `raw`, a text one."""
    for name in ("images", "template", "context", "suffix"):
        if getattr(body, name):
            raise APIError(400, f"'{name}' is not supported by this server's /api/generate; leave it out", name)
    fields = {"model": served_name(body.model), **sampling(body)}
    if body.raw:
        fields.pop("chat_template_kwargs", None), fields.pop("reasoning_effort", None)
        return to_context(validated(P.CompletionRequest, {**fields, "prompt": body.prompt}, FIELD_NAMES))
    system = [{"role": "system", "content": body.system}] if body.system else []
    return to_context(validated(P.ChatCompletionRequest,
                                {**fields, "messages": [*system, {"role": "user", "content": body.prompt}]}, FIELD_NAMES),
                      body.think)


def embed_request(body: EmbedRequest) -> P.EmbeddingRequest:
    for name in body.options or {}:  # none changes an embedding here; the rest are refused as for chat
        if name not in KNOWN_OPTIONS:
            raise APIError(400, f"unknown option '{name}'", f"options.{name}")
    if body.dimensions is not None and body.dimensions < 1:
        raise APIError(400, f"dimensions must be at least 1, got {body.dimensions}", "dimensions")
    dimensions = {} if body.dimensions is None else {"dimensions": body.dimensions}
    request = validated(P.EmbeddingRequest, {"model": served_name(body.model), "input": body.prompt if body.prompt
                                             is not None else body.input, **dimensions})
    request._keep_start = body.truncate  # an input past the context keeps its start, as Ollama's does
    return request


# ------------------------------------------------------------------ answers


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def done_fields(finish: str | None, usage: dict | None, timings: dict | None, start: float, load: float) -> dict:
    """The last object's fields: why it ended, the token counts and the durations in nanoseconds."""
    t = timings or {}
    u = usage or {}
    return {"done": True, "done_reason": "length" if finish == "length" else "stop",
            "total_duration": int((time.perf_counter() - start) * 1e9), "load_duration": int(load * 1e9),
            "prompt_eval_count": u.get("prompt_tokens", 0), "prompt_eval_duration": int(t.get("prompt_ms", 0) * 1e6),
            "eval_count": u.get("completion_tokens", 0), "eval_duration": int(t.get("predicted_ms", 0) * 1e6)}


def message_of(m: dict) -> dict:
    """A chat completion's message as Ollama's: content, thinking, tool calls with argument objects."""
    out = {"role": "assistant", "content": m.get("content") or ""}
    if m.get("reasoning_content"):
        out["thinking"] = m["reasoning_content"]
    if m.get("tool_calls"):
        out["tool_calls"] = [{"function": {"name": c["function"]["name"], "arguments": arguments_object(c["function"]["arguments"])}}
                             for c in m["tool_calls"]]
    return out


def whole(reply: dict, model: str, chat: bool, start: float, load: float) -> dict:
    choice = reply["choices"][0]
    head = {"model": model, "created_at": now()}
    if chat:
        head["message"] = message_of(choice["message"])
    elif "message" in choice:  # /api/generate through the template
        m = message_of(choice["message"])
        head.update({"response": m["content"], **({"thinking": m["thinking"]} if "thinking" in m else {})})
    else:
        head["response"] = choice["text"]
    return {**head, **done_fields(choice["finish_reason"], reply["usage"], reply.get("timings"), start, load)}


async def ndjson(chat_stream: StreamingResponse, model: str, chat: bool, start: float, access: dict):
    """Ollama's stream: one JSON object a line, each with what is new, then the last with done."""
    calls: dict[int, dict] = {}
    finish, usage, timings = None, None, None
    async for chunk in chunks(chat_stream):
        if "error" in chunk:
            yield json.dumps(error_body(RESPONSE_FORMAT.sub("format", chunk["error"]["message"]))) + "\n"
            return
        usage, timings = chunk.get("usage") or usage, chunk.get("timings") or timings
        for c in chunk.get("choices") or []:
            finish = c.get("finish_reason") or finish
            delta = c.get("delta") or {}
            for tc in delta.get("tool_calls") or []:  # Ollama sends each call whole
                call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                call["name"] = (tc.get("function") or {}).get("name") or call["name"]
                call["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            piece = delta.get("content") if "delta" in c else c.get("text")
            thought = delta.get("reasoning_content")
            if piece or thought:
                yield json.dumps(_piece(model, chat, piece or "", thought)) + "\n"
    last = _piece(model, chat, "", None)
    if calls and chat:
        last["message"]["tool_calls"] = [{"function": {"name": c["name"], "arguments": arguments_object(c["arguments"])}}
                                         for _, c in sorted(calls.items())]
    yield json.dumps({**last, **done_fields(finish, usage, timings, start, access.get("load", 0.0))}) + "\n"


def _piece(model: str, chat: bool, text: str, thought: str | None) -> dict:
    out: dict = {"model": model, "created_at": now()}
    if chat:
        out["message"] = {"role": "assistant", "content": text, **({"thinking": thought} if thought else {})}
    else:
        out.update({"response": text, **({"thinking": thought} if thought else {})})
    return {**out, "done": False}


# ------------------------------------------------------------------ models


async def infos(cards: list[dict]) -> list[dict]:
    """The cards' /api/tags entries, their headers read on a worker thread (a large vocabulary's
    takes a second or more)."""
    return await asyncio.to_thread(lambda: [details(c) for c in cards])


# ------------------------------------------------------------------ routes


async def card_of(name: str, model) -> dict:
    """The /v1/models card of the model `name` (NAME:latest is NAME; `model(id)` gives it); a 404 for
    one not served."""
    try:
        return await model(served_name(name))
    except APIError as exc:
        if exc.status == 404:
            raise APIError(404, f"model '{clipped(name)}' not found") from None
        raise


async def no_vectors(body: EmbedRequest, model) -> dict:
    """Nothing to embed: no vectors, as Ollama answers (for a model it serves)."""
    await card_of(body.model, model)
    return {"model": body.model, "embeddings": [], "total_duration": 0, "load_duration": 0, "prompt_eval_count": 0}


async def preload(body: GenerateRequest, raw: HTTPRequest, model, load, hold) -> dict:
    """/api/generate without a prompt: Ollama's way to load a model, or with keep_alive 0 to unload
    it (not loaded for that: it unloads once idle; a server of one model keeps it)."""
    sampling(body)
    unload = body.keep_alive is not None and duration(body.keep_alive) == 0
    await (card_of(body.model, model) if unload else load(served_name(body.model), raw))
    hold(body)
    return {"model": body.model, "created_at": now(), "response": "", "done": True,
            "done_reason": "unload" if unload else "load"}


def register(app, *, chat, text, embed, models, model, load, check, pull, keep_alive=None) -> None:
    """Ollama's routes on `app`, through the OpenAI routes' handlers; `load(name, raw)` loads a model
    as its requests do (a 503 where it cannot), `check(name)` finds whether it can without loading
    it; `keep_alive(name, seconds)`, where models can unload (a server of several), takes a request's;
    `pull(name)` fetches a model (ollama_pull)."""

    def hold(body) -> None:
        """The request's keep_alive for its model from now on (none given: the server's --keep-alive)."""
        seconds = False if body.keep_alive is None else duration(body.keep_alive)  # a bad one is a 400 anyway
        if keep_alive is not None:  # a server of one model keeps it loaded
            keep_alive(served_name(body.model), seconds)

    async def run(request, raw: HTTPRequest, handler, model: str, is_chat: bool):
        start = time.perf_counter()
        access = raw.scope.setdefault(ACCESS, {})
        try:
            answered = await handler(request, raw)
        except MinervaError as exc:
            raise APIError(400, RESPONSE_FORMAT.sub("format", str(exc))) from None
        except APIError as exc:
            exc.message = RESPONSE_FORMAT.sub("format", exc.message)
            raise
        if request.stream:
            return StreamingResponse(ndjson(answered, model, is_chat, start, access), media_type="application/x-ndjson")
        return JSONResponse(whole(json.loads(answered.body), model, is_chat, start, access.get("load", 0.0)))

    # a request's keep_alive is taken once the request has passed its checks (hold after them)
    async def api_chat(body: ChatRequest, raw: HTTPRequest):
        request = chat_request(body)
        hold(body)
        return await run(request, raw, chat, body.model, True)

    async def api_generate(body: GenerateRequest, raw: HTTPRequest):
        if not body.prompt and not body.system:
            return await preload(body, raw, model, load, hold)
        request = generate_request(body)
        hold(body)
        return await run(request, raw, chat if isinstance(request, P.ChatCompletionRequest) else text, body.model,
                         False)

    async def api_embed(body: EmbedRequest, raw: HTTPRequest):
        if body.input == [] and body.prompt is None:  # nothing to embed
            return await no_vectors(body, model)
        start = time.perf_counter()
        request = embed_request(body)
        hold(body)
        out = await embed(request, raw)
        out = out if isinstance(out, dict) else json.loads(out.body)
        vectors = [d["embedding"] for d in out["data"]]
        if body.prompt is not None:  # /api/embeddings: one vector, under its old name
            return {"embedding": vectors[0]}
        return {"model": body.model, "embeddings": vectors, "total_duration": int((time.perf_counter() - start) * 1e9),
                "load_duration": int(raw.scope.get(ACCESS, {}).get("load", 0.0) * 1e9),
                "prompt_eval_count": out["usage"]["prompt_tokens"]}

    async def api_tags():
        return {"models": await infos((await models())["data"])}

    async def api_ps():
        loaded = [card for card in (await models())["data"] if card.get("loaded", True)]
        return {"models": [{**info, "expires_at": None, "size_vram": 0, "context_length": card["max_model_len"]}
                           for card, info in zip(loaded, await infos(loaded))]}

    async def api_show(body: ShowRequest):
        if not (body.model or body.name):
            raise APIError(400, "model is required: the name of the model to show (see /api/tags)", "model")
        card = await card_of(body.model or body.name, model)
        await check(card["id"])  # a model that cannot load: the error its requests get
        info = await asyncio.to_thread(details, card)
        return shown(card, info, *await asyncio.to_thread(model_parameters, card["root"], info["digest"]))

    async def api_version():
        return {"version": __version__}

    for path, handler in (("chat", api_chat), ("generate", api_generate), ("embed", api_embed),
                          ("embeddings", api_embed), ("show", api_show)):
        app.post(PREFIX + path, summary=f"Ollama API: /api/{path}")(handler)
    for path, handler in (("tags", api_tags), ("ps", api_ps), ("version", api_version)):
        app.get(PREFIX + path, summary=f"Ollama API: /api/{path}")(handler)
    ollama_pull.register(app, PREFIX, pull)
