"""Tool calls read out of a model's reply.

A `ToolParser` reads one reply as it is decoded, in pieces of any size, and
returns for each piece the content text that is new and the tool calls (`CallPiece`s) found.
Text that could still be the start of a marker is held back, so a marker never leaks into the
content. A block that does not parse as a call (bad JSON, no name) is given back as content
unchanged: nothing the model wrote is lost. Formats, chosen per template:

- `hermes`: `<tool_call>{json}</tool_call>` blocks anywhere in the reply (also the built-in);
- `mistral`: `[TOOL_CALLS]` then a JSON array of calls, or `name[ARGS]{json}` per call;
- `llama3`: a reply that is a JSON object `{"name": ..., "parameters": {...}}` (or several
  separated by `;`), optionally after `<|python_tag|>`;
- `harmony` (GPT-OSS): messages addressed to `functions.NAME`, read by the reasoning parser.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, ClassVar, Sequence

from minerva.parsers import jsontext
from minerva.parsers.reasoning import partial_marker

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def short_call_id() -> str:
    """Nine letters and digits: the only ids Mistral's templates take back."""
    return uuid.uuid4().hex[:9]


@dataclasses.dataclass(frozen=True)
class CallPiece:
    """Part of the tool call number `index` of a reply: its first piece has the call's `id` and
    `name`, and every piece a run of its `arguments` text (a whole call is one piece)."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def join_pieces(pieces: Sequence[CallPiece]) -> list[ToolCall]:
    """The whole calls that `pieces` (in order) describe."""
    calls: dict[int, list] = {}
    for p in pieces:
        call = calls.setdefault(p.index, [p.id, p.name, ""])
        call[2] += p.arguments
    return [ToolCall(i or new_call_id(), n or "", a) for i, n, a in (calls[k] for k in sorted(calls))]


def call_from_json(value: Any) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call written as `{"name": ..., "arguments"|"parameters": {...}}`;
    None when `value` is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    if "arguments" not in value and "parameters" not in value:  # {"name": "Alice", "age": 30} is no call
        return None
    args = value.get("arguments", value.get("parameters"))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = jsontext.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


# ------------------------------------------------------------------ parsers


class ToolParser:
    """Incremental reader of one reply: `feed(text)` -> (content, calls) new so far; with `end`,
    the rest. With `parallel=False` only the first call is kept."""

    markers: ClassVar[tuple[str, ...]] = ()

    new_id = staticmethod(new_call_id)

    def __init__(self, parallel: bool = True, names: frozenset[str] | None = None) -> None:
        self.parallel = parallel
        self.names = names  # the functions offered: a block calling another is given back as content
        self.calls = 0  # calls given out so far
        self._buffer = ""
        self._runs: list[tuple[list[str], list[CallPiece]]] = []  # content, then the calls after it
        self._space = ""  # trailing whitespace of the content, given out only if more text follows
        self._started = False  # content given out already (a reply's leading whitespace is dropped)

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str, end: bool = False) -> tuple[str, list[CallPiece]]:
        runs = self.feed_runs(text, end)
        return "".join(c for c, _ in runs), [p for _, pieces in runs for p in pieces]

    def feed_runs(self, text: str, end: bool = False) -> list[tuple[str, list[CallPiece]]]:
        """As `feed`, in the reply's order: runs of content each followed by the call pieces
        that came after it (text after a call is the next run's)."""
        self._buffer += text
        self._consume(end)
        if end:
            self._space = ""  # whitespace at the end of a reply says nothing
        runs, self._runs = self._runs, []
        return [("".join(content), pieces) for content, pieces in runs]

    def _consume(self, end: bool) -> None:
        raise NotImplementedError

    # -- for subclasses

    def _text(self, text: str) -> None:
        """Content: leading whitespace of the reply dropped, trailing whitespace held back."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if not self._started:
            body = body.lstrip()
        if body:
            self._add_content(body)
            self._started = True

    def _add_content(self, text: str) -> None:
        if not self._runs or self._runs[-1][1]:  # a call came last: the text after it is a new run
            self._runs.append(([], []))
        self._runs[-1][0].append(text)

    def _add_piece(self, piece: CallPiece) -> None:
        if not self._runs:
            self._runs.append(([], []))
        self._runs[-1][1].append(piece)

    def _offered(self, call: tuple[str, str] | None) -> tuple[str, str] | None:
        """`call` if it calls one of the functions offered."""
        return call if call is not None and (self.names is None or call[0] in self.names) else None

    def _call(self, name: str, arguments: str) -> None:
        if self.calls and not self.parallel:
            return
        self._add_piece(CallPiece(self.calls, arguments, name, self.new_id()))
        self.calls += 1


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, anywhere in the reply."""

    markers = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)

    def __init__(self, parallel: bool = True, names: frozenset[str] | None = None) -> None:
        super().__init__(parallel, names)
        self._inside = False

    def _consume(self, end: bool) -> None:
        while True:
            if not self._inside:
                at = self._buffer.find(TOOL_CALL_OPEN)
                if at < 0:
                    break
                self._text(self._buffer[:at])
                self._buffer, self._inside = self._buffer[at + len(TOOL_CALL_OPEN):], True
            else:
                at = self._buffer.find(TOOL_CALL_CLOSE)
                if at < 0:
                    break
                self._block(self._buffer[:at], closed=True)
                self._buffer, self._inside = self._buffer[at + len(TOOL_CALL_CLOSE):], False
        if self._inside:
            if end:  # a block the reply ended inside: a call if its JSON is whole (the model stopped early)
                self._block(self._buffer, closed=False)
                self._buffer, self._inside = "", False
            return
        keep = 0 if end else partial_marker(self._buffer, self.markers)
        self._text(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]

    def _block(self, body: str, closed: bool) -> None:
        try:
            call = self._offered(call_from_json(jsontext.loads(body)))
        except ValueError:
            call = None
        if call is None:
            self._text(TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else ""))
        else:
            self._call(*call)


class _WholeReplyParser(ToolParser):
    """Calls that, once begun, run to the end of the reply: held from their start marker on,
    parsed at the end (`_parse` -> calls, or None to give the text back as content)."""

    def __init__(self, parallel: bool = True, names: frozenset[str] | None = None) -> None:
        super().__init__(parallel, names)
        self._inside = False
        self._head = ""  # the start of the tail that began the calls

    def _begin(self) -> int | None:
        """Where the calls begin in the buffer, if they do (with `_head` set to the marker)."""
        raise NotImplementedError

    def _parse(self, tail: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError

    def _consume(self, end: bool) -> None:
        if not self._inside:
            at = self._begin()
            if at is not None:
                self._text(self._buffer[:at])
                self._buffer, self._inside = self._buffer[at:], True
        if self._inside:
            if end:
                calls = self._parse(self._buffer[len(self._head):])
                if calls and not all(self._offered(c) for c in calls):
                    calls = None
                if calls:
                    for call in calls:
                        self._call(*call)
                else:
                    self._text(self._buffer)
                self._buffer = ""
            return
        keep = 0 if end else partial_marker(self._buffer, self.markers)
        self._text(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]


class MistralParser(_WholeReplyParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}` per call."""

    markers = (MISTRAL_CALLS,)
    new_id = staticmethod(short_call_id)

    def _begin(self) -> int | None:
        at = self._buffer.find(MISTRAL_CALLS)
        self._head = MISTRAL_CALLS
        return at if at >= 0 else None

    def _parse(self, tail: str) -> list[tuple[str, str]] | None:
        if MISTRAL_ARGS in tail:
            calls = []
            for part in tail.split(MISTRAL_CALLS):
                name, sep, args = part.partition(MISTRAL_ARGS)
                try:
                    call = call_from_json({"name": name.strip(), "arguments": jsontext.loads(args)}) if sep else None
                except ValueError:
                    call = None
                if call is None:
                    return None
                calls.append(call)
            return calls
        try:
            value = jsontext.loads(tail)
        except ValueError:
            return None
        calls = [call_from_json(v) for v in (value if isinstance(value, list) else [value])]
        return calls if calls and all(calls) else None


class Llama3Parser(_WholeReplyParser):
    """A reply that is `{"name": ..., "parameters": {...}}` (several joined by `;`), maybe after
    `<|python_tag|>`; any other reply is content."""

    markers = (PYTHON_TAG,)

    def _begin(self) -> int | None:
        text = self._buffer.lstrip()
        if self._started or self.calls or not text:  # only a reply that starts as a call is one
            return None
        if text.startswith(PYTHON_TAG):
            self._head = PYTHON_TAG
        elif text.startswith("{"):
            self._head = ""
        else:
            return None
        return len(self._buffer) - len(text)

    def _parse(self, tail: str) -> list[tuple[str, str]] | None:
        calls = []
        rest = tail.strip()
        while rest:
            try:
                value, stop = jsontext.raw_decode(rest)
            except ValueError:
                return None
            call = call_from_json(value)
            if call is None:
                return None
            calls.append(call)
            rest = rest[stop:].strip().removeprefix(";").strip()
        return calls or None


class NamedParser(ToolParser):
    """A reply constrained to one function's arguments: all of it is that call's arguments,
    given out as it comes."""

    def __init__(self, name: str, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.name = name

    def _consume(self, end: bool) -> None:
        text, self._buffer = self._buffer, ""
        if not self.calls:
            self._add_piece(CallPiece(0, text, self.name, new_call_id()))
            self.calls = 1
        elif text:
            self._add_piece(CallPiece(0, text))


class RequiredParser(ToolParser):
    """A reply constrained to a JSON array of calls: parsed when it ends (a reply cut short is
    given back as content)."""

    def _consume(self, end: bool) -> None:
        if not end:
            return
        try:
            value = jsontext.loads(self._buffer)
        except ValueError:
            value = None
        if isinstance(value, list):
            calls = [call_from_json(v) for v in value]
            if not (calls and all(calls)):  # the grammar writes none such: another array is content
                self._text(self._buffer)
                calls = []
        else:  # cut short (max_tokens): the array is the grammar's, never content
            calls = _cut_calls(self._buffer)
        for call in calls:
            self._call(*call)
        self._buffer = ""


_CALL_NAME = re.compile(r'\s*,?\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_CALL_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _cut_calls(text: str) -> list[tuple[str, str]]:
    """The calls of a JSON array of calls cut short: the whole ones, then the last one's name
    with the arguments written so far, as a named call cut short gives them (none where not
    even its name was written whole)."""
    calls = []
    i = text.find("[") + 1
    while i > 0:
        name = _CALL_NAME.match(text, i)
        if name is None:
            break
        head = _CALL_ARGUMENTS.match(text, name.end())
        if head is None:
            calls.append((json.loads(name[1]), ""))
            break
        try:
            args, i = jsontext.raw_decode(text, head.end())
        except ValueError:
            calls.append((json.loads(name[1]), text[head.end():]))
            break
        calls.append((json.loads(name[1]), json.dumps(args, ensure_ascii=False)))
        i = text.find("}", i) + 1  # past the call's own brace
    return calls


class HarmonyCallParser(ToolParser):
    """GPT-OSS: a call is a harmony message addressed to `functions.NAME`, which the reply's
    reasoning parser (`parsers.reasoning.HarmonyParser`, fed first) keeps out of the reasoning
    and the answer and collects in its `calls`; the content passes through unchanged."""

    def __init__(self, source, parallel: bool = True, names: frozenset[str] | None = None) -> None:
        super().__init__(parallel, names)
        self.source = source  # the reply's HarmonyParser
        self._taken = 0

    def _consume(self, end: bool) -> None:
        if self._buffer:
            self._add_content(self._buffer)
        self._buffer = ""
        for name, arguments in self.source.calls[self._taken:]:
            if self._offered((name, arguments)):
                self._call(name, arguments)
        self._taken = len(self.source.calls)


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "mistral": MistralParser, "llama3": Llama3Parser,
                                        "harmony": HarmonyCallParser}
