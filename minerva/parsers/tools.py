"""Tool calling: how a model is told about tools, and how its calls are read back out of its reply.

**The prompt.** A chat template that renders tools itself (Qwen2.5's, Hermes', Llama 3.1's,
Mistral's) gets them as transformers' `apply_chat_template` passes them: `tools` (OpenAI's
`[{"type": "function", "function": {...}}]`), assistant messages with `tool_calls` (their
arguments as objects, which the templates serialize themselves) and `tool` messages. Whether a
template does is found by rendering a probe conversation with a tool of an unlikely name and
looking for the name in the prompt, not by reading the template's source. A template that
does not (SmolLM2's, Gemma 3's) gets the **built-in format**, Hermes' (the one Qwen2.5 uses):

- the tools go in the system message, as JSON schemas between `<tools></tools>`, with the
  instruction to answer a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- an assistant message's tool calls are written back in that form;
- tool results become a user message of `<tool_response>...</tool_response>` blocks (one
  message for a run of results, so templates that insist on alternating roles accept it).

**The reply** is read by the parsers of `parsers.tool_calls`.

**Forced calls.** `tool_choice: "required"` and a named function are enforced with structured
output, so the arguments always parse against the function's schema: a named function's reply
is constrained to its parameters' schema and is the call's arguments (streamed as they are
written); `required` constrains the reply to a JSON array of `{"name", "arguments"}` objects,
one schema per tool. This is independent of the template's own format, except for harmony
(GPT-OSS), whose replies are messages: there the reply is held to one harmony message to one
of the functions, its body to the function's schema (`ToolPlan.output`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from minerva.engine.structured import JSON_OPTIONS, StructuredOutput
from minerva.errors import MinervaError
from minerva.parsers import jsontext
from minerva.parsers.tool_calls import (MISTRAL_CALLS, PARSERS, PYTHON_TAG, TOOL_CALL_CLOSE, TOOL_CALL_OPEN,
                                          HarmonyCallParser, NamedParser, RequiredParser, ToolParser)

BUILTIN_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)

_PROBE_NAME = "minerva_probe_7f3a"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}


# ------------------------------------------------------------------ what a request asks for


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools: `choice` is "none", "auto", "required" or a function's name."""

    tools: tuple[dict, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    @property
    def prompt_tools(self) -> list[dict] | None:
        """The tools the prompt shows (none with tool_choice "none")."""
        return [dict(t) for t in self.tools] if self.tools and self.choice != "none" else None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    def function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    def constraint(self) -> dict | None:
        """The JSON schema the reply is held to, for a forced call; None otherwise."""
        if self.choice in ("none", "auto"):
            return None
        if self.choice != "required":
            return _parameters(self.function(self.choice))
        # each function's parameters go under $defs of the schema, where their own references
        # ("#/$defs/A", "#/definitions/A", "#") still find what they name
        defs = {f"tool{i}": _rooted(_parameters(t["function"]), f"#/$defs/tool{i}") for i, t in enumerate(self.tools)}
        items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": {"$ref": f"#/$defs/tool{i}"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(self.tools)]
        schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1,
                  "$defs": defs}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def held_to_json(self, fmt: "ToolFormat") -> bool:
        """Whether the whole reply is JSON (a forced call, for any format but harmony)."""
        return self.forced and fmt.name != "harmony"

    def output(self, fmt: "ToolFormat") -> StructuredOutput | None:
        """What a forced call holds the reply to: the JSON schema of `constraint`, or for a
        harmony model (whose reply is a message) a grammar of one harmony message to one of the
        functions, its body held to the function's parameters schema."""
        if not self.forced:
            return None
        if fmt.name != "harmony":
            return StructuredOutput(json=self.constraint())
        names = [t["function"]["name"] for t in self.tools] if self.choice == "required" else [self.choice]
        rules = [f"call{i}: <|channel|> {json.dumps(f'commentary to=functions.{name} ')} <|constrain|> "
                 f'"json" <|message|> args{i} <|call|>\n'
                 f"args{i}: %json {json.dumps({**_parameters(self.function(name)), 'x-guidance': JSON_OPTIONS})}\n"
                 for i, name in enumerate(names)]
        return StructuredOutput(grammar="start: " + " | ".join(f"call{i}" for i in range(len(names))) + "\n"
                                + "".join(rules))

    def parser(self, fmt: "ToolFormat", reasoning=None) -> ToolParser | None:
        """A parser for one reply; None when nothing is parsed (no tools, or tool_choice "none").
        `reasoning`: the reply's reasoning parser (harmony's calls are read by it)."""
        if not self.tools or self.choice == "none":
            return None
        if fmt.name == "harmony":  # forced or not, the call is a harmony message
            return HarmonyCallParser(reasoning, self.parallel, self.names)
        if self.choice == "required":
            return RequiredParser(self.parallel)
        if self.choice != "auto":
            return NamedParser(self.choice, self.parallel)
        return PARSERS[fmt.name](self.parallel, self.names)


def _rooted(schema: Any, root: str) -> Any:
    """`schema` with each local reference ("#", "#/...") made to start at `root`, the place it
    is moved to within another schema."""
    if isinstance(schema, dict):
        return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rooted(v, root))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rooted(v, root) for v in schema]
    return schema


def _parameters(function: Mapping) -> dict:
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def make_plan(tools: Sequence[Mapping] | None, tool_choice: str | Mapping | None,
              parallel: bool | None) -> ToolPlan | None:
    """The plan of OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`; None when the
    request uses no tools. A MinervaError for a choice that names nothing offered."""
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise MinervaError(f"tools must be a list of function tools, got {type(tools).__name__}")
    for i, t in enumerate(tools or ()):
        function = t.get("function") if isinstance(t, Mapping) else None
        if (not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(function, Mapping)
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise MinervaError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                               f'"parameters": {{...}}}}}}')
        params = function.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise MinervaError(f"tools[{i}]: the parameters of '{function['name']}' must be a JSON schema object",
                               "tools")
        kind = (params or {}).get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            # (a call's arguments are an object of named values; OpenAI's and Anthropic's APIs refuse others too)
            raise MinervaError(f"tools[{i}]: the parameters of '{function['name']}' must be a schema of type "
                               f"\"object\" (the arguments by name), got type {json.dumps(kind)}", "tools")
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise MinervaError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                           f'"function": {{"name": ...}}}}, got {tool_choice!r}')
    tools = tuple(dict(t) for t in tools or ())
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise MinervaError(f"tools: the function '{dup}' is given twice; give each function once", "tools")
    if isinstance(tool_choice, Mapping):
        choice = (tool_choice.get("function") or {}).get("name")
        if choice not in names:
            raise MinervaError(f"tool_choice names the function '{choice}', which is not among the tools "
                               f"({', '.join(names) or 'none given'})")
    else:
        choice = tool_choice or ("auto" if tools else "none")
    if choice == "required" and not tools:
        raise MinervaError('tool_choice "required" needs tools: give at least one function')
    if not tools:  # "none", or "auto" with nothing to call
        return None
    return ToolPlan(tools, choice, True if parallel is None else parallel)


# ------------------------------------------------------------------ the prompt


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """How a model's template takes tools (`native`: it renders them itself) and how its replies
    write calls (`name`, a key of PARSERS); `skip_special_tokens` False when its markers are
    special tokens that decoding must keep."""

    name: str
    native: bool
    skip_special_tokens: bool = True

    @property
    def markers(self) -> tuple[str, ...]:
        return PARSERS[self.name].markers if self.name in PARSERS else ()

    def render(self, messages: Sequence[Mapping], tools: list[dict] | None) -> tuple[list[dict], dict]:
        """The messages and extra template variables for a conversation with `tools` (or None)."""
        if self.native:
            return native_messages(messages), ({"tools": tools} if tools else {})
        return builtin_messages(messages, tools), {}


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return jsontext.loads(arguments)
        except ValueError:  # (text that is no JSON, or nested too deeply to walk, stays text)
            return arguments
    return arguments


def _call_names(messages: Sequence[Mapping]) -> dict[str, str]:
    return {c.get("id"): c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}


def native_messages(messages: Sequence[Mapping]) -> list[dict]:
    """Messages as templates with tool support read them: arguments as objects, tool results
    named after the function they answer."""
    names = _call_names(messages)
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        m.setdefault("content", "")
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": _arguments_object(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out


def builtin_messages(messages: Sequence[Mapping], tools: list[dict] | None) -> list[dict]:
    """Messages for a template without tool support, in the built-in (Hermes) format: plain
    system, user and assistant messages."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        if m.get("tool_calls"):
            calls = [f"{TOOL_CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                         "arguments": _arguments_object(c["function"]["arguments"])},
                                                        ensure_ascii=False) + f"\n{TOOL_CALL_CLOSE}"
                     for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool", None)
    if tools:
        text = BUILTIN_INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"]
                      else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def detect(template: str, render) -> ToolFormat:
    """The tool format of a chat template; `render(messages, **variables)` renders it."""
    try:
        native = _PROBE_NAME in render([{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL])
    except MinervaError:
        native = False
    if not native:
        return ToolFormat("hermes", native=False)
    if "<|channel|>" in template and "<|message|>" in template:
        return ToolFormat("harmony", native=True)
    if MISTRAL_CALLS in template:
        return ToolFormat("mistral", native=True)
    if PYTHON_TAG in template or ("<|start_header_id|>" in template and TOOL_CALL_OPEN not in template):
        return ToolFormat("llama3", native=True)
    return ToolFormat("hermes", native=True)  # Qwen2.5, Hermes and most fine-tunes


def tools_for(tokenizer, render) -> ToolFormat:
    """The tool format of the model `tokenizer` belongs to, with the decoding it needs."""
    fmt = detect(tokenizer.resolved_chat_template or "", render)
    ids = [tokenizer.token_to_id(m) for m in fmt.markers]
    special = any(tokenizer.is_special(i) for i in ids if i is not None)
    return dataclasses.replace(fmt, skip_special_tokens=not special)
