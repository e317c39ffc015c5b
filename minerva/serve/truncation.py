"""A conversation cut from its start until it fits the context (the Responses API's
`truncation: "auto"`).

System and developer messages always stay. What goes first is whole turns (a user message and
everything after it up to the next one), oldest first, so the rest still starts with a user
message, as templates that want the roles to alternate require; then, inside the last turn,
the oldest steps after its user message (an assistant message with the tool results that
follow it), the latest step kept. Among those cuts, from the smallest up, the smallest one
that fits is found by bisection: a few renderings, however long the conversation.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Sequence, TypeVar

from minerva.serve.convert import ContextError

T = TypeVar("T")
KEPT = ("system", "developer")


def cuts(roles: Sequence[str]) -> list[list[int]]:
    """The indices each cut keeps, from the smallest cut to the largest (the uncut list not
    among them)."""
    kept = [i for i, r in enumerate(roles) if r in KEPT]
    rest = [i for i, r in enumerate(roles) if r not in KEPT]
    users = [k for k, i in enumerate(rest) if roles[i] == "user"]
    if not users:
        return []
    last = users[-1]
    starts = [k for k in users if k > 0]  # drop every item before each later turn's user message
    steps = [k for k in range(last + 1, len(rest)) if roles[rest[k]] == "assistant"]
    out = [sorted(kept + rest[k:]) for k in starts]
    out += [sorted(kept + [rest[last]] + rest[k:]) for k in steps[1:]]  # the last turn's oldest steps
    return out


async def fitting(items: Sequence, roles: Sequence[str], attempt: Callable[[list], Awaitable[T]]) -> T:
    """`attempt(items)`, or where it raises ContextError, `attempt` of the smallest cut of
    `items` that does not; the first ContextError where even the largest cut does not fit."""
    try:
        return await attempt(list(items))
    except ContextError as first:
        options = cuts(roles)
        if not options:
            raise
        try:
            best = await attempt([items[i] for i in options[-1]])
        except ContextError:
            raise first from None
        lo, hi = 0, len(options) - 1  # options[hi] fits
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                answer = await attempt([items[i] for i in options[mid]])
            except ContextError:
                lo = mid + 1
            else:
                hi, best = mid, answer  # best is always options[hi]'s
        return best
