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

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from minerva.errors import MinervaError
from minerva.serve import protocol as P
from minerva.serve.convert import ACCESS, APIError, chunks, validated
from minerva.serve.json_response import JSONResponse
from minerva.serve.responses_request import (LOGPROBS, FunctionChoice, ResponsesRequest, chat_fields,
                                             input_messages, new_id)
from minerva.serve.truncation import Cuts

PATH = "/v1/responses"
STORE_SIZE = 1024  # responses kept for GET and previous_response_id, least recently stored dropped first
STORE_CHARS = 256 << 20  # ... and while their conversations' text adds up to more than this, the newest kept
# A stored conversation keeps its newest turns (and steps) up to about this much text, cut as truncation
# "auto" cuts: far more text than a model's context holds (a later turn with truncation "auto" drops
# them anyway; one without it could not fit what is kept either).
CONVERSATION_CHARS = 32 << 20


# ------------------------------------------------------------------ answers


def response(body: ResponsesRequest, rid: str, created: int, items: list[dict], finish: str | None,
             usage: dict | None, status: str | None = None, model: str | None = None) -> dict:
    """The Response object (`status`: in_progress while streaming, else from the finish reason;
    `model`: the name that answered, where the request named none)."""
    if status is None:
        status = "incomplete" if finish == "length" else "completed"
        if status == "incomplete" and items and "status" in items[-1]:  # the item cut short says so too
            items = items[:-1] + [{**items[-1], "status": "incomplete"}]
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
            "truncation": body.truncation or "disabled", "metadata": body.metadata or {},
            "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                      "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
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


def text_size(message: dict) -> int:
    """About the characters a message holds (its content and tool calls)."""
    content = message.get("content")
    size = len(content) if isinstance(content, str) else len(json.dumps(content)) if content else 0
    return size + sum(len(json.dumps(c)) for c in message.get("tool_calls") or ())


def within(conversation: list[dict], most: int) -> tuple[list[dict], int]:
    """The conversation cut as truncation "auto" cuts it (`truncation.Cuts`: its oldest whole
    turns, then the latest turn's oldest steps; system messages kept) as little as leaves it
    `most` characters or fewer, or as much as it can be; and the characters it then holds."""
    sizes = [text_size(m) for m in conversation]
    total = sum(sizes)
    cuts = Cuts([m.get("role", "") for m in conversation])
    if total <= most or not cuts:
        return conversation, total
    lo, hi = 0, len(cuts) - 1  # the smallest cut whose text fits: cuts keep less and less
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(sizes[i] for i in cuts[mid]) <= most:
            hi = mid
        else:
            lo = mid + 1
    keep = cuts[lo]
    return [conversation[i] for i in keep], sum(sizes[i] for i in keep)


class Store:
    """The responses kept for GET and previous_response_id: each with the conversation it ends.
    A response still streaming is kept as its Stream, which GET shows as it stands (in_progress).
    At most `size` of them, and while their conversations hold more than `chars` characters
    (counted for each, though a chain's turns are shared) the oldest are dropped, the newest
    always kept; a conversation keeps at most `each` characters (`within`)."""

    def __init__(self, size: int = STORE_SIZE, chars: int = STORE_CHARS, each: int = CONVERSATION_CHARS):
        self.size, self.chars, self.each, self.items = size, chars, each, collections.OrderedDict()
        self.held: dict[str, int] = {}  # characters of each stored conversation
        self.total = 0

    def put(self, rid: str, answer: "dict | Stream", conversation: list[dict]) -> None:
        conversation, chars = within(conversation, self.each)
        self.total += chars - self.held.get(rid, 0)
        self.items[rid], self.held[rid] = (answer, conversation), chars
        self.items.move_to_end(rid)
        while len(self.items) > self.size or (self.total > self.chars and len(self.items) > 1):
            self.remove(next(iter(self.items)))

    def remove(self, rid: str) -> None:
        del self.items[rid]
        self.total -= self.held.pop(rid)

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
        self.final: dict | None = None  # the Response once the stream has ended
        # asked for: a message's output_text gathers its tokens' log probabilities
        self.logprobs = body.top_logprobs is not None or LOGPROBS in (body.include or [])

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
            out += [event(self.seq, "response.output_text.done", {**where, "content_index": 0, "text": part["text"],
                                                                  "logprobs": part.get("logprobs", [])}),
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
            text = delta.get("content")
            if text and (self.open is None or self.open["type"] != "message") and self.items:
                text = text.lstrip()  # the space between a call (or the reasoning) and the text after it
            if text:
                if self.open is None or self.open["type"] != "message":
                    out += self._add({"type": "message", "id": new_id("msg"), "status": "completed",
                                      "role": "assistant", "content": [{"type": "output_text", "text": "",
                                                                        "annotations": [],
                                                                        **({"logprobs": []} if self.logprobs else {})}]})
                pieces = (choice.get("logprobs") or {}).get("content") or []
                self.open["content"][0]["text"] += text
                if self.logprobs:
                    self.open["content"][0]["logprobs"] += pieces
                out.append(self._delta("response.output_text.delta", text, 0, pieces))
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

    def _delta(self, kind: str, text: str, content_index: int, logprobs: list | None = None) -> str:
        extra = {"logprobs": logprobs or []} if kind == "response.output_text.delta" else {}
        return event(self.seq, kind, {"item_id": self.open["id"], "output_index": len(self.items) - 1,
                                      "content_index": content_index, "delta": text, **extra})

    def end(self) -> tuple[list[str], dict]:
        out = []
        if not self.items:  # nothing said: an empty message, as a whole response has
            out = self._add({"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
                             "content": [{"type": "output_text", "text": "", "annotations": []}]})
        if self.finish == "length" and self.open is not None and "status" in self.open:
            self.open["status"] = "incomplete"  # cut short
        out += self.close()
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
                yield event(stream.seq, "error", {**error, "param": responses_name(chunk["error"].get("param"))})
                yield event(stream.seq, "response.failed", {"response": final})
                return
            for e in stream.feed(chunk):
                yield e
        if not started:
            for e in stream.start():
                yield e
        closing, final = stream.end()
        stream.final = final
        for e in closing:
            yield e
    finally:
        if store is not None and stream.rid in store.items:  # not deleted (nor dropped) meanwhile
            final = final or stream.snapshot("cancelled")
            store.put(stream.rid, final, conversation + history_of(final["output"]))


async def whole(chat_stream: StreamingResponse, stream: Stream, store: Store | None, conversation: list[dict]) -> dict:
    """The Response a streamed chat completion ends in, built as the events are (the items in
    the order they were written), stored (`store`) as `events` stores it; a generation that
    failed is its error (500, or 400 where the input was at fault)."""
    error = None
    async for e in events(chat_stream, stream, store, conversation):
        if e.startswith("event: error\n"):
            error = json.loads(e.split("data: ", 1)[1])
    if error is not None:
        status = int(error["code"]) if str(error.get("code")).isdigit() else 500
        raise APIError(status, error["message"], error.get("param"),
                       type="server_error" if status >= 500 else "invalid_request_error")
    return stream.final


# the chat request's fields as this API names them, for the errors of the chat route's checks
RENAMES = ((re.compile(r"\bmessages(\.\d+)*"), "input"), (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
           (re.compile(r"\breasoning_effort\b"), "reasoning.effort"),
           (re.compile(r"\bresponse_format(\.json_schema)?"), "text.format"),
           (re.compile(r"\btools\.(\d+)\.function\."), r"tools.\1."))


def responses_name(text: str | None) -> str | None:
    """`text` (an error's message or field) with the chat request's field names as this API's."""
    for pattern, name in RENAMES if text else ():
        text = pattern.sub(name, text)
    return text


def in_responses_terms(exc: APIError) -> APIError:
    """An error of the chat route's checks, naming the fields a Responses request sent."""
    return APIError(exc.status, responses_name(exc.message), responses_name(exc.param), exc.type, exc.headers)


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
            request._truncate = body.truncation == "auto"
            answered = await chat(request, raw)
        except MinervaError as exc:
            raise in_responses_terms(APIError(400, str(exc), exc.field)) from None
        except APIError as exc:
            raise in_responses_terms(exc) from None
        conversation = history + input_messages(body.input)
        rid, created = new_id("resp"), int(time.time())
        if body.stream:
            return StreamingResponse(events(answered, Stream(body, rid, created), store if body.store else None,
                                            conversation), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await whole(answered, Stream(body, rid, created), store if body.store else None,
                                        conversation))

    async def retrieve(response_id: str):
        return store.get(response_id)[0]

    async def delete(response_id: str):
        store.get(response_id)
        store.remove(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    app.post(PATH, summary="OpenAI Responses API: a response to `input` (streamed as the Responses events with "
                           "stream: true)")(create)
    app.get(PATH + "/{response_id}", summary="A stored response")(retrieve)
    app.delete(PATH + "/{response_id}", summary="Delete a stored response")(delete)
