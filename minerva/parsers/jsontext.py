"""JSON text read with a bound on its nesting.

Python's reader and writer recurse once per level: text nested about a thousand levels deep
raises RecursionError in `json.loads`, and text a few hundred levels deep parses, then breaks
whatever walks it next (a `json.dumps`, a template's variables). A request or a model's
output can hold such text in a few kilobytes, so the parsers read JSON through these, which
take text nested deeper than `MOST_DEPTH` for no JSON at all (a ValueError, as any other text
that is not JSON).

They read strict JSON, as the clients that get it back do (JavaScript's `JSON.parse`, the
SDKs): Python's reader also takes NaN, Infinity and -Infinity, reads 1e999 as an infinite
float, and turns an escaped lone surrogate ("\\ud800") into a string no UTF-8 can carry, each
of which would come back out as text a client cannot read (or a response that cannot be
written at all); here each is a ValueError.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MOST_DEPTH = 64  # arrays and objects inside each other; a real tool call's arguments nest a few
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')  # strings (skipped whole) and brackets


def too_deep(text: str, start: int = 0) -> bool:
    """Whether JSON text (from `start`) nests arrays and objects more than MOST_DEPTH deep."""
    if text.count("[", start) + text.count("{", start) <= MOST_DEPTH:
        return False
    depth = 0
    for m in _TOKENS.finditer(text, start):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > MOST_DEPTH:
                return True
        elif c in "]}":
            depth -= 1
    return False


def loads(text: str) -> Any:
    """json.loads of strict JSON, a ValueError for text nested too deeply."""
    if too_deep(text):
        raise ValueError(f"JSON nested more than {MOST_DEPTH} levels deep")
    return _strings_are_text(_DECODER.decode(text), text)


def raw_decode(text: str, start: int = 0) -> tuple[Any, int]:
    """json.JSONDecoder().raw_decode of strict JSON, a ValueError for text nested too deeply."""
    if too_deep(text, start):
        raise ValueError(f"JSON nested more than {MOST_DEPTH} levels deep")
    value, end = _DECODER.raw_decode(text, start)
    return _strings_are_text(value, text[start:end]), end


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of JSON's range")
    return value


def _strings_are_text(value: Any, text: str) -> Any:
    """`value`, read from `text`, a ValueError where a string in it holds a lone surrogate
    (only an escape of one, \\ud800 to \\udfff, makes one: then the strings are checked)."""
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone surrogate (an escape such as \\ud800 alone)") from None
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_finite)
