"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`): what
Codex and the OpenAI Agents SDK speak, as a converter onto the chat route.

A request's `instructions` and `input` (text, or items: messages, function calls and their
outputs) become a chat completion request with its tools, tool choice, sampling and
`text.format` (structured output), and run through the same path as `/v1/chat/completions`;
the answer is rewritten as a Response (output items: `reasoning`, `message`,
`function_call`), streamed as the Responses events. Answers are stored (`store`, default
true) in a bounded in-memory store, so `previous_response_id` continues a conversation.
"""

from __future__ import annotations

import collections
import copy
import json
import re
import time
import uuid
from typing import Any, Literal

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from minerva.errors import MinervaError
from minerva.serve import protocol as P
from minerva.serve.convert import ACCESS, APIError, chunks, validated

PATH = "/v1/responses"
STORE_SIZE = 1024  # responses kept for GET and previous_response_id, least recently stored dropped first


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(BaseModel):
    """`text.format`: free text, or structured output (json_schema needs its schema)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint for OpenAI's models: accepted, ignored


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    effort: Literal["minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries here: accepted, ignored
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=2**63 - 1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    background: bool = False
    # what cannot change the answer here: accepted and ignored
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------ requests


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: expected a string or a list of input_text parts, got "
                            f"{type(content).__name__ if content is not None else 'null'}", "input")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}.{i}: a part of type '{kind}' needs its text (a string)", "input")
            parts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{where}.{i}: content of type '{kind}' is not supported: this server runs text-only "
                                "models; send the text alone", "input")
        else:
            got = f"a part of type {kind!r}" if isinstance(part, dict) else repr(part)[:80]
            raise APIError(400, f"{where}.{i}: expected an input_text part (an object with type and text), got {got}",
                           "input")
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """A request's input as chat messages: messages, function calls (an assistant turn's tool
    calls) and function call outputs (tool messages); earlier reasoning items are dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise APIError(400, "input: an empty list; send the text, or at least one message", "input")
    out: list[dict] = []
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}: role must be user, assistant, system or developer, got {role!r}", "input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if not all(isinstance(x, str) for x in (call["id"], call["function"]["name"], call["function"]["arguments"])):
                raise APIError(400, f"{where}: a function_call needs call_id, name and arguments (strings)", "input")
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output needs its call_id", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output", ""), f"{where}.output")})
        elif kind != "reasoning":
            raise APIError(400, f"{where}: input items of type '{kind}' are not supported (messages, function_call "
                                "and function_call_output are)", "input")
    return out


def chat_fields(body: ResponsesRequest, history: list[dict]) -> dict:
    """The chat completion request answering `body` after the stored conversation `history`."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    fields: dict = {"model": body.model, "messages": messages + input_messages(body.input), "stream": body.stream}
    for name, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p), ("parallel_tool_calls", body.parallel_tool_calls)):
        if value is not None:
            fields[name] = value
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    if body.tools:
        bad = next((t for t in body.tools if t.type != "function"), None)
        if bad is not None:
            raise APIError(400, f"tools of type '{bad.type}' are not supported (function tools are)", "tools")
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                             "parameters": t.parameters or {"type": "object"}}}
                           for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    if choice is not None:
        fields["tool_choice"] = choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format: a json_schema format needs its schema", "text.format.schema")
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    effort = body.reasoning.effort if body.reasoning else None
    if effort is not None:
        fields["reasoning_effort"] = {"minimal": "low", "xhigh": "high"}.get(effort, effort)
    return fields


# ------------------------------------------------------------------ answers


def output_items(message: dict) -> list[dict]:
    """A chat completion's message as Response output items."""
    items = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": new_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    if message.get("content") or not message.get("tool_calls"):
        items.append({"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": []}]})
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def response(body: ResponsesRequest, rid: str, created: int, items: list[dict], finish: str | None,
             usage: dict | None, status: str | None = None, model: str | None = None) -> dict:
    """The Response object (`status`: in_progress while streaming, else from the finish reason;
    `model`: the name that answered, where the request named none)."""
    if status is None:
        status = "incomplete" if finish == "length" else "completed"
    u = usage or {"prompt_tokens": 0, "completion_tokens": 0}
    counted = usage is not None or status in ("completed", "incomplete")  # else null, as the created event's
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": body.model or model,
            "output": items, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "previous_response_id": body.previous_response_id,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice)
                            else body.tool_choice or "auto"),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": (body.text.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format
                     else {"format": {"type": "text"}}),
            "reasoning": body.reasoning.model_dump(exclude_none=True) if body.reasoning else None, "store": body.store,
            "truncation": "disabled", "metadata": body.metadata or {},
            "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                      "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}} if counted else None}


def history_of(items: list[dict]) -> list[dict]:
    """Output items as the chat messages a later turn sends back."""
    messages: list[dict] = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": "".join(c["text"] for c in item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages


class Store:
    """The responses kept for GET and previous_response_id: each with the conversation it ends.
    A response still streaming is kept as its Stream, which GET shows as it stands (in_progress)."""

    def __init__(self, size: int = STORE_SIZE):
        self.size, self.items = size, collections.OrderedDict()

    def put(self, rid: str, answer: "dict | Stream", conversation: list[dict]) -> None:
        self.items[rid] = (answer, conversation)
        self.items.move_to_end(rid)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def get(self, rid: str, param: str | None = None) -> tuple[dict, list[dict]]:
        if rid not in self.items:
            raise APIError(404, f"no stored response with id '{rid}' (responses are kept in memory, the last "
                                f"{self.size}, and only with store: true)", param)
        answer, conversation = self.items[rid]
        if isinstance(answer, Stream):
            if param is not None:
                raise APIError(400, f"response '{rid}' is still in progress: continue from it once it has "
                                    "completed", param)
            return answer.snapshot(), conversation
        return answer, conversation


def event(seq: list[int], kind: str, data: dict) -> str:
    seq[0] += 1
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq[0] - 1, **data})}\n\n"


class Stream:
    """Chat completion chunks in, the Responses events out: response.created and
    response.in_progress; per output item response.output_item.added, its parts and deltas
    (response.reasoning_text.delta; response.content_part.added, response.output_text.delta;
    response.function_call_arguments.delta), their .done events and response.output_item.done;
    then response.completed (or response.incomplete)."""

    def __init__(self, body: ResponsesRequest, rid: str, created: int):
        self.body, self.rid, self.created, self.seq = body, rid, created, [0]
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.calls: dict[int, dict] = {}  # a chat delta's tool call index -> its item
        self.finish, self.usage, self.model = None, None, None

    def start(self) -> list[str]:
        snapshot = response(self.body, self.rid, self.created, [], None, None, "in_progress", self.model)
        return [event(self.seq, "response.created", {"response": snapshot}),
                event(self.seq, "response.in_progress", {"response": snapshot})]

    def snapshot(self, status: str = "in_progress", error: dict | None = None) -> dict:
        """The response as it stands: the items so far, the one being written `in_progress` (or
        `incomplete`, where the stream ended early: `status` cancelled or failed, with `error`)."""
        items = copy.deepcopy(self.items)
        if self.open is not None and "status" in self.open:
            items[self.items.index(self.open)]["status"] = "in_progress" if status == "in_progress" else "incomplete"
        answer = response(self.body, self.rid, self.created, items, None, self.usage, status, self.model)
        return answer | {"error": error} if error else answer

    def _add(self, item: dict) -> list[str]:
        out = self.close()
        self.items.append(item)
        self.open = item
        added = {**item, "status": "in_progress"} if "status" in item else item
        out.append(event(self.seq, "response.output_item.added", {"output_index": len(self.items) - 1, "item": added}))
        if item["type"] == "message":
            out.append(event(self.seq, "response.content_part.added", {
                "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}))
        return out

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        out = []
        if item["type"] == "reasoning":
            out.append(event(self.seq, "response.reasoning_text.done", {
                **where, "content_index": 0, "text": item["content"][0]["text"]}))
        elif item["type"] == "message":
            part = item["content"][0]
            out += [event(self.seq, "response.output_text.done", {**where, "content_index": 0, "text": part["text"]}),
                    event(self.seq, "response.content_part.done", {**where, "content_index": 0, "part": part})]
        else:
            out.append(event(self.seq, "response.function_call_arguments.done", {**where, "arguments": item["arguments"]}))
        return out + [event(self.seq, "response.output_item.done", {"output_index": where["output_index"], "item": item})]

    def feed(self, chunk: dict) -> list[str]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._add({"type": "reasoning", "id": new_id("rs"), "summary": [],
                                      "content": [{"type": "reasoning_text", "text": ""}]})
                self.open["content"][0]["text"] += delta["reasoning_content"]
                out.append(self._delta("response.reasoning_text.delta", delta["reasoning_content"], 0))
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._add({"type": "message", "id": new_id("msg"), "status": "completed",
                                      "role": "assistant", "content": [{"type": "output_text", "text": "",
                                                                        "annotations": []}]})
                self.open["content"][0]["text"] += delta["content"]
                out.append(self._delta("response.output_text.delta", delta["content"], 0))
            for call in delta.get("tool_calls") or []:
                if call["index"] not in self.calls:
                    out += self._add({"type": "function_call", "id": new_id("fc"), "call_id": call.get("id") or "",
                                      "name": call["function"]["name"], "arguments": "", "status": "completed"})
                    self.calls[call["index"]] = self.open
                piece = (call.get("function") or {}).get("arguments")
                if piece:
                    item = self.calls[call["index"]]
                    item["arguments"] += piece
                    out.append(event(self.seq, "response.function_call_arguments.delta", {
                        "item_id": item["id"], "output_index": self.items.index(item), "delta": piece}))
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def _delta(self, kind: str, text: str, content_index: int) -> str:
        return event(self.seq, kind, {"item_id": self.open["id"], "output_index": len(self.items) - 1,
                                      "content_index": content_index, "delta": text})

    def end(self) -> tuple[list[str], dict]:
        if not self.items:  # nothing said: an empty message, as a whole response has
            self._add({"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": "", "annotations": []}]})
        out = self.close()
        final = response(self.body, self.rid, self.created, self.items, self.finish, self.usage, model=self.model)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + [event(self.seq, kind, {"response": final})], final


async def events(chat_stream: StreamingResponse, stream: Stream, store: Store | None, conversation: list[dict]):
    """The Responses events of a streamed chat completion. Stored (`store`) from the start:
    in_progress while it streams; completed or incomplete at its end; failed after an error;
    cancelled with what was said so far where the client hung up (which stops the generation)."""
    if store is not None:
        store.put(stream.rid, stream, conversation)
    final = None
    try:
        started = False  # response.created waits for the first chunk, which names the model that answers
        async for chunk in chunks(chat_stream):
            if not started:
                stream.model, started = chunk.get("model"), True
                for e in stream.start():
                    yield e
            if "error" in chunk:
                error = {"code": str(chunk["error"].get("code")), "message": chunk["error"]["message"]}
                final = stream.snapshot("failed", error)
                yield event(stream.seq, "error", {**error, "param": None})
                return
            for e in stream.feed(chunk):
                yield e
        if not started:
            for e in stream.start():
                yield e
        closing, final = stream.end()
        for e in closing:
            yield e
    finally:
        if store is not None and stream.rid in store.items:  # not deleted (nor dropped) meanwhile
            final = final or stream.snapshot("cancelled")
            store.put(stream.rid, final, conversation + history_of(final["output"]))


# the chat request's fields as this API names them, for the errors of the chat route's checks
RENAMES = ((re.compile(r"\bmessages(\.\d+)*"), "input"), (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
           (re.compile(r"\breasoning_effort\b"), "reasoning.effort"),
           (re.compile(r"\bresponse_format(\.json_schema)?"), "text.format"),
           (re.compile(r"\btools\.(\d+)\.function\."), r"tools.\1."))


def in_responses_terms(exc: APIError) -> APIError:
    """An error of the chat route's checks, naming the fields a Responses request sent."""
    message, param = exc.message, exc.param
    for pattern, name in RENAMES:
        message = pattern.sub(name, message)
        param = pattern.sub(name, param) if param else param
    return APIError(exc.status, message, param, exc.type, exc.headers)


def register(app, chat) -> None:
    """The Responses routes on `app`, answered through the `chat` handler, with a store of their own."""
    store = Store()

    async def create(body: ResponsesRequest, raw: HTTPRequest):
        if body.background:
            raise APIError(400, "background responses are not supported; leave background out (or false)", "background")
        history = store.get(body.previous_response_id, "previous_response_id")[1] if body.previous_response_id else []
        raw.scope.setdefault(ACCESS, {})
        try:
            request = validated(P.ChatCompletionRequest, chat_fields(body, history))
            answered = await chat(request, raw)
        except MinervaError as exc:
            raise in_responses_terms(APIError(400, str(exc))) from None
        except APIError as exc:
            raise in_responses_terms(exc) from None
        conversation = history + input_messages(body.input)
        rid, created = new_id("resp"), int(time.time())
        if body.stream:
            return StreamingResponse(events(answered, Stream(body, rid, created), store if body.store else None,
                                            conversation), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        reply = json.loads(answered.body)
        choice = reply["choices"][0]
        final = response(body, rid, created, output_items(choice["message"]), choice["finish_reason"], reply["usage"],
                         model=reply.get("model"))
        if body.store:
            store.put(rid, final, conversation + history_of(final["output"]))
        return JSONResponse(final)

    async def retrieve(response_id: str):
        return store.get(response_id)[0]

    async def delete(response_id: str):
        store.get(response_id)
        del store.items[response_id]
        return {"id": response_id, "object": "response", "deleted": True}

    app.post(PATH, summary="OpenAI Responses API: a response to `input` (streamed as the Responses events with "
                           "stream: true)")(create)
    app.get(PATH + "/{response_id}", summary="A stored response")(retrieve)
    app.delete(PATH + "/{response_id}", summary="Delete a stored response")(delete)
