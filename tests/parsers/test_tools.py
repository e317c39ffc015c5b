"""Tool calling: the parsers that read calls out of a reply (whole or in pieces of any size),
the plan of a request's tools, the prompt side (a template's own tool support compared with
transformers' rendering of the same template; the built-in format for templates without it),
and `LLM.chat(tools=...)` on SmolLM2."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from minerva.engine.sampler import SamplingParams
from minerva.errors import MinervaError
from minerva.formats.chat import GEMMA3_TEMPLATE, render_chat
from minerva.parsers.reasoning import HarmonyParser
from minerva.parsers.tool_calls import (HarmonyCallParser, HermesParser, Llama3Parser, MistralParser, NamedParser,
                                          RequiredParser, join_pieces)
from minerva.parsers.tools import ToolFormat, detect, make_plan, native_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}

# In the shape of Qwen2.5's template (tools in the system message, calls as <tool_call> blocks,
# a run of tool results in one user turn): a template with tool support of its own.
QWEN_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time in Tokyo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "Asia/Tokyo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '"09:30"'},
]


def feed_all(parser, text: str, step: int | None = None):
    """The parser's output for `text` given whole (step None) or in pieces of `step` characters."""
    pieces, content = [], ""
    chunks = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for k, chunk in enumerate(chunks):
        c, p = parser.feed(chunk, end=k == len(chunks) - 1)
        content += c
        pieces += p
    return content, join_pieces(pieces)


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("step", [None, 1, 2, 3, 7])
def test_hermes_calls_between_text_whatever_the_pieces(step):
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n')
    content, calls = feed_all(HermesParser(), text, step)
    assert content == "Let me check."
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("step", [None, 1, 4])
def test_hermes_gives_back_what_is_not_a_call(step):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    content, calls = feed_all(HermesParser(), f"Hmm {bad} and a < sign, <tool", step)
    assert calls == [] and content == f"Hmm {bad} and a < sign, <tool"
    # A reply that ends inside a block whose JSON is whole (the model stopped before closing it) is a call.
    content, calls = feed_all(HermesParser(), '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}', step)
    assert content == "" and calls_of(calls) == [("f", {"a": 1})]


@pytest.mark.parametrize("step", [None, 1, 5])
def test_runs_keep_the_replys_order(step):
    """Text after a call is a run of its own, whatever the pieces: content, then the calls after it."""
    text = 'Checking. <tool_call>{"name": "a", "arguments": {}}</tool_call> Then <tool_call>' \
           '{"name": "b", "arguments": {}}</tool_call><tool_call>{"name": "c", "arguments": {}}</tool_call> done.'
    parser, events = HermesParser(), []
    chunks = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]
    for k, chunk in enumerate(chunks):
        for content, pieces in parser.feed_runs(chunk, end=k == len(chunks) - 1):
            if content and events and events[-1][0] == "text":
                events[-1] = ("text", events[-1][1] + content)
            elif content:
                events.append(("text", content))
            events += [("call", p.name) for p in pieces]
    assert events == [("text", "Checking."), ("call", "a"), ("text", "  Then"), ("call", "b"), ("call", "c"),
                      ("text", "  done.")]


def test_hermes_streams_text_before_the_marker_is_decided():
    parser = HermesParser()
    assert parser.feed("Sure, <tool") == ("Sure,", [])  # the space is held with the possible marker
    assert parser.feed("kit is here") == (" <toolkit is here", [])
    content, pieces = parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>', end=True)
    assert content == "" and [p.name for p in pieces] == ["f"] and parser.called


def test_one_call_without_parallel_calls():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c.name for c in feed_all(HermesParser(parallel=False), text)[1]] == ["a"]


@pytest.mark.parametrize("step", [None, 1, 5])
def test_mistral_both_spellings(step):
    content, calls = feed_all(MistralParser(), 'Ok [TOOL_CALLS][{"name": "get_weather", "arguments": '
                                               '{"city": "Rome"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]',
                              step)
    assert content == "Ok" and calls_of(calls) == [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "CET"})]
    content, calls = feed_all(MistralParser(), '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', step)
    assert content == "" and calls_of(calls) == [("get_weather", {"city": "Rome"})]
    content, calls = feed_all(MistralParser(), "[TOOL_CALLS] not json", step)
    assert calls == [] and content == "[TOOL_CALLS] not json"


@pytest.mark.parametrize("step", [None, 1, 6])
def test_llama3_json_replies(step):
    content, calls = feed_all(Llama3Parser(), '{"name": "get_weather", "parameters": {"city": "Oslo"}}', step)
    assert content == "" and calls_of(calls) == [("get_weather", {"city": "Oslo"})]
    content, calls = feed_all(Llama3Parser(), '<|python_tag|>{"name": "a", "parameters": {}}; '
                                              '{"name": "b", "parameters": {"x": 1}}', step)
    assert calls_of(calls) == [("a", {}), ("b", {"x": 1})]
    content, calls = feed_all(Llama3Parser(), 'It is {"not": "a call"} sunny.', step)
    assert calls == [] and content == 'It is {"not": "a call"} sunny.'
    content, calls = feed_all(Llama3Parser(), '{"key": "plain JSON, no call"}', step)
    assert calls == [] and content == '{"key": "plain JSON, no call"}'
    content, calls = feed_all(Llama3Parser(), '{"name": "Alice", "age": 30}', step)  # a name, but no arguments
    assert calls == [] and content == '{"name": "Alice", "age": 30}'
    text = 'Here is an example: {"name": "get_weather", "parameters": {"city": "Paris"}}'
    content, calls = feed_all(Llama3Parser(), text, step)  # JSON inside an answer is no call
    assert calls == [] and content == text


@pytest.mark.parametrize("depth", [65, 600, 990, 5000])  # past the parsers' bound; 990: parses, then breaks a dumps
def test_output_nested_too_deeply_is_text_not_a_crash(depth):
    """A reply whose would-be call holds JSON nested past the parsers' bound (64 levels) is
    given back as text, as any other call that cannot be read, by every parser; an earlier
    call's arguments so nested go to a template as the text they are, and the conversation
    renders."""
    deep = "[" * depth + "]" * depth
    cases = [(HermesParser(), f'<tool_call>{{"name": "f", "arguments": {{"a": {deep}}}}}</tool_call>'),
             (HermesParser(), f'<tool_call>{{"name": "f", "arguments": "{deep}"}}</tool_call>'),
             (MistralParser(), f"[TOOL_CALLS][{deep}]"),
             (MistralParser(), f'[TOOL_CALLS]f[ARGS]{{"a": {deep}}}'),
             (Llama3Parser(), f'{{"name": "f", "parameters": {{"a": {deep}}}}}')]
    for parser, text in cases:
        content, calls = feed_all(parser, text)
        assert calls == [] and content == text, type(parser).__name__
    content, calls = feed_all(RequiredParser(), f'[{{"name": "f", "arguments": {{"a": {deep}}}}}]')
    assert [c.name for c in calls] == ["f"]  # cut short as far as it reads: the name, its arguments as text
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}]}]
    messages = native_messages(earlier)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == deep
    assert deep in render_chat(QWEN_TEMPLATE, messages, bos_token=None, eos_token=None, tools=[WEATHER])


def test_json_nested_to_the_bound_is_read():
    nested = '{"a": ' * 63 + "1" + "}" * 63  # 63 objects in each other (and the call's own)
    _, calls = feed_all(HermesParser(), f'<tool_call>{{"name": "f", "arguments": {nested}}}</tool_call>')
    assert json.loads(calls[0].arguments) == json.loads(nested)


def test_a_template_is_never_given_nesting_past_its_bound():
    """What reaches a template directly (a tool's parameters schema) nested past 128 levels is
    a MinervaError (a 400 on the server), not a RecursionError."""
    schema = {"type": "object"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"x": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(MinervaError, match="nested more than 128 levels deep"):
        render_chat(QWEN_TEMPLATE, [{"role": "user", "content": "Hi"}], bos_token=None, eos_token=None, tools=[tool])


def test_only_offered_functions_are_called():
    names = frozenset({"get_weather"})
    other = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    content, calls = feed_all(HermesParser(names=names), other + other.replace("rm_rf", "get_weather"))
    assert [c.name for c in calls] == ["get_weather"] and content == other
    content, calls = feed_all(MistralParser(names=names), '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]')
    assert calls == [] and content == '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]'
    _, calls = feed_all(MistralParser(names=names), '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}]')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()  # Mistral's templates take only such ids back


def test_forced_parsers():
    parser = NamedParser("get_weather")
    first = parser.feed('{"ci')[1]
    rest = parser.feed('ty": "Paris"}', end=True)[1]
    assert first[0].name == "get_weather" and first[0].id and rest[0].name is None
    assert calls_of(join_pieces(first + rest)) == [("get_weather", {"city": "Paris"})]
    content, calls = feed_all(RequiredParser(), '[{"name": "get_time", "arguments": {"zone": "UTC"}}]', 3)
    assert content == "" and calls_of(calls) == [("get_time", {"zone": "UTC"})]
    # cut off by max_tokens: the calls written so far, as a named call cut short gives its own;
    # the grammar's array is never content
    for cut, expected in [('[{"name": "get_time", "argu', [("get_time", "")]),
                          ('[{"name": "get_time", "arguments": {"zone": "U', [("get_time", '{"zone": "U')]),
                          ('[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": ',
                           [("get_time", '{"zone": "UTC"}'), ("get_weather", "")]),
                          ('[{"name": "get_ti', []), ("[", [])]:
        content, calls = feed_all(RequiredParser(), cut, 3)
        assert content == "" and [(c.name, c.arguments) for c in calls] == expected, cut


def test_plan_and_its_constraints():
    assert make_plan(None, None, None) is None and make_plan([], "auto", None) is None
    plan = make_plan([WEATHER, TIME], None, None)
    assert plan.choice == "auto" and not plan.forced and plan.constraint() is None
    assert make_plan([WEATHER], "none", None).prompt_tools is None
    named = make_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.constraint() == WEATHER["function"]["parameters"]
    required = make_plan([WEATHER, TIME], "required", False).constraint()
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC"}}], required)
    for wrong in ([], [{"name": "get_time", "arguments": {"city": "x"}}],
                  [{"name": "get_weather", "arguments": {"city": "a"}}] * 2):  # maxItems 1 without parallel calls
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required)
    for tools, choice, message in [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the tools"),
        (None, "required", "needs tools"),
        ([WEATHER, WEATHER], None, "given twice"),
        ([{"type": "function"}], None, r"tools\[0\] must be"),
        ([WEATHER], "sometimes", "tool_choice must be"),
    ]:
        with pytest.raises(MinervaError, match=message):
            make_plan(tools, choice, None)


def render(template, messages, **variables):
    return render_chat(template, messages, bos_token="<s>", eos_token="</s>", **variables)


def test_native_template_renders_as_transformers_does():
    """A template with tool support gets what transformers' apply_chat_template passes it."""
    fmt = detect(QWEN_TEMPLATE, lambda m, **v: render(QWEN_TEMPLATE, m, **v))
    assert fmt == ToolFormat("hermes", native=True)
    messages, variables = fmt.render(CONVERSATION, [WEATHER, TIME])
    ours = render(QWEN_TEMPLATE, messages, add_generation_prompt=True, **variables)
    hf_messages = json.loads(json.dumps(CONVERSATION))
    for call in hf_messages[2]["tool_calls"]:  # transformers takes the arguments as objects
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<s>": 0, "</s>": 1}, unk_token="<s>")),
                                        bos_token="<s>", eos_token="</s>")
    theirs = tokenizer.apply_chat_template(hf_messages, tools=[WEATHER, TIME], chat_template=QWEN_TEMPLATE,
                                           tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '"arguments": {"zone": "Asia/Tokyo"}' in ours and "get_time" in ours


def test_builtin_format_for_templates_without_tools():
    """Gemma 3's template knows no tools and insists on alternating roles: the built-in format
    puts the tools in the first turn, the calls in the model's turn, both results in one user turn."""
    fmt = detect(GEMMA3_TEMPLATE, lambda m, **v: render(GEMMA3_TEMPLATE, m, **v))
    assert fmt == ToolFormat("hermes", native=False)
    messages, variables = fmt.render(CONVERSATION, [WEATHER, TIME])
    assert variables == {} and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    prompt = render(GEMMA3_TEMPLATE, messages, add_generation_prompt=True)
    assert prompt.startswith("<s><start_of_turn>user\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in prompt and "<tool_call>" in prompt
    assert ('<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time"') in prompt
    assert ('<start_of_turn>user\n<tool_response>\n{"temp": 18}\n</tool_response>\n<tool_response>\n"09:30"\n'
            '</tool_response><end_of_turn>\n<start_of_turn>model\n') in prompt


def test_llm_chat_with_tools(smollm2_llm):
    """Offline: a forced call's arguments validate against the function's schema."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    greedy = SamplingParams(max_tokens=60, temperature=0)
    out = smollm2_llm.chat(ask, greedy, tools=[WEATHER, TIME],
                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = out.outputs[0]
    assert c.finish_reason == "tool_calls" and c.text == "" and [t.name for t in c.tool_calls] == ["get_weather"]
    jsonschema.validate(json.loads(c.tool_calls[0].arguments), WEATHER["function"]["parameters"])
    out = smollm2_llm.chat(ask, greedy, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert len(out.outputs[0].tool_calls) == 1
    plain = smollm2_llm.chat(ask, greedy, tools=[WEATHER], tool_choice="none")
    assert plain.outputs[0].tool_calls is None and plain.outputs[0].text
    with pytest.raises(MinervaError, match="not among the tools"):
        smollm2_llm.chat(ask, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})


@pytest.mark.parametrize("step", [None, 1, 4])
def test_harmony_calls_are_read_by_the_reasoning_parser(step):
    """A commentary message to functions.NAME is a call (its recipient in the channel part or in
    the role part); one to a built-in tool is dropped; a call cut short is kept only if whole."""
    reply = ("<|channel|>analysis<|message|>Two calls.<|end|>"
             '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
             '<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>'
             '<|start|>assistant to=python<|channel|>analysis<|message|>print(1)<|call|>'
             "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    harmony = HarmonyParser("<|start|>assistant")
    caller = HarmonyCallParser(harmony)
    reasoning, content, pieces = "", "", []
    chunks = [reply] if step is None else [reply[i:i + step] for i in range(0, len(reply), step)]
    for k, chunk in enumerate(chunks):
        r, c = harmony.feed(chunk, end=k == len(chunks) - 1)
        c, p = caller.feed(c, end=k == len(chunks) - 1)
        reasoning, content, pieces = reasoning + r, content + c, pieces + p
    assert (reasoning, content) == ("Two calls.", "Done.")
    assert calls_of(join_pieces(pieces)) == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]
    cut = HarmonyParser("<|start|>assistant")
    cut.feed('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": ', end=True)
    assert cut.calls == []
