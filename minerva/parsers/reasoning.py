"""Reasoning output: split what a model writes into its reasoning and its answer.

Two formats, chosen per model by `reasoning_for(tokenizer)`:

- **harmony** (GPT-OSS): the reply is a run of messages,
  `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`.
  The `final` channel (or a message with no channel) is the answer; `analysis` and
  `commentary` are reasoning. Commentary that is not addressed to a tool is the model talking
  about what it is doing (a "preamble"), not the answer, so it goes with the reasoning. A
  message addressed to a recipient (` to=functions.x`, ` to=python`) is a tool call, neither
  reasoning nor answer: a call of one of the request's functions (`to=functions.NAME`) is
  kept in the parser's `calls` for the tool-call parser (`parsers.tool_calls`), one to a
  built-in tool (python, browser), which this server does not run, is dropped. So are
  messages of any role other than the assistant's, and text outside a message body (a header
  the output cut short, stray text between messages).
- **think tags** (Qwen3, DeepSeek-R1 and their kin): `<think>reasoning</think>answer`. A
  template may open `<think>` in the prompt itself; then the output starts inside the think
  block and shows only `</think>`. The parser knows this from the prompt it is given (the
  prompt ends with `<think>`), not by guessing from the output, so a streamed reply and a
  whole one are split alike.

A parser is fed the output text as it is decoded, in pieces of any size, and returns for each
piece the (reasoning, content) text that is new; `finish()` flushes the rest. Text that could
still be the start of a marker is held back until a later piece decides it, so a marker cut
over two pieces (`<|chan` + `nel|>`, or `<think>` spelled in several byte tokens) never leaks
into either field, and the joined result is the same however the text was cut. Each block of
text (a message body, a think block, the answer after it) loses its leading and trailing
newlines, as the templates strip them when they render a reply back into a prompt; blocks of
the same field are joined with a blank line.

**Markers through detokenization.** Harmony's markers are special tokens, which decoding
leaves out by default, so the parser would never see them. A chat request of a model whose
markers are special tokens is therefore decoded with special tokens kept
(`SamplingParams.skip_special_tokens=False`; `ReasoningFormat.skip_special_tokens` says which
a model needs). Parsing text rather than token ids keeps one parser for markers that are one
token (harmony's, Qwen3's `<think>`) and markers a vocabulary spells in several tokens, and
lets the parser sit after the stop-string rules, which work on text too. Think tags are
ordinary added tokens in Qwen3's vocabularies, so their text is kept anyway and those models
keep the default decoding: no other special token can leak into their answers.
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

from minerva.formats.tokenizer import Tokenizer
from minerva.parsers import jsontext

REASONING, CONTENT = 0, 1  # the two fields, as indexes into a parser's output
BLOCK_GAP = "\n\n"  # between two blocks of the same field

HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>")
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` one of `markers` starts with (the next piece
    of a streamed reply may finish it, so they are held back)."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class ReasoningParser:
    """Incremental splitter of one reply: `feed(text)` -> (reasoning, content) new so far,
    `finish()` -> the rest. Subclasses name their markers and say what each one does."""

    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._pattern = re.compile("|".join(map(re.escape, self.markers)))
        self._buffer = ""  # text not yet decided: it may start a marker
        self._field: int | None = None  # where body text goes now; None: nowhere (dropped)
        self._fresh = True  # the current block has produced no text yet
        self._held = ""  # trailing newlines of the current block, given out only if text follows
        self._emitted = [False, False]
        self._out = ["", ""]

    def feed(self, text: str, end: bool = False) -> tuple[str, str]:
        """The next piece of the reply; `end`: it is the last one (then `finish` is included)."""
        self._buffer += text
        while (m := self._pattern.search(self._buffer)) is not None:
            self._text(self._buffer[:m.start()])
            self._buffer = self._buffer[m.end():]
            self._marker(m.group())
        if end:
            return self.finish()
        keep = len(self._buffer) - partial_marker(self._buffer, self.markers)
        self._text(self._buffer[:keep])
        self._buffer = self._buffer[keep:]
        return self._take()

    def finish(self) -> tuple[str, str]:
        """The end of the reply: what was held back, as text (a cut-off marker is no marker)."""
        self._text(self._buffer)
        self._buffer = ""
        self._close()
        self._start_block(None)
        return self._take()

    # -- for subclasses ------------------------------------------------------

    def _marker(self, marker: str) -> None:
        raise NotImplementedError

    def _text(self, text: str) -> None:
        """Text between markers: by default part of the current block."""
        self._emit(text)

    def _close(self) -> None:
        """The reply ended: drop whatever state is unfinished."""

    def _start_block(self, field: int | None) -> None:
        """A new block of `field` (None: text to drop) begins; the old one's held newlines go."""
        self._field, self._fresh, self._held = field, True, ""

    # -- the machinery ---------------------------------------------------------

    def _emit(self, text: str) -> None:
        if not text or self._field is None:
            return
        if self._fresh:
            text = text.lstrip("\n")
        text = self._held + text
        body = text.rstrip("\n")
        self._held = text[len(body):]
        if not body:
            return
        if self._fresh and self._emitted[self._field]:
            body = BLOCK_GAP + body
        self._fresh = False
        self._out[self._field] += body
        self._emitted[self._field] = True

    def _take(self) -> tuple[str, str]:
        out, self._out = self._out, ["", ""]
        return out[REASONING], out[CONTENT]


class ThinkParser(ReasoningParser):
    """`<think>reasoning</think>answer`; starts inside the think block when `prompt` opened it."""

    markers = (THINK_OPEN, THINK_CLOSE)

    def __init__(self, prompt: str = "") -> None:
        super().__init__()
        self._start_block(REASONING if prompt.rstrip().endswith(THINK_OPEN) else CONTENT)

    def _marker(self, marker: str) -> None:
        # A second <think> inside the block, or a </think> outside one, is a stray marker: dropped.
        if marker == THINK_OPEN and self._field != REASONING:
            self._start_block(REASONING)
        elif marker == THINK_CLOSE and self._field == REASONING:
            self._start_block(CONTENT)


class HarmonyParser(ReasoningParser):
    """GPT-OSS's harmony messages: `final` is the answer, `analysis` and `commentary` reasoning.

    The state after `prompt` is the state of the prompt's last message: after a generation
    prompt (`...<|start|>assistant`) the reply starts in a message header. Without a prompt it
    starts in a header too.
    """

    markers = HARMONY_MARKERS

    def __init__(self, prompt: str = "") -> None:
        super().__init__()
        self._header: str | None = ""  # the message header being read; None outside a header
        self.calls: list[tuple[str, str]] = []  # (function, arguments text) of each finished call
        self._call: list[str] | None = None  # [function, arguments so far] in a call's body
        start = prompt.rfind("<|start|>")
        if start >= 0:  # read the prompt's open message, keep the state, forget its text (and calls)
            self.feed(prompt[start:])
            self._emitted = [False, False]
            self._take()
            self.calls = []

    def _text(self, text: str) -> None:
        if self._header is not None:
            self._header += text
        elif self._call is not None:
            self._call[1] += text
        else:
            self._emit(text)

    def _end_call(self, whole: bool = True) -> None:
        """The call being read is over; kept when it ended, or when its arguments are whole JSON."""
        call, self._call = self._call, None
        if call is not None and (whole or _is_json(call[1])):
            self.calls.append((call[0], call[1].strip()))

    def _marker(self, marker: str) -> None:
        if marker != "<|message|>":
            self._end_call()
        if marker == "<|start|>":
            self._start_block(None)
            self._header = ""
        elif marker == "<|channel|>":
            if self._header is None:  # a header without <|start|>: the model skipped it
                self._start_block(None)
                self._header = ""
            self._header += marker
        elif marker == "<|constrain|>":
            if self._header is not None:
                self._header += marker
        elif marker == "<|message|>":
            header, self._header = self._header or "", None
            function = recipient(header)
            self._start_block(None if function is not None else route(header))
            if function is not None:
                self._call = [function, ""]
        else:  # <|end|>, <|return|>, <|call|>: the message is over
            self._header = None
            self._start_block(None)

    def _close(self) -> None:
        self._header = None  # a header the output cut short says nothing
        self._end_call(whole=False)


def _is_json(text: str) -> bool:
    try:
        jsontext.loads(text)
    except ValueError:
        return False
    return True


def recipient(header: str) -> str | None:
    """The function a harmony message calls (`to=functions.NAME`, in its role or its channel
    part); None for any other message."""
    for word in header.replace("<|channel|>", " ").replace("<|constrain|>", " ").split():
        if word.startswith("to=functions."):
            return word[len("to=functions."):] or None
    return None


def route(header: str) -> int | None:
    """The field a harmony message's body goes to, from its header
    (`assistant<|channel|>analysis`, `<|channel|>commentary to=functions.f <|constrain|>json`)."""
    role, _, channel = header.partition("<|channel|>")
    words = header.replace("<|channel|>", " ").replace("<|constrain|>", " ").split()
    if any(w.startswith("to=") for w in words):
        return None  # a tool call: not reasoning, nor answer
    if role.split()[:1] not in ([], ["assistant"]):
        return None  # another role's message: not part of the reply
    name = channel.partition("<|constrain|>")[0].split()[:1]
    return CONTENT if name in ([], ["final"]) else REASONING


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    """How a model writes its reasoning: the parser to split it, and whether decoding must keep
    special tokens for the parser to see the markers."""

    name: str
    parser_class: type[ReasoningParser]
    skip_special_tokens: bool = True

    @property
    def markers(self) -> tuple[str, ...]:
        return self.parser_class.markers

    def parser(self, prompt: str = "") -> ReasoningParser:
        """A parser for one reply to `prompt` (the rendered chat prompt, which may open a block)."""
        return self.parser_class(prompt)


HARMONY = ReasoningFormat("harmony", HarmonyParser)
THINK = ReasoningFormat("think", ThinkParser)

# For a model whose chat template does not tell: by GGUF `general.architecture` / HF `model_type`.
ARCHITECTURES: dict[str, ReasoningFormat] = {
    "gpt-oss": HARMONY, "gpt_oss": HARMONY,
    "qwen3": THINK, "qwen3moe": THINK, "qwen3_moe": THINK,
}


def format_for(architecture: str | None, template: str | None) -> ReasoningFormat | None:
    """The reasoning format of a model: what its chat template writes (harmony's channels, or
    think tags), else what its architecture uses; None for a model that writes no reasoning."""
    if template:
        if "<|channel|>" in template and "<|message|>" in template:
            return HARMONY
        if THINK_OPEN in template or THINK_CLOSE in template:
            return THINK
    return ARCHITECTURES.get((architecture or "").lower())


def reasoning_for(tokenizer: Tokenizer) -> ReasoningFormat | None:
    """The reasoning format of the model `tokenizer` belongs to, with the decoding it needs:
    special tokens kept when any of its markers is a special token of the vocabulary."""
    fmt = format_for(tokenizer.architecture, tokenizer.resolved_chat_template)
    if fmt is None:
        return None
    ids = [tokenizer.token_to_id(m) for m in fmt.markers]
    special = any(tokenizer.is_special(i) for i in ids if i is not None)
    return dataclasses.replace(fmt, skip_special_tokens=not special)


def split_text(fmt: ReasoningFormat | None, prompt: str, text: str) -> tuple[str | None, str]:
    """A whole reply to `prompt` as (reasoning, or None when there is none; content); unchanged
    without a format."""
    if fmt is None:
        return None, text
    reasoning, content = fmt.parser(prompt).feed(text, end=True)
    return reasoning or None, content
