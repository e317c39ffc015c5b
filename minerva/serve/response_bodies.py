"""Response bodies of the OpenAI-compatible API (the subset Minerva serves), as the OpenAPI
schema publishes them; the request bodies are in `protocol`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    """llama.cpp's per-response timings."""

    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="The answer; null when the reply is only tool calls")
    tool_calls: list[ToolCallOut] | None = Field(None, description="Present when the model called tools "
                                                                   "(finish_reason is then \"tool_calls\")")
    reasoning_content: str | None = Field(
        None, description="What a reasoning model thought before its answer (absent for other models).")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = Field(None, description="With finish_reason \"stop\": the stop string or "
                                                            "stop token id that ended it (vLLM's); absent otherwise")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = Field(None, description="With finish_reason \"stop\": the stop string or "
                                                            "stop token id that ended it (vLLM's); absent otherwise")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings | None = None



# ------------------------------------------------------------------ stream chunks
# Each is written with exclude_unset: a chunk holds the fields given to it, no more (a chat
# delta only what is new; logprobs and finish_reason always, null or not).


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, description="With the first piece of a call")
    arguments: str = Field(description="The next piece of the arguments' JSON text")


class ToolCallDelta(BaseModel):
    index: int = Field(description="Which call of the reply this piece belongs to")
    id: str | None = Field(None, description="With the first piece of a call")
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="In the first chunk")
    content: str | None = None
    reasoning_content: str | None = Field(None, description="New thoughts of a reasoning model")
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = Field(None, description="With finish_reason \"stop\": the stop string or "
                                                            "stop token id that ended it (vLLM's); absent otherwise")


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="In a last chunk with no choices, with stream_options.include_usage")
    timings: Timings | None = None


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed text completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = None

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minerva"
    root: str = Field(description="The model file or directory served (the model as given, while not loaded)")
    max_model_len: int | None = Field(description="Prompt and output tokens a request may reach (null: not loaded)")
    loaded: bool = Field(True, description="Whether the model is loaded now (a server of several loads on demand)")
    parent: str | None = Field(None, description="For a LoRA adapter: the base model it runs on")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class Health(BaseModel):
    status: str
