"""`minerva chat`: an interactive conversation with a loaded model, as Ollama's `run` keeps
it: line editing and history, messages of several lines, Ctrl-C stopping a reply, and the
commands /help, /reset, /set parameter, /show and /bye. Also the reply writer the one-shot
`generate` streams with."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import re
import sys

from minerva.engine.sampler import SamplingParams
from minerva.errors import MinervaError
from minerva.parsers.reasoning import ReasoningParser
from minerva.store import store_root

# /set parameter NAME: the SamplingParams field it sets and how its value is read (Ollama's
# names, and ours where they differ)
PARAMETERS = {
    "temperature": ("temperature", float), "top_k": ("top_k", int), "top_p": ("top_p", float),
    "min_p": ("min_p", float), "repeat_penalty": ("repetition_penalty", float),
    "repetition_penalty": ("repetition_penalty", float), "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float), "seed": ("seed", int), "num_predict": ("max_tokens", int),
    "max_tokens": ("max_tokens", int), "stop": ("stop", str),
}
# a reply's tokens when -n is not given: as many as the context leaves (the engine caps each
# request at its context)
UNCAPPED = 1 << 30

CHAT_HELP = "\n".join([
    "commands:",
    "  /help          this help",
    "  /reset         forget the conversation (also /clear)",
    "  /set parameter NAME VALUE",
    "                 change a sampling parameter: " + ", ".join(sorted(PARAMETERS)),
    "  /show          the model and the parameters in force (/show info, /show parameters)",
    "  /bye           leave (also /exit, /quit, Ctrl-D)",
    '  """            start and end a message of several lines',
    "Ctrl-C stops a reply; at the prompt it clears the line.",
])
DIM, UNDIM = "\x1b[2m", "\x1b[0m"  # ANSI: faint text, and back to normal


def _color() -> bool:
    """Whether to style the output: on a terminal, unless NO_COLOR is set; anywhere with FORCE_COLOR."""
    if os.environ.get("NO_COLOR"):
        return False
    return bool(os.environ.get("FORCE_COLOR")) or sys.stdout.isatty()


class ReplyWriter:
    """Writes a reply as it streams. A reasoning model's reasoning comes first, dimmed on a
    terminal; elsewhere it goes to stderr, so that stdout carries only answers. The answer
    follows as it is; `answer` collects it."""

    def __init__(self, parser: ReasoningParser | None):
        self.parser, self.color = parser, _color()
        self.thinking = False  # reasoning written, and no answer after it yet
        self.answer: list[str] = []

    def write(self, text: str, end: bool = False) -> None:
        thought, answer = self.parser.feed(text, end) if self.parser else ("", text)
        if thought:  # each piece undimmed at once: a Ctrl-C leaves the terminal as it was
            self._reasoning(DIM + thought + UNDIM if self.color else thought)
            self.thinking = True
        if self.thinking and (answer or end):
            self._reasoning("\n\n" if self.color else "\n")
            self.thinking = False
        sys.stdout.write(answer)
        sys.stdout.flush()
        self.answer.append(answer)

    def _reasoning(self, text: str) -> None:
        out = sys.stdout if self.color else sys.stderr
        out.write(text)
        out.flush()


def _line_editing() -> None:
    """Line editing and a history kept across sessions, where the terminal has readline."""
    if not sys.stdin.isatty():
        return
    try:
        import readline  # only for an interactive terminal; absent on some platforms
    except ImportError:
        return
    path = store_root().parent / "chat_history"
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(1000)

    def save() -> None:
        with contextlib.suppress(OSError):
            readline.write_history_file(path)

    atexit.register(save)


def _read_message() -> str | None:
    """The next message typed, several lines between \"\"\" marks; None at the end of input.
    Ctrl-C at the prompt clears the line instead of leaving."""
    while True:
        try:
            line = input("> ")
            if not line.strip().startswith('"""'):
                return line
            first = line.strip()[3:]
            if first.strip() and first.rstrip().endswith('"""'):  # opened and closed on one line
                return first.rstrip()[:-3]
            lines = [first]
            try:
                while not (nxt := input(". ")).rstrip().endswith('"""'):
                    lines.append(nxt)
                lines.append(nxt.rstrip()[:-3])
            except EOFError:  # the input ended inside the block: the block is the message
                pass
            return "\n".join(lines).strip("\n")
        except EOFError:
            print(file=sys.stderr)
            return None
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /bye leaves)", file=sys.stderr)


def to_the_context(llm, prompt: str, params: SamplingParams) -> tuple[list[int], SamplingParams]:
    """The prompt's tokens and params, the reply cut at what the context (or the KV pool, where
    it holds less) leaves after the prompt: with no -n (UNCAPPED) it may take all of that; -n
    or the model's max_new_tokens past it stop there (as llama.cpp's -n)."""
    ids = llm.encode_prompt(prompt)
    room = max(1, llm.engine.max_model_len - len(ids))
    if params.max_tokens > room:
        params = dataclasses.replace(params, max_tokens=room)
    return ids, params


def set_parameter(params: SamplingParams, words: list[str]) -> SamplingParams:
    """`/set parameter NAME VALUE`: params with NAME set (checked as any request's are)."""
    if words and words[0] not in PARAMETERS:
        raise MinervaError(f"no parameter '{words[0]}': /set parameter NAME VALUE, NAME one of "
                           + ", ".join(sorted(PARAMETERS)))
    if len(words) < 2:
        raise MinervaError("usage: /set parameter NAME VALUE, NAME one of " + ", ".join(sorted(PARAMETERS)))
    field, kind = PARAMETERS[words[0]]
    text = " ".join(words[1:])
    try:
        value = (params.stop + (text,)) if field == "stop" else kind(text)
    except ValueError:
        raise MinervaError(f"{words[0]} takes {'an integer' if kind is int else 'a number'}, got '{text}'") from None
    return dataclasses.replace(params, **{field: value})


def show(llm, params: SamplingParams, what: str) -> str:
    """`/show [info|parameters]`: the model (file, architecture, context) and the sampling
    parameters in force."""
    info = [f"model        {llm.path}", f"architecture {llm.config.architecture}",
            f"context      {llm.engine.max_model_len} tokens"]
    cap = "the context" if params.max_tokens >= UNCAPPED else str(params.max_tokens)
    values = [f"temperature {params.temperature}", f"top_k {params.top_k}", f"top_p {params.top_p}",
              f"min_p {params.min_p}", f"repeat_penalty {params.repetition_penalty}",
              f"presence_penalty {params.presence_penalty}", f"frequency_penalty {params.frequency_penalty}",
              f"seed {params.seed}", f"num_predict {cap}"] + [f"stop {s!r}" for s in params.stop]
    if what == "info":
        return "\n".join(info)
    if what == "parameters":
        return "\n".join(values)
    if what:
        raise MinervaError(f"/show {what}: show info or parameters")
    return "\n".join(info + ["parameters:"] + ["  " + v for v in values])


def chat(llm, params: SamplingParams, system: str | None, template_variables: dict) -> int:
    """The conversation, until /bye or the end of input."""
    system_turn = [{"role": "system", "content": system}] if system else []
    history: list[dict] = []
    _line_editing()
    print("chat: type a message; /help for commands, /bye or Ctrl-D leaves", file=sys.stderr)
    while True:
        line = _read_message()
        command = (line or "").strip()
        if line is None or command in ("/bye", "/exit", "/quit"):
            return 0
        if command in ("/reset", "/clear"):
            history = []
            print("[history cleared]", file=sys.stderr)
            continue
        if command in ("/help", "/?"):
            print(CHAT_HELP, file=sys.stderr)
            continue
        if command.startswith("/set") or command.startswith("/show"):
            words = command.split()
            try:
                if words[0] == "/show" and len(words) <= 2:
                    print(show(llm, params, words[1] if len(words) == 2 else ""), file=sys.stderr)
                elif words[0] == "/set" and (len(words) == 1 or words[1] == "parameter"):
                    params = set_parameter(params, words[2:])
                    print(f"[set {words[2]} to {' '.join(words[3:])}]", file=sys.stderr)
                else:
                    print(f"unknown command {command}; /help lists them", file=sys.stderr)
            except MinervaError as exc:
                print(f"error: {exc}", file=sys.stderr)
            continue
        if re.fullmatch(r"/[a-z?]+", command):
            print(f"unknown command {command}; /help lists them", file=sys.stderr)
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        prompt = llm.apply_chat_template(system_turn + history, **template_variables)
        writer = ReplyWriter(llm.reasoning.parser(prompt) if llm.reasoning else None)
        reached = "the context" if params.max_tokens >= UNCAPPED else f"{params.max_tokens} tokens or the context"
        try:
            ids, turn = to_the_context(llm, prompt, params)
            for delta in llm.stream(ids, turn):
                writer.write(delta.text, end=delta.finish_reason is not None)
                if delta.finish_reason == "length":
                    print(f"\n[cut off: the reply reached {reached}]", file=sys.stderr, end="")
        except MinervaError as exc:  # e.g. the history outgrew the context: keep the session
            history.pop()
            print(f"\nerror: {exc} (use /reset)", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the session
            print("\n[interrupted]", file=sys.stderr)
        sys.stdout.write("\n")
        # The answer only: templates leave earlier turns' reasoning out of the prompt anyway.
        history.append({"role": "assistant", "content": "".join(writer.answer)})
