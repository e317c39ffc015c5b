"""Chat templates run within a budget (minerva/formats/chat_budget.py, chat_limits.py).

Runaway templates (loops nested to billions of iterations, strings doubled into
gigabytes, exponential macro recursion) stop with TemplateLimitError, while
ordinary templates render exactly as Jinja's own immutable sandbox renders them
(the reference: the same environment without the budget hooks).
"""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jinja2.ext
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minerva import LLM, SamplingParams
from minerva.errors import MinervaError
from minerva.formats.chat import (CHATML_TEMPLATE, GEMMA3_TEMPLATE, MAX_TEMPLATE_CHARS, TemplateLimitError,
                                  TemplateLimits, _GenerationTag, _Namespace, _raise_exception, _TemplateDict,
                                  _tojson, render_chat)
from tests.helpers.cli import assert_clean_error, run
from tests.helpers.tiny_gguf import write_tiny_llama

MSGS = [{"role": "user", "content": "hi"}]
HANG_GUARD_S = 30  # only against a hang: each case stops in about a second or less
# Budgets that make one limit the one that trips, whatever the machine's speed.
ITERATIONS = TemplateLimits(time_s=600, max_iterations=100_000)
TIME = TemplateLimits(time_s=0.3, max_iterations=10**12)
BOMB = "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
MACRO_TREE = "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"

RUNAWAY = {
    # loops: every loop counts, whatever it iterates over
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
                      ITERATIONS, "more than 100000 loop iterations"),
    "nested empty loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                           ITERATIONS, "more than 100000 loop iterations"),
    "loops over a string": ("{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
                            ITERATIONS, "loop iterations"),
    "loops over a dict": ("{% set d = dict.fromkeys(range(100000)) %}{% for a in d %}{% for b in d if b %}"
                          "{% endfor %}{% endfor %}", ITERATIONS, "loop iterations"),
    "empty loops, time": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                          TIME, "exceeded its time budget of 0.3 s"),
    "recursive loop": ("{% for x in [[1, 2], [3]] recursive %}{{ loop([x, x]) }}{% endfor %}", None,
                       "recursion too deep"),
    # recursion: deep ends in Python's recursion limit, wide in the time budget
    "macro recursion, deep": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", None, "recursion too deep"),
    "macro recursion, wide": (MACRO_TREE + "{{ f(60) }}", TIME, "time budget"),
    "caller recursion, wide": ("{% macro twice() %}{{ caller() }}{{ caller() }}{% endmacro %}{% macro f(n) %}"
                               "{% if n > 0 %}{% call twice() %}{{ f(n - 1) }}{% endcall %}{% endif %}{% endmacro %}"
                               "{{ f(25) }}", TIME, "time budget"),
    # sizes, refused before the value is built
    "string doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}{{ ns.s }}", None, "more than 8000000 characters"),
    "string doubling with ~": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                               "{% endfor %}", None, "more than 8000000 characters"),
    "string times a billion": ("{{ 'x' * 10**9 }}", None, "more than 8000000 characters"),
    "a billion times a string": ("{{ 10**9 * 'xy' }}", None, "more than 8000000 characters"),
    "list times a billion": ("{{ ([1] * 10**9)|length }}", None, "list of more than 1000000 items"),
    "join of a huge generated list": ("{{ range(1000)|map('center', 10000)|join(',') }}", None,
                                      "more than 8000000 characters"),
    "join of huge strings": ("{% set s = 'x' * 1000000 %}{{ ([s] * 9)|join }}", None, "more than 8000000 characters"),
    "list of a huge list": ("{{ (range(100000)|list * 20)|join(',') }}", None, "list of more than 1000000 items"),
    "join of a generator": ("{{ range(9)|map('center', 1000000)|join }}", None, "more than 8000000 characters"),
    "str.join": ("{% set s = 'x' * 1000000 %}{{ ''.join([s] * 9) }}", None, "more than 8000000 characters"),
    "replace": ("{% set s = 'x' * 10000 %}{{ s|replace('x', s) }}", None, "more than 8000000 characters"),
    "str.replace": ("{% set s = 'x' * 10000 %}{{ s.replace('x', s) }}", None, "more than 8000000 characters"),
    "center": ("{{ 'x'|center(10**9) }}", None, "more than 8000000 characters"),
    "str.center": ("{{ 'x'.center(10**9) }}", None, "more than 8000000 characters"),
    "indent": ("{{ 'a\nb'|indent(10**9) }}", None, "more than 8000000 characters"),
    "format filter": ("{{ '%*s'|format(10**9, 'x') }}", None, "more than 8000000 characters"),
    "printf": ("{{ '%.999999999f' % 1.5 }}", None, "more than 8000000 characters"),
    "str.format width": ("{{ '{:>999999999}'.format('x') }}", None, "more than 8000000 characters"),
    "str.format nested width": ("{{ '{:>{w}}'.format('x', w=999999999) }}", None, "more than 8000000 characters"),
    "str.format repeated field": ("{% set s = 'x' * 1000000 %}{{ ('{0}' * 9).format(s) }}", None,
                                  "more than 8000000 characters"),
    "tojson indent": ("{{ [[[[1]]]]|tojson(indent=10**8) }}", None, "more than 8000000 characters"),
    "bytes": ("{{ ('x'.encode() * 10**9)|length }}", None, "more than 8000000 characters"),
    "batch fill": ("{{ [1]|batch(10**9, 0)|list|length }}", None, "list of more than"),
    "sum of lists": ("{{ ([[1] * 4000] * 4000)|sum(start=[])|length }}", None, "list of more than"),
    "striptags": ("{{ ('<>' * 1000000)|striptags }}", None, "more than 8000000 characters"),
    "squaring": ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
                 None, "number of more than 65536 bits"),
    "power": ("{{ 2 ** 1000000 }}", None, "number of more than 65536 bits"),
    # a list that holds another twice, 40 times over, prints as terabytes
    "shared list printed": (BOMB + "{{ ns.l }}", None, "more than 8000000 characters"),
    "shared list as json": (BOMB + "{{ ns.l|tojson }}", None, "more than 8000000 characters"),
    "shared list joined": (BOMB + "{{ ns.l|join }}", None, "more than 8000000 characters"),
    "shared list in ~": (BOMB + "{{ 'a' ~ ns.l }}", None, "more than 8000000 characters"),
    "shared list in %": (BOMB + "{{ '%s' % [ns.l] }}", None, "more than 8000000 characters"),
    "shared list in a namespace": (BOMB + "{{ ns }}", None, "more than 8000000 characters"),
    # the output as a whole, and everything built together
    "output": ("{% for i in range(100000) %}" + "y" * 100 + "{% endfor %}", None,
               "rendered more than 8000000 characters"),
    "output captured by set": ("{% for i in range(100000) %}{% set x %}{% for j in range(20) %}" + "y" * 1000
                               + "{% endfor %}{% endset %}{% endfor %}", None, "rendered more than 8000000"),
    "many large copies": ("{% set ns = namespace(l=[], s='x' * 7000000) %}{% for i in range(1000) %}"
                          "{% set ns.l = ns.l + [ns.s ~ i] %}{% endfor %}", None,
                          "built more than 128000000 characters in all"),
    "many large slices": ("{% set ns = namespace(l=[], s='x' * 7000000) %}{% for i in range(1000) %}"
                          "{% set ns.l = ns.l + [ns.s[i:]] %}{% endfor %}", None, "128000000 characters in all"),
}


@pytest.mark.parametrize("template,limits,message", RUNAWAY.values(), ids=list(RUNAWAY))
def test_runaway_template_stops(template, limits, message):
    kwargs = {} if limits is None else {"limits": limits}
    start = time.monotonic()
    with pytest.raises(MinervaError, match=message) as e:
        render_chat(template, MSGS, bos_token="", eos_token="", **kwargs)
    assert time.monotonic() - start < HANG_GUARD_S
    assert "\n" not in str(e.value)
    if "recursion" not in message:
        assert isinstance(e.value, TemplateLimitError)


def test_limits_are_validated():
    with pytest.raises(MinervaError, match="time_s"):
        TemplateLimits(time_s=0)
    with pytest.raises(MinervaError, match="max_chars"):
        TemplateLimits(max_chars=-1)


def test_lipsum_is_not_offered():
    with pytest.raises(MinervaError, match="lipsum"):
        render_chat("{{ lipsum(10**9) }}", MSGS, bos_token="", eos_token="")


def _reference_env() -> ImmutableSandboxedEnvironment:
    """Jinja's immutable sandbox set up as chat.py sets up its own, without the budget."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, dict=_TemplateDict(), namespace=_Namespace)
    return env


# Ordinary template features, each through the hooks: loops and their variables, recursive
# loops, macros and caller, namespace, filters, operators, formatting, blocks, autoescape.
FEATURES = [
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ '!' if loop.last }}{{ m.role ~ ':' ~ m.content }}"
    "{% if not loop.first %},{{ loop.previtem.role }}{% endif %}{% else %}none{% endfor %}",
    "{% for m in messages|selectattr('role', 'equalto', 'user') %}{{ m.content|upper }}{{ loop.length }}{% endfor %}",
    "{% for m in messages if m.role != 'system' %}{{ loop.index0 }}{{ loop.revindex }}{{ loop.cycle('a', 'b') }}"
    "{% endfor %}",
    "{% for k, v in messages[0]|dictsort %}{{ k }}={{ v }};{% endfor %}{% for k in messages[0] %}{{ k }}{% endfor %}",
    "{% for x in [[1, [2, 3]], [4]] recursive %}[{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}"
    "{% endif %}]{% endfor %}",
    "{% macro turn(m, sep='\n') %}<{{ m.role }}>{{ m.content|trim }}{{ sep }}{% endmacro %}"
    "{% for m in messages %}{{ turn(m) }}{{ turn(m, sep='|') }}{% endfor %}",
    "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}"
    "{% call wrap('b') %}{{ messages|length }}{% endcall %}",
    "{% set ns = namespace(sys='', n=0) %}{% for m in messages %}{% if m.role == 'system' %}"
    "{% set ns.sys = ns.sys + m.content + '\n' %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.sys }}{{ ns.n }}",
    "{{ messages|map(attribute='content')|join(' | ') }}{{ messages|map(attribute='role')|unique|list|tojson }}",
    "{{ messages|tojson }}{{ messages[0]|tojson(indent=2, sort_keys=True) }}{{ {'a': [1, 2.5, none]}|tojson }}",
    "{{ messages[-1].content[:5] }}{{ messages[1:]|length }}{{ 'abcdef'[::2] }}{{ messages[0].content[2:-1] }}",
    "{{ 'ab' * 3 }}{{ [1, 2] * 2 }}{{ 3 * 'c' }}{{ 2 ** 10 }}{{ 7 % 3 }}{{ 7 // 2 }}{{ 1 + 2 * 3 }}{{ 'a' + 'b' }}",
    "{{ '%s says %d' % ('x', 3) }}{{ '%(a)s-%(b)05.1f' % {'a': 1, 'b': 2.25} }}{{ '%-5s|' % 'ab' }}",
    "{{ '{} and {}'.format('a', 'b') }}{{ '{x:>6}|{0!r}'.format('q', x='y') }}{{ '{a}'.format_map({'a': 5}) }}",
    "{{ 'x'|center(9) }}|{{ 'a\nb\nc'|indent(2, first=true) }}|{{ 'aXbX'|replace('X', '--') }}|"
    "{{ '%s-%s'|format('p', 'q') }}|{{ 'a b c d e'|wordwrap(3) }}|{{ '<b>hi</b> x'|striptags }}",
    "{{ 'hello world'|title }}{{ 'x'|e }}{{ '<a>'|e }}{{ '  pad  '|trim }}{{ 'a-b'|capitalize }}"
    "{{ 'long text here'|truncate(9, end='.') }}{{ 'one two'|wordcount }}{{ 'a b'|urlencode }}",
    "{{ range(10)|batch(3, 0)|list }}{{ range(10)|slice(3)|list }}{{ [[1], [2, 3]]|sum(start=[]) }}"
    "{{ [3, 1, 2]|sort|list }}{{ [1, 2, 3]|sum }}{{ [1, 2]|reverse|list }}{{ 'abc'|list }}",
    "{{ 'a,b,c'.split(',') }}{{ 'x\ny'.splitlines() }}{{ '-'.join(['a', 'b']) }}{{ 'a\tb'.expandtabs(4) }}"
    "{{ 'q'.ljust(3, '.') }}{{ '7'.zfill(3) }}{{ 'abc'.translate({97: 'AA'}) }}{{ 'e\u0301'.encode()|length }}",
    "{% set block %}{% for m in messages %}{{ m.role }};{% endfor %}{% endset %}{{ block|upper }}"
    "{% filter upper %}{{ messages[0].content }} tail{% endfilter %}",
    "{% autoescape true %}{{ '<x>' }}{{ '<y>' ~ 'z&' }}{{ '<b>'|safe }}{{ ['<i>']|join }}{% endautoescape %}{{ '<n>' }}",
    "{{ dict(a=1, b=[2])|tojson }}{{ namespace(k=1).k }}{{ none }}{{ true }}{{ 1.5 }}{{ (1, 2) }}{{ [1, 'a'] }}"
    "{{ {'k': 'v'} }}{{ undefined_name }}{{ messages|first|length }}{{ range(3)|list }}",
    "{{ bos_token }}{% generation %}{{ eos_token }}{% endgeneration %}{{ add_generation_prompt }}",
]
CONVERSATION = [
    {"role": "system", "content": "Be brief. <tags> & 'quotes'"},
    {"role": "user", "content": "  What is 2+2?\n"},
    {"role": "assistant", "content": "4.\u00e9\U0001F600"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.mark.parametrize("template", FEATURES)
def test_ordinary_templates_render_as_jinja_sandbox(template):
    reference = _reference_env().from_string(template).render(
        messages=CONVERSATION, bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
    assert render_chat(template, CONVERSATION, bos_token="<s>", eos_token="</s>") == reference


def _long_conversation(n: int = 200) -> list[dict]:
    rng = random.Random(0)
    words = (Path(__file__).parents[1] / "data" / "prose.txt").read_text().split()
    conversation = [{"role": "system", "content": " ".join(rng.choices(words, k=300))}]
    for i in range(n):
        conversation.append({"role": "user" if i % 2 == 0 else "assistant",
                             "content": " ".join(rng.choices(words, k=rng.randint(20, 400)))})
    return conversation


@pytest.mark.parametrize("template", [GEMMA3_TEMPLATE, CHATML_TEMPLATE], ids=["gemma3", "chatml"])
def test_long_conversation_renders_as_jinja_sandbox(template):
    conversation = _long_conversation()
    reference = _reference_env().from_string(template).render(
        messages=conversation, bos_token="<bos>", eos_token="<eos>", add_generation_prompt=True)
    assert render_chat(template, conversation, bos_token="<bos>", eos_token="<eos>") == reference


def test_budgets_are_per_render_and_per_thread():
    """A runaway render on one thread neither trips nor is let off by renders on others;
    the same compiled template renders again right after a render that ran out."""
    runaway = MACRO_TREE + "{{ f(60) }}"
    conversation = _long_conversation(20)
    expected = render_chat(GEMMA3_TEMPLATE, conversation, bos_token="<bos>", eos_token="<eos>")
    with ThreadPoolExecutor(4) as pool:
        stuck = pool.submit(render_chat, runaway, MSGS, bos_token="", eos_token="", limits=TIME)
        renders = [pool.submit(render_chat, GEMMA3_TEMPLATE, conversation, bos_token="<bos>", eos_token="<eos>")
                   for _ in range(20)]
        assert all(r.result(timeout=HANG_GUARD_S) == expected for r in renders)
        with pytest.raises(TemplateLimitError, match="time budget"):
            stuck.result(timeout=HANG_GUARD_S)
    assert render_chat(MACRO_TREE + "{{ f(3) }}", MSGS, bos_token="", eos_token="") == ""


def test_renders_through_asyncio_to_thread():
    async def both():
        ok = asyncio.to_thread(render_chat, CHATML_TEMPLATE, MSGS, bos_token="", eos_token="")
        bad = asyncio.to_thread(render_chat, "{{ 'x' * 10**9 }}", MSGS, bos_token="", eos_token="")
        return await asyncio.gather(ok, bad, return_exceptions=True)

    ok, bad = asyncio.run(both())
    assert ok == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert isinstance(bad, TemplateLimitError)


# ------------------------------------------------------------------ deep and wide templates

# Pieces that nest: each wraps the template text `t` once more.
_NESTINGS = [
    lambda t: "{% if messages %}" + t + "{% endif %}",
    lambda t: "{% for m in messages %}" + t + "{% endfor %}",
    lambda t: "{% macro m() %}" + t + "{% endmacro %}{{ m() }}",
    lambda t: "{% set x %}" + t + "{% endset %}{{ x }}",
    lambda t: "{% filter upper %}" + t + "{% endfilter %}",
]
# Expressions that nest: each wraps the expression `e` once more.
_EXPRESSIONS = [
    lambda e: f"({e})", lambda e: f"{e}|list", lambda e: f"[{e}]", lambda e: f"not {e}", lambda e: f"-{e}",
    lambda e: f"{e} + 1", lambda e: f"{e}[0]", lambda e: f"{e}.content", lambda e: f"{e} ~ 'x'",
    lambda e: f"({e} if messages else 1)", lambda e: f"{{'k': {e}}}", lambda e: f"{e}|length",
]


def _deep(kinds: list[int], expression: bool) -> str:
    text = "messages" if expression else "x"
    for k in kinds:
        text = _EXPRESSIONS[k % len(_EXPRESSIONS)](text) if expression else _NESTINGS[k % len(_NESTINGS)](text)
    return "{{ " + text + " }}" if expression else text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(1, 1500), seed=st.integers(0, 2**32), expression=st.booleans(), wide=st.integers(1, 3))
def test_deep_and_wide_templates_render_or_are_refused_in_one_line(depth, seed, expression, wide):
    """Whatever the nesting (of statements or expressions, up to 1,500 levels, mixed at random)
    and repetition, a template renders or is refused with one line: never a RecursionError, a
    SyntaxError from the compiled code, or any other traceback."""
    kinds = random.Random(seed).choices(range(len(_EXPRESSIONS) * len(_NESTINGS)), k=depth)
    template = _deep(kinds, expression) * wide
    start = time.monotonic()
    try:
        out = render_chat(template, MSGS, bos_token="", eos_token="")
    except MinervaError as e:
        assert "\n" not in str(e) and str(e), repr(e)
    else:
        assert isinstance(out, str)
    assert time.monotonic() - start < HANG_GUARD_S


@pytest.mark.parametrize("depth", [200, 300, 5000])
def test_a_template_nesting_filters_is_refused_in_one_line(depth):
    """A hostile probe's template, `{{ messages|list|list|... }}`: 200 filters overflowed the
    compiler's parentheses, 300 and more its recursion; both are one line now, every time."""
    template = "{{ messages" + "|list" * depth + " }}"
    for _ in range(2):  # the refusal is cached, and raised anew
        with pytest.raises(TemplateLimitError, match="nests too deeply to compile") as e:
            render_chat(template, MSGS, bos_token="", eos_token="")
        assert "\n" not in str(e.value) and "<template>" not in str(e.value)


def test_an_oversized_template_is_refused():
    with pytest.raises(TemplateLimitError, match="characters, over the limit"):
        render_chat("x" * (MAX_TEMPLATE_CHARS + 1), MSGS, bos_token="", eos_token="")


def test_a_model_with_a_too_deep_template_loads_and_its_chat_is_one_error_line(tmp_path):
    """The model loads (its completions need no template); a chat through it is one error line."""
    path = write_tiny_llama(tmp_path / "deep.gguf", chat_template="{{ messages" + "|list" * 300 + " }}")
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=4e6)
    assert llm.tool_format.native is False
    with pytest.raises(TemplateLimitError, match="nests too deeply"):
        llm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert llm.generate("ab", SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids
    proc = run("generate", str(path), "hi", "--max-tokens", "2", "--device", "cpu")
    assert_clean_error(proc, "nests too deeply to compile")
