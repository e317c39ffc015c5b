"""A conversation cut from its start until it fits the context (the Responses API's
`truncation: "auto"`).

System and developer messages always stay. What goes first is whole turns (a user message and
everything after it up to the next one), oldest first, so the rest still starts with a user
message, as templates that want the roles to alternate require; then, inside the last turn,
the oldest steps after its user message (an assistant message with the tool results that
follow it), the latest step kept. Among those cuts, from the smallest up, the smallest one
that fits is found from the largest cut down (`fitting`): a few renderings of about what the
context holds, however long the conversation.
"""

from __future__ import annotations

from collections import abc
from typing import Awaitable, Callable, Sequence, TypeVar

from minerva.serve.convert import ContextError

T = TypeVar("T")
KEPT = ("system", "developer")


class Cuts(abc.Sequence):
    """The indices each cut of a conversation with these `roles` keeps, from the smallest cut to
    the largest (the uncut list not among them); each list made when asked for."""

    def __init__(self, roles: Sequence[str]):
        self.kept = [i for i, r in enumerate(roles) if r in KEPT]
        self.rest = [i for i, r in enumerate(roles) if r not in KEPT]
        users = [k for k, i in enumerate(self.rest) if roles[i] == "user"]
        self.options: list[tuple[bool, int]] = []  # (the last user message kept apart, where the rest resumes)
        if users:
            self.last = users[-1]
            self.options = [(False, k) for k in users if k > 0]  # every item before a later turn's user message
            steps = [k for k in range(self.last + 1, len(self.rest)) if roles[self.rest[k]] == "assistant"]
            self.options += [(True, k) for k in steps[1:]]  # then the last turn's oldest steps

    def __len__(self) -> int:
        return len(self.options)

    def __getitem__(self, i):
        apart, k = self.options[i]
        return sorted(self.kept + ([self.rest[self.last]] if apart else []) + self.rest[k:])


async def fitting(items: Sequence, roles: Sequence[str], attempt: Callable[[list], Awaitable[T]]) -> T:
    """`attempt(items)`, or where it raises ContextError, `attempt` of the smallest cut of
    `items` that does not; where even the largest cut does not fit, its ContextError (what is
    left, not the whole conversation, is what the client must change).

    The cuts are tried from the largest (the least kept) down, keeping twice as much each try
    until one does not fit, then bisected between the last two: each try renders about what a
    context holds, however long the conversation before it (a bisection over all the cuts
    renders half a long conversation at each of its tries)."""
    try:
        return await attempt(list(items))
    except ContextError:
        options = Cuts(roles)
        if not options:
            raise
        try:
            best = await attempt([items[i] for i in options[-1]])
        except ContextError as alone:
            raise ContextError(f"even cut as far as truncation \"auto\" cuts (the system instructions, the "
                               f"latest user turn and its last step kept), the conversation does not fit: "
                               f"{alone.message}", alone.param) from None
        hi, step = len(options) - 1, 1  # options[hi] fits; best is its answer
        lo = 0  # options[lo - 1] (the whole conversation, for lo 0) does not fit
        while hi > lo:
            mid = max(lo, hi - step)
            try:
                answer = await attempt([items[i] for i in options[mid]])
            except ContextError:
                lo = mid + 1
                break
            hi, best, step = mid, answer, step * 2
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                answer = await attempt([items[i] for i in options[mid]])
            except ContextError:
                lo = mid + 1
            else:
                hi, best = mid, answer
        return best
