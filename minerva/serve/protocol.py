"""Request and response bodies of the OpenAI-compatible API (the subset Minerva serves).

Field limits live here, so FastAPI rejects bad values before a handler runs and publishes them
in the OpenAPI schema. Types are strict, as in OpenAI's API ("4" is not a number, "yes" not a
boolean), and a field Minerva does not implement is a 400 naming it, never silently ignored:
unknown fields are refused by the models, and OpenAI fields Minerva lacks (`UNSUPPORTED`) are
accepted only with the value that asks for nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from minerva.engine.sampler import MAX_LOGPROBS, MAX_SPECULATIVE

MAX_N, MAX_STOP, MAX_PROMPTS = 16, 16, 64  # completions and stop strings a request, prompts a /v1/completions one
NULLABLE = {"n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "stream", "logprobs", "top_logprobs"}
INT64 = 2**63 - 1

# Fields of OpenAI's API that Minerva does not implement yet -> the values that ask for nothing.
UNSUPPORTED: dict[str, tuple] = {
    "functions": (None, []),
    "function_call": (None, "none"),
}

PositiveInt = Annotated[int, Field(ge=1, le=INT64)]
TokenId = Annotated[int, Field(ge=0, le=INT64)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # required, as the Responses API's json_schema format requires it: without one the answer
    # would be held to nothing the client asked for (any JSON object is type json_object)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('"json_schema" must be given exactly when type is "json_schema"')
        return self


class _Sampling(_Body):
    """Fields shared by chat and text completions."""

    model: str | None = Field(None, description="Served model name; omitted means the served model.")
    _to_context: bool = PrivateAttr(False)  # max_tokens past the context: up to it (Ollama's num_predict)
    _thinks: bool = PrivateAttr(False)  # asks a reasoning model to think (Ollama's think)
    _truncate: bool = PrivateAttr(False)  # a conversation past the context drops its oldest turns (Responses')
    _fallback: dict = PrivateAttr(default_factory=dict)  # sampling defaults under the model's (Ollama's)

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data):
        """null, which OpenAI's API takes for these fields, is the field left out (its default)."""
        return {k: v for k, v in data.items() if v is not None or k not in NULLABLE} if isinstance(data, dict) else data

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info):
        if value is not None and not info.data.get("stream"):  # (stream is validated first: it comes first)
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: PositiveInt | None = None
    stop: (Annotated[str, Field(min_length=1)]
           | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=INT64, description="0 or -1 = off")
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=INT64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=100)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100].")
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT64)]], Field(max_length=MAX_STOP)] | None = Field(
        None, description="Token ids that end a completion as a stop string does (vLLM's field); not in the output.")
    speculative_tokens: int | None = Field(
        None, ge=0, le=MAX_SPECULATIVE,
        description="Guesses per step for this request when the server runs with --speculative "
                    "(0 turns speculation off for it; default: the server's setting).")
    user: str | None = None
    # Structured output: OpenAI's response_format, vLLM's guided_* and llama.cpp's json_schema
    # and grammar (at most one of them)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, description="GBNF (llama.cpp) or Lark")
    json_schema: dict[str, Any] | None = Field(None, description="llama.cpp's spelling of a JSON schema")
    grammar: str | None = Field(None, description="llama.cpp's spelling of a GBNF grammar")
    # OpenAI's deprecated function calling (use tools): only the values in UNSUPPORTED pass.
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        """The first field set to something Minerva does not implement, else None."""
        for name, neutral in UNSUPPORTED.items():
            if getattr(self, name) not in neutral:
                return name
        return None

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                                     description="letters, digits, _ . and -, at most 64")]


class FunctionDefinition(_Body):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object")
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Body):
    name: str
    arguments: str = Field(description="The arguments as JSON text")


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Body):
    type: Literal["text"]
    text: str


CONTENT_PART_TYPES = {"image_url": "images", "input_image": "images", "input_audio": "audio",
                      "audio_url": "audio", "video_url": "video", "file": "files"}


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="The calls an assistant message made")
    tool_call_id: str | None = Field(None, description="The call a tool message answers")
    # What the SDK's own assistant messages carry when sent back as they came: ignored.
    refusal: str | None = None
    reasoning_content: str | None = None
    annotations: list[Any] | None = None
    audio: Any | None = None
    function_call: None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data):
        """A content part of another kind (an image) gets one clear error, not a union's three."""
        parts = data.get("content") if isinstance(data, dict) else None
        for part in parts if isinstance(parts, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                what = CONTENT_PART_TYPES.get(kind)
                if what is None:
                    raise ValueError(f"content parts of type '{kind}' are not supported; send text parts")
                raise ValueError(f"content parts of type '{kind}' are not supported: this server runs text-only "
                                 f"models and takes no {what}; send the text alone")
        return data

    @model_validator(mode="after")
    def _fields_of_the_role(self):
        """What OpenAI's API refuses too: a message other than an assistant's without content, calls
        on a message not an assistant's, a tool result that does not say which call it answers."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content: a string or a list of text parts, not null")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not to a {self.role} message")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id: the id of the assistant's call it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='Default: "auto" with tools, "none" without')
    parallel_tool_calls: bool | None = Field(None, description="Whether a reply may hold more than one call "
                                                               "(default true)")
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="Go on with the last message, an assistant's (a "
                                                            "prefill); needs add_generation_prompt false")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="How much a reasoning model thinks first: passed to the chat template as "
                          "`reasoning_effort` (GPT-OSS's template reads it); omitted: the template's default.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="More variables for the chat template, e.g. {\"enable_thinking\": false} for Qwen3.")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):  # (logprobs is validated first: it comes first)
            raise ValueError("top_logprobs needs logprobs: true")
        return value


class CompletionRequest(_Sampling):
    prompt: (Annotated[str, Field()] | list[str] | list[TokenId] | list[list[TokenId]]) = Field(
        description="Text, token ids, or a list of either (one completion set per prompt).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="Text, token ids, or a list of either: one embedding each.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the float32 values, little-endian, base64-encoded")
    dimensions: PositiveInt | None = Field(None, description="Only the model's own hidden size is possible")
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(
        None, description="Keep only the last k tokens of each input; -1: as many as the model takes (vLLM's)")
    _keep_start: bool = PrivateAttr(False)  # an over-long input keeps its first tokens (Ollama's truncate)

    @field_validator("input")
    @classmethod
    def _not_empty(cls, x):
        if x in ("", []) or (isinstance(x, list) and any(v in ("", []) for v in x)):
            raise ValueError("an input is empty: give text or token ids (nothing has no embedding)")
        return x

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if all(isinstance(t, int) for t in x):
            return [list(x)]
        return list(x)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = Field(None, max_length=128, description="With messages: the tools the template renders")
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]
