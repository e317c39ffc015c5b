"""The hooks that keep an untrusted chat template within its budget (`chat_budget`).

Jinja's sandbox stops a template from reaching Python internals, but not from
looping for hours (`range(100000)` nested twice) or doubling a string until
memory runs out. `LimitedSandbox` closes that gap with hooks in the compiled
template, all reporting to the budget of the render in progress:

- every `for` loop (and every recursive `loop(...)` call) iterates through a
  counter, which also checks the clock, so even a loop with an empty body stops;
- every operator that can grow a value (`+ * % **`, `~`, slicing), every call
  and every filter checks the clock, and checks the size of what it is about
  to build *before* building it where that size can be known (`'x' * 10**9`,
  `join`, `replace`, `center`, `format`, ...), and after building otherwise;
- every piece of output is counted, so the rendered text stays bounded.
"""

from __future__ import annotations

import re
import string
from collections.abc import Collection, Iterator, Mapping
from typing import Any, Callable

import jinja2
import jinja2.nodes as nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import LoopContext, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from markupsafe import escape

from minerva.formats.chat_budget import ITEM_CHARS, Budget, current_budget


class _Counted:
    """An iterable that counts each item it hands out against the budget."""

    __slots__ = ("_iterable", "_iterator", "_budget")

    def __init__(self, iterable: Any, budget: Budget) -> None:
        self._iterable, self._iterator, self._budget = iterable, iter(iterable), budget

    def __len__(self) -> int:  # keeps `loop.length` from reading everything ahead
        return len(self._iterable)

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        item = next(self._iterator)
        self._budget.iterate()
        return item


def _num(digits: str) -> int:
    return int(digits) if len(digits) <= 12 else 10 ** 12


_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?")


def _printf_size(b: Budget, fmt: str, args: Any) -> int:
    """How long `fmt % args` can be: every width and precision, plus every argument
    (each one, for a mapping, as often as there are fields)."""
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    sizes = [b.length(v) for v in values]
    widest = max((abs(v) for v in values if isinstance(v, int)), default=0)
    total, fields = len(fmt), 0
    for m in _PRINTF_SPEC.finditer(fmt):
        fields += 1
        total += sum(widest if n == "*" else _num(n) for n in m.groups() if n)
    if isinstance(args, Mapping):  # `%(name)s` may name one value many times; `%s` prints all of them
        return total + max(fields * max(sizes, default=0), sum(sizes))
    return total + sum(sizes)


def _format_size(b: Budget, fmt: str, args: tuple, kwargs: Mapping) -> int:
    """How long `fmt.format(*args, **kwargs)` can be: every field at most the largest
    argument, plus its width and precision (a nested `{}` width: the largest number)."""
    values = [*args, *kwargs.values()]
    largest = max((b.length(v) for v in values), default=0)
    widest = max((abs(v) for v in values if isinstance(v, int)), default=0)
    total = 0
    for literal, field, spec, _ in string.Formatter().parse(fmt):
        total += len(literal)
        if field is not None:
            spec = spec or ""
            total += largest + sum(_num(n) for n in re.findall(r"\d+", spec)) + (widest if "{" in spec else 0)
    return total


def _formatted_size(b: Budget, value: Any, *args: Any, **kwargs: Any) -> int:
    """The `format` filter: `str(value) % (kwargs or args)`."""
    b.check_chars(b.length(value))
    return _printf_size(b, str(value), kwargs or args)


def _replaced_size(b: Budget, s: Any, old: Any, new: Any, count: Any = None) -> int:
    n = b.length(s)
    found = n + 1 if not isinstance(s, str) or not isinstance(old, str) else s.count(old) if old else n + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return n + found * max(b.length(new) - (len(old) if isinstance(old, str) else 0), 0)


def _joined_size(b: Budget, items: Any, sep: Any = "") -> int:
    return sum(b.length(x) for x in items) + b.length(sep) * len(items) if isinstance(items, Collection) else 0


_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines splits on


def _indented_size(b: Budget, s: Any, width: Any = 4, *_: Any, **__: Any) -> int:
    indent = len(width) if isinstance(width, str) else max(width, 0) if isinstance(width, int) else 0
    lines = 1 + (sum(s.count(c) for c in _LINE_BREAKS) if isinstance(s, str) else b.length(s))
    return b.length(s) + lines * indent


def _json_size(b: Budget, x: Any, ensure_ascii: Any = False, indent: Any = None, separators: Any = None,
               sort_keys: Any = False) -> int:
    indent = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    sep = sum(len(s) for s in separators if isinstance(s, str)) if isinstance(separators, (list, tuple)) else 2
    return b.text_size(x, per_item=sep + (1 if indent else 0), per_depth=max(indent, 0))


def _urlized_size(b: Budget, s: Any, trim_url_limit: Any = None, nofollow: Any = False, target: Any = None,
                  rel: Any = None, extra_schemes: Any = None) -> int:
    # Every link (each holds a '.', ':' or '@') is written twice, with the target and rel attributes.
    n = b.length(s)
    links = sum(s.count(c) for c in ".:@") if isinstance(s, str) else n
    return 2 * n + (links + 1) * (80 + b.length(target or "") + b.length(rel or ""))


def _summed_size(b: Budget, items: Any, attribute: Any = None, start: Any = 0) -> int:
    # Adding up lists copies the running total each time: n lists cost n times their total.
    if not isinstance(start, (list, tuple)) or not isinstance(items, Collection):
        return 0
    return len(items) * (len(start) + b.text_size(items))


# Filters whose result can be much larger than their input, each with what to check
# before it runs (characters of text or items of a list) and how to estimate it from
# the filter's own arguments (same names and defaults as the filter).
_CHARS, _ITEMS = "chars", "items"
_GROWING_FILTERS: dict[str, tuple[str, Callable[..., int]]] = {
    "center": (_CHARS, lambda b, v, width=80: max(b.length(v), width if isinstance(width, int) else 0)),
    "indent": (_CHARS, _indented_size),
    "replace": (_CHARS, _replaced_size),
    "join": (_CHARS, lambda b, value, d="", attribute=None: _joined_size(b, value, d)),
    "format": (_CHARS, _formatted_size),
    "tojson": (_CHARS, _json_size),
    "pprint": (_CHARS, lambda b, v: b.text_size(v, per_item=1, per_depth=1)),
    "wordwrap": (_CHARS, lambda b, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True:
                 b.length(s) * (1 + (len(wrapstring) if isinstance(wrapstring, str) else 1))),
    # markupsafe removes each tag by copying the rest of the text: tags times length
    "striptags": (_CHARS, lambda b, s: b.length(s) * (1 + (s.count("<") if isinstance(s, str) else b.length(s)))),
    "urlize": (_CHARS, _urlized_size),
    "batch": (_ITEMS, lambda b, v, linecount, fill_with=None: linecount if fill_with is not None else 0),
    "slice": (_ITEMS, lambda b, v, slices, fill_with=None: slices * ITEM_CHARS if isinstance(slices, int) else 0),
    "sum": (_ITEMS, _summed_size),
}
# Filters that turn a value into text: a check of how long that text would be.
_TEXT_FILTERS = {"string", "safe", "e", "escape", "forceescape", "trim", "upper", "lower", "title", "capitalize",
                 "truncate", "wordcount", "urlencode", "xmlattr"}


def _translated_size(b: Budget, s: str, table: Any) -> int:
    values = table.values() if isinstance(table, Mapping) else table if isinstance(table, Collection) else ()
    return len(s) * max((len(v) for v in values if isinstance(v, str)), default=1)


def _split_items(b: Budget, s: str, sep: Any = None, maxsplit: int = -1) -> int:
    found = s.count(sep) if isinstance(sep, str) and sep else len(s) // 2
    return 1 + (min(found, maxsplit) if maxsplit >= 0 else found)


# str methods whose result can be much larger than the string.
_GROWING_STR_METHODS: dict[str, tuple[str, Callable[..., int]]] = {
    "center": (_CHARS, lambda b, s, width, *_: width),
    "ljust": (_CHARS, lambda b, s, width, *_: width),
    "rjust": (_CHARS, lambda b, s, width, *_: width),
    "zfill": (_CHARS, lambda b, s, width: width),
    "expandtabs": (_CHARS, lambda b, s, tabsize=8: len(s) + s.count("\t") * tabsize),
    "replace": (_CHARS, _replaced_size),
    "join": (_CHARS, lambda b, sep, items: _joined_size(b, items, sep)),
    "translate": (_CHARS, _translated_size),
    "split": (_ITEMS, _split_items),
    "rsplit": (_ITEMS, _split_items),
    "splitlines": (_ITEMS, lambda b, s, keepends=False: 1 + sum(s.count(c) for c in _LINE_BREAKS)),
}


def _check(b: Budget, kind: str, estimate: Callable[..., int], *args: Any, **kwargs: Any) -> None:
    try:
        n = estimate(b, *args, **kwargs)
    except (TypeError, ValueError, AttributeError):
        return  # arguments the real call will refuse with its own error
    (b.check_chars if kind == _CHARS else b.check_items)(n)


def _materialized(value: Any) -> Any:
    """A list in place of a one-shot iterator, so it can be measured and still be used."""
    return list(value) if isinstance(value, Iterator) else value


_PASS_ARGS: dict[str | None, Callable[[Any], tuple]] = {
    None: lambda context: (),
    "context": lambda context: (context,),
    "eval_context": lambda context: (context.eval_ctx,),
    "environment": lambda context: (context.environment,),
}


def limited_filter(name: str, func: Callable) -> Callable:
    """`func` as a filter that checks the budget. It takes the context, which also keeps
    Jinja from running it at compile time, outside any budget."""
    lead = _PASS_ARGS[getattr(getattr(func, "jinja_pass_arg", None), "name", None)]
    kind, estimate = _GROWING_FILTERS.get(name, (_CHARS, None))
    as_text = estimate is None and name in _TEXT_FILTERS  # a string is as long as its text: nothing to check
    if as_text:
        estimate = lambda b, v, *_, **__: b.length(v)  # noqa: E731
    materialize = name in ("join", "sum")

    @jinja2.pass_context
    def checked(context: Any, value: Any, /, *args: Any, **kwargs: Any) -> Any:
        b = current_budget()
        b.tick()
        if estimate is not None and not (as_text and type(value) is str):
            value = _materialized(value) if materialize else value
            _check(b, kind, estimate, value, *args, **kwargs)
        return b.built(func(*lead(context), value, *args, **kwargs))

    checked.__name__ = checked.__qualname__ = f"limited_{name}"
    return checked


def _growing_str_method(obj: Any) -> tuple[str, Callable[..., int]] | None:
    return _GROWING_STR_METHODS.get(obj.__name__) if isinstance(getattr(obj, "__self__", None), (str, bytes)) else None


def _binop_check(b: Budget, op: str, left: Any, right: Any) -> None:
    """Refuse `left op right` before computing it if its result would be too large."""
    if isinstance(left, int) and isinstance(right, int):
        if op == "*":
            b.check_bits(left.bit_length() + right.bit_length())
        elif op == "**" and right > 0:
            b.check_bits(left.bit_length() * right)
    elif op == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, bytes)) and isinstance(n, int):
            b.check_chars(len(seq) * n)
        elif isinstance(seq, (list, tuple)) and isinstance(n, int):
            b.check_items(len(seq) * n)
    elif op == "%" and isinstance(left, (str, bytes)):
        _check(b, _CHARS, _printf_size, left.decode("latin-1") if isinstance(left, bytes) else left, right)


class LimitedCodeGenerator(CodeGenerator):
    """Jinja's code generator with the hooks of `LimitedSandbox` written into the template."""

    _loop_iterables: set[int] = set()  # ids of the nodes `for` loops iterate over, found first

    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        self._loop_iterables = {id(loop.iter) for loop in node.find_all(nodes.For)}
        super().visit_Template(node, frame)

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if id(node) not in self._loop_iterables:
            return super().visit(node, *args, **kwargs)
        self.write("environment.limited_iter(")  # what a `for` loop iterates over
        super().visit(node, *args, **kwargs)
        self.write(")")

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:  # `a ~ b`
        self.write("environment.limited_concat(context.eval_ctx, (")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")

    def visit_Getitem(self, node: nodes.Getitem, frame: Any) -> None:
        if not isinstance(node.arg, nodes.Slice):  # a slice copies; an item does not
            super().visit_Getitem(node, frame)
            return
        self.write("environment.limited_value(")
        super().visit_Getitem(node, frame)
        self.write(")")

    # Jinja 3's hooks around each piece of output (this sandbox has no `finalize`).
    def _output_child_pre(self, node: nodes.Expr, frame: Any, finalize: Any) -> None:
        self.write("environment.limited_output(context.eval_ctx, ")

    def _output_child_post(self, node: nodes.Expr, frame: Any, finalize: Any) -> None:
        self.write(")")

    def _output_const_repr(self, group: Any) -> str:
        return f"environment.limited_text({super()._output_const_repr(group)})"


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every loop, call, growing operator and output checked
    against the budget of the render in progress (see `limited()`). Its filters are
    expected to be wrapped with `limited_filter`."""

    code_generator_class = LimitedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = current_budget()
        b.tick()
        if operator != "+":  # `+` at most doubles what exists: the check after is enough
            _binop_check(b, operator, left, right)
        return b.built(self.binop_table[operator](left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - as jinja2's
        b = current_budget()
        b.tick()
        if isinstance(__obj, LoopContext) and args:  # `loop(children)` in a recursive loop
            args = (_Counted(args[0], b), *args[1:])
        growing = _growing_str_method(__obj)
        if growing is not None:
            args = tuple(_materialized(a) for a in args)
            owner = __obj.__self__  # estimated as text, bytes too
            _check(b, *growing, owner.decode("latin-1") if isinstance(owner, bytes) else owner, *args, **kwargs)
        return b.built(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt, by_map = value.__self__, value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            b = current_budget()
            b.tick()
            mapping = args[0] if by_map and args and isinstance(args[0], Mapping) else kwargs
            _check(b, _CHARS, _format_size, fmt, () if by_map else args, mapping)
            return b.built(wrapped(*args, **kwargs))

        return checked

    def limited_iter(self, iterable: Any) -> _Counted:
        return _Counted(iterable, current_budget())

    def limited_concat(self, eval_ctx: Any, parts: tuple) -> str:
        b = current_budget()
        b.tick()
        b.check_chars(sum(b.length(p) for p in parts))
        return b.built(markup_join(parts) if eval_ctx.autoescape else str_join(parts))

    def limited_value(self, value: Any) -> Any:
        return current_budget().built(value)

    def limited_output(self, eval_ctx: Any, value: Any) -> str:
        b = current_budget()
        if not isinstance(value, str):
            b.check_chars(b.text_size(value))
        return b.emitted(escape(value) if eval_ctx.autoescape else str(value))

    def limited_text(self, text: str) -> str:
        return current_budget().emitted(text)
