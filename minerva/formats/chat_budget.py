"""What one render of a chat template may spend, and what it has spent.

`TemplateLimits` says how much time, how many loop iterations and how many
characters a render may use; `Budget` keeps the count for the render in
progress and raises `TemplateLimitError` the moment one runs out. The budget
lives in a context variable set by `limited()`, so renders on different threads
(the server may render through `asyncio.to_thread`) each count their own.
`chat_limits` holds the hooks in the compiled template that report here.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import chain
from typing import Any

from jinja2.utils import Namespace

from minerva.errors import MinervaError

ITEM_CHARS = 8  # a list item costs about as much memory as 8 characters of text
MAX_INT_BITS = 1 << 16  # arithmetic a chat template has a use for stays far below this


class TemplateLimitError(MinervaError):
    """A chat template ran past its time, loop or size budget."""


@dataclass(frozen=True)
class TemplateLimits:
    """What one render of a chat template may spend.

    `max_chars` bounds the rendered text and any one string the template builds
    (a list: `max_chars // ITEM_CHARS` items); `max_built_chars` bounds all the
    strings and lists it builds together, so it cannot fill memory with many
    values that are each within `max_chars`.
    """

    time_s: float = 2.0
    max_iterations: int = 2_000_000
    max_chars: int = 8_000_000
    max_built_chars: int = 128_000_000

    def __post_init__(self) -> None:
        for name in ("time_s", "max_iterations", "max_chars", "max_built_chars"):
            if not getattr(self, name) > 0:
                raise MinervaError(f"chat template limit {name} must be positive, got {getattr(self, name)!r}")


DEFAULT_LIMITS = TemplateLimits()


class Budget:
    """What one render has spent so far; every check raises `TemplateLimitError`."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.max_chars, self.max_items = limits.max_chars, limits.max_chars // ITEM_CHARS
        self.deadline = time.monotonic() + limits.time_s
        self.iterations = 0
        self.output = 0
        self.built_total = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"chat template exceeded its time budget of {self.limits.time_s} s")

    def iterate(self) -> None:
        self.iterations += 1
        if self.iterations > self.limits.max_iterations:
            raise TemplateLimitError(f"chat template ran more than {self.limits.max_iterations} loop iterations")
        self.tick()

    def check_chars(self, n: int) -> None:
        if n > self.max_chars:
            raise TemplateLimitError(f"chat template built a value of more than {self.max_chars} characters")

    def check_items(self, n: int) -> None:
        if n > self.max_items:
            raise TemplateLimitError(f"chat template built a list of more than {self.max_items} items")

    def check_bits(self, n: int) -> None:
        if n > MAX_INT_BITS:
            raise TemplateLimitError(f"chat template built a number of more than {MAX_INT_BITS} bits")

    def built(self, value: Any) -> Any:
        """Count a value just built against the per-value and total budgets; return it."""
        if isinstance(value, (str, bytes)):
            cost = len(value)
            if cost > self.max_chars:
                self.check_chars(cost)
        elif isinstance(value, (list, tuple, dict)):
            self.check_items(len(value))
            cost = len(value) * ITEM_CHARS
        else:
            return value
        self.built_total += cost
        if self.built_total > self.limits.max_built_chars:
            raise TemplateLimitError(
                f"chat template built more than {self.limits.max_built_chars} characters in all")
        return value

    def emitted(self, text: str) -> str:
        self.output += len(text)
        if self.output > self.max_chars:
            raise TemplateLimitError(f"chat template rendered more than {self.max_chars} characters")
        return text

    def length(self, value: Any) -> int:
        """len(str(value)), or an estimate of it for a non-string, without building it."""
        return len(value) if isinstance(value, str) else self.text_size(value)

    def text_size(self, value: Any, per_item: int = 0, per_depth: int = 0) -> int:
        """About how long str(value) (or its JSON) would be, without building it: the
        lengths of its strings, plus 2 + `per_item` + `per_depth` * depth for every item.
        A list can hold another many times over (`[l, l]` built in a loop) and print as
        gigabytes: the size of a list met again at the same depth is remembered, not
        walked again, and the walk stops once past the limit, checking the clock as it goes."""
        limit, total, steps = self.max_chars, 0, 0
        known: dict[tuple[int, int], int] = {}  # (id, depth) of a container walked -> its size
        stack: list[list] = [[None, iter((value,)), 0, 0]]  # [key, items, depth, size so far]
        while stack:
            frame = stack[-1]
            item = next(frame[1], stack)  # the stack itself marks the end
            if item is stack:
                stack.pop()
                if stack:
                    known[frame[0]] = frame[3]
                    stack[-1][3] += frame[3]
                continue
            depth = frame[2] + 1
            cost, items = 2 + per_item + per_depth * frame[2], _items(item)
            if items is None:
                cost += len(item) if isinstance(item, str) else item.bit_length() // 3 if isinstance(item, int) else 30
            elif (id(item), depth) in known:
                cost += known[id(item), depth]
            else:
                stack.append([(id(item), depth), items, depth, 0])
            frame[3] += cost
            total += cost
            steps += 1
            if total > limit:
                return total
            if not steps & 4095:
                self.tick()
        return total


def _items(value: Any) -> Iterator | None:
    """What str(value) prints of a container's contents; None for anything else."""
    if isinstance(value, str):
        return None
    if isinstance(value, Mapping):
        return chain.from_iterable(value.items())
    if isinstance(value, Namespace):
        return chain.from_iterable(object.__getattribute__(value, "_Namespace__attrs").items())
    if isinstance(value, Collection):
        return iter(value)
    return None  # a number, None, an undefined value, a macro: a short repr


_BUDGET: ContextVar[Budget] = ContextVar("minerva_template_budget")


def current_budget() -> Budget:
    try:
        return _BUDGET.get()
    except LookupError:
        raise RuntimeError("a limited chat template was rendered outside limited()") from None


@contextmanager
def limited(limits: TemplateLimits = DEFAULT_LIMITS) -> Iterator[None]:
    """Render chat templates of a `LimitedSandbox` inside this block, under `limits`."""
    token = _BUDGET.set(Budget(limits))
    try:
        yield
    finally:
        _BUDGET.reset(token)


