"""The Responses API's request (`POST /v1/responses`): its fields, and the chat completion
request it becomes (instructions, input items as messages, tools, sampling, text.format)."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minerva.serve.convert import APIError

LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for the output's log probabilities

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
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    stream: bool = False
    background: bool = False
    # what cannot change the answer here: accepted and ignored
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    # "auto": a conversation past the context drops its oldest items until it fits
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None  # message.output_text.logprobs is read; the rest changes nothing here
    top_logprobs: int | None = Field(None, ge=0, le=20)
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
    # streamed whether or not the client streams: a whole Response is the stream's last state
    fields: dict = {"model": body.model, "messages": messages + input_messages(body.input), "stream": True,
                    "stream_options": {"include_usage": True}}
    for name, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p), ("parallel_tool_calls", body.parallel_tool_calls)):
        if value is not None:
            fields[name] = value
    if body.top_logprobs is not None or LOGPROBS in (body.include or []):
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
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
