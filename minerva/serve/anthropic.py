"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): what Claude
Code and Anthropic's SDKs speak, as a converter onto the chat route.

A request becomes a chat completion request (system prompt, messages with their tool calls
and results, tools and tool choice, sampling and stop sequences), runs through the same
path as `/v1/chat/completions` (template, sampling, structured tool calls, reasoning
parser, metrics, admission, cancellation), and its answer is rewritten in Anthropic's
shape: content blocks (`thinking`, `text`, `tool_use`), `stop_reason`, `usage`, and when
streamed, Anthropic's event sequence. Errors are in Anthropic's shape too.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from minerva.serve import protocol as P
from minerva.errors import MinervaError
from minerva.serve.convert import ACCESS, APIError, arguments_object, chunks, prefill, validated
from minerva.serve.json_response import JSONResponse

PATH = "/v1/messages"
# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn", "abort": "end_turn"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # cache_control and the like
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Thinking(_Body):
    """Extended thinking: on or off for a reasoning model's template (Qwen3's enable_thinking);
    the budget is the model's to keep, not enforced here."""
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class CountTokensRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=2**63 - 1)
    stop_sequences: list[str] | None = Field(None, max_length=P.MAX_STOP)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    output_config: OutputConfig | None = None
    container: Any = None  # code execution: refused
    # what cannot change the answer here: accepted and ignored
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


# ------------------------------------------------------------------ requests


def _text(blocks: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or of text blocks (`cache_control` and citations ignored)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(400, f"{where}: expected a string or a list of text blocks, got "
                            f"{type(blocks).__name__ if blocks is not None else 'null'}", "messages")
    parts = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}: a text block needs its text (a string)", "messages")
        if kind != "text":
            if kind in ("image", "document"):
                raise APIError(400, f"{where}: content blocks of type '{kind}' are not supported: this server runs "
                                    "text-only models; send the text alone", "messages")
            raise APIError(400, f"{where}: expected text blocks (objects with type and text), got "
                                + (f"a block of type {kind!r}" if isinstance(block, dict) else repr(block)[:80]), "messages")
        parts.append(block["text"])
    return "".join(parts)


def _user(content: str | list[dict[str, Any]], where: str) -> list[dict]:
    """A user turn: its tool results as tool messages, then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out, text = [], []
    for i, block in enumerate(content):
        if block.get("type") == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(400, f"{where}.content.{i}: a tool_result needs its tool_use_id", "messages")
            result = _text("" if block.get("content") is None else block["content"], f"{where}.content.{i}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            text.append(block)
    if text:
        out.append({"role": "user", "content": _text(text, f"{where}.content")})
    return out


def _assistant(content: str | list[dict[str, Any]], where: str) -> dict:
    """An assistant turn: its text and tool calls (earlier thinking is not sent back to the model)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text, calls = [], []
    for i, block in enumerate(content):
        kind = block.get("type")
        if kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise APIError(400, f"{where}.content.{i}: a tool_use needs its id and name", "messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            text.append(block)
    message: dict = {"role": "assistant", "content": _text(text, f"{where}.content") if text else None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def chat_messages(body: CountTokensRequest) -> list[dict]:
    """The conversation as chat completion messages."""
    messages = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system, "system")})
    for i, m in enumerate(body.messages):
        where = f"messages.{i}"
        messages += _user(m.content, where) if m.role == "user" else [_assistant(m.content, where)]
    return messages


def chat_tools(body: CountTokensRequest) -> dict:
    """tools and tool_choice as the chat route takes them."""
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice.type in ("any", "tool"):
            raise APIError(400, f"tool_choice of type '{body.tool_choice.type}' needs tools to choose from; give "
                                "tools, or leave tool_choice out", "tool_choice")
        return {}
    for i, t in enumerate(body.tools):
        if t.type not in (None, "custom"):
            raise APIError(400, f"the tool '{t.name}' is a server tool ({t.type}), which this server does not run; "
                                "give client tools (name, description, input_schema)", "tools")
        if t.input_schema is None:  # as Anthropic's API: the schema is what the model is held to
            raise APIError(400, f"the tool '{t.name}' has no input_schema; give the JSON schema of its input "
                                '(at least {"type": "object"})', f"tools.{i}.input_schema")
    out: dict = {"tools": [{"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.input_schema}}
        for t in body.tools]}
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs the name of the tool", "tool_choice")
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
            "type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    return out


# the chat request's fields as this API names them, for the errors of the chat route's checks
NAMES = {"stop": "stop_sequences", "response_format": "output_config.format", "reasoning_effort": "output_config.effort"}
RENAMES = ((re.compile(r"\bresponse_format(\.json_schema)?"), "output_config.format"),
           (re.compile(r"\breasoning_effort\b"), "output_config.effort"),
           (re.compile(r'tool_choice "required" or a named function'), 'tool_choice "any" or "tool"'),
           (re.compile(r"\btools\.(\d+)\.function\."), r"tools.\1."))


def in_anthropic_terms(message: str) -> str:
    """An error of the chat route's checks, naming the fields a Messages request sent."""
    for pattern, name in RENAMES:
        message = pattern.sub(name, message)
    return message


def chat_request(body: MessagesRequest) -> P.ChatCompletionRequest:
    """The chat completion request that answers `body`."""
    messages = chat_messages(body)
    # streamed whether or not the client streams: a whole message is what the stream wrote
    fields: dict = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}, **chat_tools(body), **prefill(messages)}
    if "temperature" in body.model_fields_set:  # else the model's default
        fields["temperature"] = body.temperature
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    if body.top_p is not None:
        fields["top_p"] = body.top_p
    if body.top_k is not None:
        fields["top_k"] = body.top_k
    if body.thinking is not None and body.thinking.type != "adaptive":  # Qwen3-style templates read it
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type == "enabled"}
    if body.container is not None:
        raise APIError(400, "container (code execution) is not supported by this server; leave it out", "container")
    config = body.output_config
    if config is not None and config.format is not None:  # structured output, as the chat route's json_schema
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                            "schema": config.format.schema_}}
    if config is not None and config.effort is not None:  # a reasoning model's template reads it
        fields["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(config.effort, config.effort)
    return validated(P.ChatCompletionRequest, fields, NAMES)


# ------------------------------------------------------------------ answers


def stop_of(finish: str | None, stop_reason, stops: list[str] | None) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat finish reason."""
    if finish == "stop" and isinstance(stop_reason, str) and stop_reason in (stops or ()):
        return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish or "stop", "end_turn"), None


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class Stream:
    """Chat completion chunks in, Anthropic's events out: message_start (and a ping), then per
    content block content_block_start, its deltas (thinking_delta, text_delta,
    input_json_delta) and content_block_stop, then message_delta and message_stop."""

    def __init__(self, body: MessagesRequest, prompt_tokens: int):
        self.body, self.index, self.open = body, -1, None  # open: the kind of the block being written
        self.content: list[dict] = []  # the blocks written so far (a tool_use's input as JSON text)
        self.prompt_tokens, self.error = prompt_tokens, None
        self.calls: dict[int, int] = {}  # a chat delta's tool call index -> its block index
        self.finish = self.stop_reason = None
        self.output_tokens = 0
        self.start = event("message_start", {"message": {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": body.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}) + event("ping", {})

    def _block(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        self.content.append({**block, "input": ""} if kind == "tool_use" else dict(block))
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def feed(self, chunk: dict) -> list[str]:
        """The events of one chat completion chunk."""
        if "error" in chunk:
            status = chunk["error"].get("code", 500)
            self.error = APIError(status if isinstance(status, int) else 500, chunk["error"]["message"])
            return self.close() + [f"event: error\ndata: {json.dumps(error_body(status, chunk['error']['message']))}\n\n"]
        if chunk.get("usage"):
            self.output_tokens = chunk["usage"]["completion_tokens"]
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open != "thinking":
                    out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.content[-1]["thinking"] += delta["reasoning_content"]
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            text = delta.get("content")
            if text and self.open != "text" and self.index >= 0:
                text = text.lstrip()  # the space between a call (or the thinking) and the text after it
            if text:
                if self.open != "text":
                    out += self._block("text", {"type": "text", "text": ""})
                self.content[-1]["text"] += text
                out.append(self._delta({"type": "text_delta", "text": text}))
            for call in delta.get("tool_calls") or []:
                if call["index"] not in self.calls:
                    out += self._block("tool_use", {"type": "tool_use", "id": call.get("id") or "",
                                                    "name": call["function"]["name"], "input": {}})
                    self.calls[call["index"]] = self.index
                piece = (call.get("function") or {}).get("arguments")
                if piece:
                    self.content[self.calls[call["index"]]]["input"] += piece
                    out.append(event("content_block_delta", {"index": self.calls[call["index"]], "delta": {
                        "type": "input_json_delta", "partial_json": piece}}))
            if choice.get("finish_reason"):
                self.finish, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return out

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def end(self) -> list[str]:
        reason, sequence = stop_of(self.finish, self.stop_reason, self.body.stop_sequences)
        return self.close() + [event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                       "usage": {"output_tokens": self.output_tokens}}),
                               event("message_stop", {})]

    def message(self) -> dict:
        """The whole message the stream wrote."""
        reason, sequence = stop_of(self.finish, self.stop_reason, self.body.stop_sequences)
        content = [{**b, "input": arguments_object(b["input"])} if b["type"] == "tool_use" else b for b in self.content]
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": self.body.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}}


async def whole(response: StreamingResponse, stream: Stream) -> dict:
    """The message of a streamed chat completion, as the stream writes it (its blocks in the
    order they were written); a generation that failed is its error."""
    async for chunk in chunks(response):
        stream.feed(chunk)
    if stream.error is not None:
        raise stream.error
    return stream.message()


async def events(response: StreamingResponse, stream: Stream):
    """Anthropic's events from the chat route's stream of chunks."""
    yield stream.start
    failed = False
    async for chunk in chunks(response):
        failed = failed or "error" in chunk
        for e in stream.feed(chunk):
            yield e
    if not failed:
        for e in stream.end():
            yield e


def register(app, chat, tokenize) -> None:
    """The Messages routes on `app`, answered through the `chat` and `tokenize` handlers."""

    async def messages(body: MessagesRequest, raw: HTTPRequest):
        try:
            request = chat_request(body)
            raw.scope.setdefault(ACCESS, {})
            response = await chat(request, raw)
        except APIError as exc:
            return JSONResponse(error_body(exc.status, in_anthropic_terms(exc.message)), status_code=exc.status,
                                headers=exc.headers)
        except MinervaError as exc:
            return JSONResponse(error_body(400, in_anthropic_terms(str(exc))), status_code=400)
        stream = Stream(body, raw.scope[ACCESS].get("prompt", 0))
        if not body.stream:
            try:
                return JSONResponse(await whole(response, stream))
            except APIError as exc:
                return JSONResponse(error_body(exc.status, exc.message), status_code=exc.status)
        return StreamingResponse(events(response, stream), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def count_tokens(body: CountTokensRequest):
        try:
            messages = chat_messages(body)
            fields = {"model": body.model, "messages": messages, **chat_tools(body), **prefill(messages)}
            fields.pop("tool_choice", None), fields.pop("parallel_tool_calls", None)
            counted = await tokenize(validated(P.TokenizeRequest, fields))
        except APIError as exc:
            return JSONResponse(error_body(exc.status, exc.message), status_code=exc.status, headers=exc.headers)
        except MinervaError as exc:
            return JSONResponse(error_body(400, str(exc)), status_code=400)
        return {"input_tokens": counted["count"]}

    app.post(PATH, summary="Anthropic Messages API: a reply to `messages` (streamed as Anthropic's events "
                           "with stream: true)")(messages)
    app.post(f"{PATH}/count_tokens", summary="Anthropic Messages API: the input tokens of a request")(count_tokens)
