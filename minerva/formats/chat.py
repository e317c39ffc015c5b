"""Chat templates: render a conversation into the prompt text a model expects.

Templates are Jinja, as Hugging Face writes them (`tokenizer.chat_template` in a
GGUF, `chat_template` in tokenizer_config.json). They come with model files,
so they are untrusted: they run in Jinja's immutable sandbox, where any access
to an unsafe attribute (`__class__`, `__globals__`, ...) fails at once instead
of quietly rendering as empty, and within a budget of time, loop iterations and
size (`chat_budget`, `chat_limits`), so a template cannot hang or exhaust the
server either.

    text = render_chat(template, [{"role": "user", "content": "Hi"}],
                       bos_token="<s>", eos_token="</s>")
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError

from minerva.errors import MinervaError
from minerva.formats.chat_budget import DEFAULT_LIMITS, TemplateLimitError, TemplateLimits, limited
from minerva.formats.chat_limits import LimitedSandbox, limited_filter

__all__ = ["BUILTIN_TEMPLATES", "CHATML_TEMPLATE", "GEMMA3_TEMPLATE", "RESERVED_VARIABLES", "TemplateCompileError",
           "TemplateLimitError", "TemplateLimits", "chat_template_for", "check_template", "read_template", "render_chat",
           "validate_messages"]

# Names `render_chat` sets itself or takes as its own arguments: not for extra template variables.
RESERVED_VARIABLES = frozenset({"template", "messages", "bos_token", "eos_token", "add_generation_prompt",
                                "limits", "source", "tools", "continue_final_message"})

# The official Gemma 3 template (google/gemma-3-*-it): the system message is
# put in front of the first user turn, and the assistant's role is "model".
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# ChatML, for models that carry no template and have no built-in one.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Built-in templates by GGUF `general.architecture` / HF `model_type`.
BUILTIN_TEMPLATES: dict[str, str] = {
    "gemma": GEMMA3_TEMPLATE,
    "gemma2": GEMMA3_TEMPLATE,
    "gemma3": GEMMA3_TEMPLATE,
    "gemma3_text": GEMMA3_TEMPLATE,
    "chatml": CHATML_TEMPLATE,
}


def chat_template_for(tokenizer_template: str | None, architecture: str) -> str:
    """The template to use: the model's own, else a built-in one for its architecture, else ChatML."""
    if tokenizer_template:
        return tokenizer_template
    return BUILTIN_TEMPLATES.get((architecture or "").lower(), CHATML_TEMPLATE)


class _Sandbox(LimitedSandbox):
    """The immutable sandbox with budgets, and an unsafe attribute raises instead of being undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by some HF templates to
    mark assistant text): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: Any) -> None:
    raise TemplateError(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Like HF's: no HTML escaping, and the json.dumps options exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} is not allowed")


@lru_cache(maxsize=1)
def _environment() -> _Sandbox:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    del env.globals["lipsum"]  # writes n paragraphs of filler: no use to a chat template, and n is unbounded
    for name, func in list(env.filters.items()):
        env.filters[name] = limited_filter(name, func)
    return env


MAX_TEMPLATE_CHARS = 1 << 20  # real chat templates are under 20K characters


class TemplateCompileError(MinervaError):
    """A chat template that does not compile: the fault of whoever gave the template (the model
    file, --chat-template), not of a conversation rendered with it."""


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template | MinervaError:
    """The compiled template, or the error that refuses it (kept too, so a broken template
    is not compiled again for every request)."""
    if len(template) > MAX_TEMPLATE_CHARS:
        return TemplateLimitError(f"the chat template has {len(template):,} characters, over the limit of "
                                  f"{MAX_TEMPLATE_CHARS:,}")
    try:
        return _environment().from_string(template)
    except TemplateError as e:
        return TemplateCompileError(f"invalid chat template: {_one_line(e)}")
    except (RecursionError, SyntaxError, MemoryError) as e:  # Jinja's parser, or Python's compiler, ran out
        why = {RecursionError: "past the recursion limit", MemoryError: "out of memory"}.get(
            type(e), getattr(e, "msg", "") or type(e).__name__)  # a SyntaxError's line is the generated code's
        return TemplateLimitError(f"the chat template nests too deeply to compile ({why})")
    except Exception as e:  # noqa: BLE001 - a template is input; any failure to compile it is the input's
        return TemplateCompileError(f"invalid chat template: {type(e).__name__}: {_one_line(e)}")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


PLAIN_DEPTH = 128  # lists and mappings inside each other in what a template is given (parsers' JSON: 64)


def _plain(value: Any, depth: int = 0) -> Any:
    """A copy built of plain JSON types only, so templates see no other objects (nor nesting
    deeper than PLAIN_DEPTH, which would exhaust the stack of what walks it)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, (Mapping, list, tuple)) and depth >= PLAIN_DEPTH:
        raise MinervaError(f"a chat message or tool field is nested more than {PLAIN_DEPTH} levels deep")
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, str):  # a str subclass: keep the text, drop the class
        return str(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    raise MinervaError(f"chat message field of type {type(value).__name__} is not allowed")


def validate_messages(messages: Any) -> list[dict]:
    """Check `messages` is a non-empty list of {"role": str, "content": str} and return a plain copy."""
    if not isinstance(messages, (list, tuple)):
        raise MinervaError(f"chat messages must be a list of {{role, content}} objects, got {type(messages).__name__}")
    if not messages:
        raise MinervaError("chat messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise MinervaError(f"chat message {i} must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        content = m.get("content")
        if not isinstance(role, str) or not role:
            raise MinervaError(f"chat message {i} has no 'role' string")
        if not isinstance(content, str):
            raise MinervaError(
                f"chat message {i} ('{role}') must have string 'content', got {type(content).__name__}"
            )
        out.append(_plain(m))
    return out


def render_chat(
    template: str,
    messages: list[dict],
    *,
    bos_token: str | None,
    eos_token: str | None,
    add_generation_prompt: bool = True,
    limits: TemplateLimits = DEFAULT_LIMITS,
    source: str = "",
    **variables: Any,
) -> str:
    """Render `messages` with a Jinja chat `template`, as transformers' `apply_chat_template(tokenize=False)` does.

    Extra keyword arguments (e.g. `tools`, other special tokens) are passed to the template too.
    A template that runs past `limits` (time, loop iterations, size) raises `TemplateLimitError`.
    `source` says where the template comes from, for its errors. Safe to call from any thread.
    """
    if not isinstance(template, str) or not template:
        raise MinervaError("chat template is empty")
    context = {k: _plain(v) for k, v in variables.items()}
    context.update(messages=validate_messages(messages), bos_token=bos_token or "", eos_token=eos_token or "",
                   add_generation_prompt=bool(add_generation_prompt))
    try:
        return _render(template, context, limits)
    except MinervaError as e:
        raise (type(e)(f"{e} ({source})") if source else e).with_traceback(None) from None


def read_template(given: str | os.PathLike) -> tuple[str, str]:
    """A chat template the user gives (--chat-template, LLM(chat_template=)): a file's path, or
    the template's text itself (it holds Jinja's {{ or {%); its text and where it comes from."""
    name = os.fspath(given) if isinstance(given, (str, os.PathLike)) else None
    if not name or not name.strip():
        raise MinervaError(f"chat_template (--chat-template) must be a Jinja file's path or a template's text, "
                           f"got {given!r}")
    if "{{" in name or "{%" in name:
        return name, "the chat template given (--chat-template)"
    try:
        if os.path.getsize(name) > 4 * MAX_TEMPLATE_CHARS:
            raise MinervaError(f"the chat template file '{name}' is over {4 * MAX_TEMPLATE_CHARS:,} bytes; give "
                               "a Jinja chat template")
        with open(name, "rb") as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError:
        raise MinervaError(f"the chat template file '{name}' is not UTF-8 text; give a Jinja chat template") from None
    except OSError as exc:
        raise MinervaError(f"the chat template file '{name}' cannot be read ({exc.strerror or exc}); give a Jinja "
                           "file's path, or the template's text (text holding Jinja's {{ }} or {% %})") from None
    if not text.strip():
        raise MinervaError(f"the chat template file '{name}' is empty; give a Jinja chat template")
    return text, f"the chat template file '{name}'"


def check_template(template: str, source: str) -> None:
    """Refuse a template that does not compile, naming `source`."""
    compiled = _compile(template)
    if isinstance(compiled, MinervaError):
        raise type(compiled)(f"{compiled} ({source})")


def _render(template: str, context: dict, limits: TemplateLimits) -> str:
    compiled = _compile(template)
    if isinstance(compiled, MinervaError):
        raise type(compiled)(str(compiled))
    try:
        with limited(limits):
            return compiled.render(**context)
    except TemplateLimitError as e:
        raise e.with_traceback(None) from None
    except SecurityError as e:
        raise MinervaError(f"chat template tried something unsafe: {_one_line(e)}") from None
    except TemplateError as e:
        raise MinervaError(f"chat template error: {_one_line(e)}") from None
    except RecursionError:
        raise MinervaError("chat template error: recursion too deep") from None
    except Exception as e:  # noqa: BLE001 - a template is input; any failure is the input's
        raise MinervaError(f"chat template error: {type(e).__name__}: {_one_line(e)}") from None


def continued(rendered: str, last: dict) -> str:
    """A rendered conversation cut after the text of its last message, an assistant's, so that
    the reply goes on from it (transformers' continue_final_message)."""
    content = last.get("content") if isinstance(last, dict) else None
    if not (isinstance(content, str) and content.strip() and last.get("role") == "assistant"):
        raise MinervaError("continue_final_message goes on with the last message: it must be an assistant's, "
                           "with text")
    text = content.strip()
    if text not in rendered:
        raise MinervaError("continue_final_message: the chat template does not write the last message's text as "
                           "given, so the reply cannot go on from it")
    return rendered[:rendered.rindex(text) + len(text)]
