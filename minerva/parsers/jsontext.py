"""JSON text read with a bound on its nesting.

Python's reader and writer recurse once per level: text nested about a thousand levels deep
raises RecursionError in `json.loads`, and text a few hundred levels deep parses, then breaks
whatever walks it next (a `json.dumps`, a template's variables). A request or a model's
output can hold such text in a few kilobytes, so the parsers read JSON through these, which
take text nested deeper than `MOST_DEPTH` for no JSON at all (a ValueError, as any other text
that is not JSON).
"""

from __future__ import annotations

import json
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
    """json.loads, a ValueError for text nested too deeply."""
    if too_deep(text):
        raise ValueError(f"JSON nested more than {MOST_DEPTH} levels deep")
    return json.loads(text)


def raw_decode(text: str, start: int = 0) -> tuple[Any, int]:
    """json.JSONDecoder().raw_decode, a ValueError for text nested too deeply."""
    if too_deep(text, start):
        raise ValueError(f"JSON nested more than {MOST_DEPTH} levels deep")
    return _DECODER.raw_decode(text, start)


_DECODER = json.JSONDecoder()
