"""Structured output: a request's tokens constrained to a JSON schema, any JSON object, a
regular expression, one of several strings, or a grammar (GBNF as llama.cpp writes it, or
Lark), by llguidance.

Each step the sampler asks every constrained request's `LLMatcher` for the bitmask of
tokens its grammar allows next and sets the others' logits to -inf before sampling; the
sampled token then advances the matcher. When the grammar is complete the mask allows only
the end-of-sequence tokens, so the request finishes with "stop"; cut short by max_tokens it
finishes with "length" as any other. Speculative guesses are masked position by position,
so a guess the grammar forbids has probability 0 and is rejected.

Constraints are compiled once per distinct constraint, on worker threads within a time and
size budget, and cached (`Grammars`); each request gets a copy of the compiled matcher. The tokenizer's view for llguidance is built on first use
(about 0.5 s for a 49k vocabulary, 4.5 s for Gemma 3's 262k).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout, wait
from dataclasses import dataclass

import llguidance
import llguidance.gbnf_to_lark
import torch

from minerva.errors import MinervaError
from minerva.formats.tokenizer import Tokenizer
from minerva.kernels import native

CACHED_GRAMMARS = 256
COMPILERS = 2  # worker threads compiling constraints
GRAMMAR_SECONDS = 10.0  # the longest a constraint may take to compile, waiting included
GRAMMAR_BYTES = 512 << 10  # the longest llguidance grammar a constraint may compile to
# JSON as `json.dumps` writes it (", " and ": ", no other whitespace): small models given free
# whitespace wander into runs of blank lines
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint: `json` (a JSON schema, as a dict or its text), `json_object` (any JSON
    object), `regex`, `choice` (one of these strings) or `grammar` (GBNF or Lark)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = self._given()
        if len(given) != 1:
            raise MinervaError(f"structured output takes exactly one of json, json_object, regex, choice "
                               f"and grammar; got {', '.join(given) or 'none'}")
        checks = {"json": isinstance(self.json, (dict, str)), "regex": isinstance(self.regex, str),
                  "grammar": isinstance(self.grammar, str) and self.grammar.strip() != "",
                  "choice": self.choice is not None and len(self.choice) > 0
                  and all(isinstance(c, str) and c for c in self.choice),
                  "json_object": self.json_object is True}
        if not checks[given[0]]:
            what = {"json": "a JSON schema (object or text)", "regex": "a string", "grammar": "a non-empty string",
                    "choice": "a non-empty list of non-empty strings", "json_object": "true"}[given[0]]
            raise MinervaError(f"structured output {given[0]} must be {what}")

    def _given(self) -> list[str]:
        return [k for k in ("json", "json_object", "regex", "choice", "grammar")
                if (self.json_object if k == "json_object" else getattr(self, k) is not None)]

    @property
    def kind(self) -> str:
        return self._given()[0]

    def key(self) -> str:
        """What identifies the constraint in a cache (a schema's key order is kept: it orders the output)."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=repr)
        return f"{self.kind}:{isinstance(value, str)}:{text}"

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar; a MinervaError naming what is wrong with it."""
        try:
            return self._grammar()
        except MinervaError:
            raise
        except Exception as exc:  # noqa: BLE001 - llguidance's converters raise what their parsers hit
            raise MinervaError(f"invalid {self.kind.replace('_', ' ')} constraint: {library_message(str(exc))}") from None

    def _grammar(self) -> str:
        if self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise MinervaError(f"the JSON schema is not valid JSON: {exc}") from None
                except RecursionError:
                    raise MinervaError("the JSON schema is nested too deeply to read") from None
            if not isinstance(schema, (dict, bool)):
                raise MinervaError("the JSON schema must be a JSON object")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except (ValueError, TypeError) as exc:
                raise MinervaError(f"invalid JSON schema: {exc}") from None
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # one lexeme: the parser's rows are limited to 2,000 alternatives
            return llguidance.LLMatcher.grammar_from_regex("|".join(map(regex_literal, self.choice)))
        text = self.grammar
        if "::=" in text:  # GBNF (llama.cpp)
            try:
                text = llguidance.gbnf_to_lark.gbnf_to_lark(text)
            except Exception as exc:  # noqa: BLE001 - the converter raises whatever its parser hit
                raise MinervaError(f"invalid GBNF grammar: {library_message(str(exc))}") from None
        return llguidance.LLMatcher.grammar_from_lark(text)


class Grammars:
    """The compiled constraints of one engine: llguidance's view of the tokenizer (built on
    first use) and an LRU of compiled matchers by constraint.

    A constraint is compiled on one of this object's worker threads, never on the caller's
    (llguidance lets go of the GIL while it builds), within two budgets: its llguidance grammar
    at most `max_bytes` long, its compilation (queueing included) at most `seconds`. Over
    either it is refused with a MinervaError naming the limit (building llguidance's view of the
    tokenizer, once, counts against no constraint), and the refusal is cached as a
    result would be, so the same constraint sent again is refused at once. Every request with
    the same constraint shares one compilation, even while it is running.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, seconds: float = GRAMMAR_SECONDS,
                 max_bytes: int = GRAMMAR_BYTES):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.seconds, self.max_bytes = seconds, max_bytes
        self._ll: llguidance.LLTokenizer | None = None
        self._ll_lock = threading.Lock()
        self._ll_at = 0.0  # when the tokenizer's view was built: no constraint's time is counted before
        self._ll_ready: Future | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._ll_lock:
            if self._ll is None:
                try:
                    self._ll = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                      eos_token=sorted(self.tokenizer.eos_token_ids))
                except Exception as exc:  # noqa: BLE001 - llguidance's own message says what it could not read
                    raise MinervaError(f"structured output cannot use this model's tokenizer: {exc}") from None
                self._ll_at = time.monotonic()
            return self._ll

    def tokenizer_ready(self) -> Future:
        """The building of llguidance's view of the tokenizer (once an engine, up to several
        seconds for a large vocabulary), on the workers; a constraint's budget starts after it."""
        with self._lock:
            return self._start_tokenizer()

    def _start_tokenizer(self) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COMPILERS, thread_name_prefix="minerva-grammar")
        if self._ll_ready is None or self._ll_ready.cancelled():
            self._ll_ready = self._pool.submit(lambda: self.ll_tokenizer)
        return self._ll_ready

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for `spec`, for one request."""
        return self.compiled(spec).deep_copy()

    def submit(self, spec: StructuredOutput) -> Future:
        """The compilation of `spec`: a future of (matcher in its start state, None) or (None,
        the reason it was refused), shared with every other caller of the same constraint."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is None or future.cancelled():
                self._start_tokenizer()  # first in the queue
                future = self._cache[key] = self._pool.submit(self._compile, spec, time.monotonic())
                done = [k for k, f in self._cache.items() if f.done()]
                for k in done[:max(0, len(self._cache) - CACHED_GRAMMARS)]:  # the oldest finished ones
                    del self._cache[k]
            else:
                self._cache.move_to_end(key)
        return future

    def compiled(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """The cached matcher of `spec` in its start state (copy it before use), waiting for its
        compilation at most `seconds`; a MinervaError (a 400 in the server) when `spec` is
        invalid or over a budget."""
        future = self.submit(spec)
        wait([self.tokenizer_ready()])  # (a tokenizer it cannot use: the compilation says so)
        try:
            matcher, error = future.result(timeout=self.seconds)
        except FutureTimeout:
            matcher, error = None, self.too_slow(spec)
        if error is not None:
            raise MinervaError(error)
        return matcher

    def too_slow(self, spec: StructuredOutput) -> str:
        return (f"the {spec.kind.replace('_', ' ')} constraint did not compile within {self.seconds:g} s, "
                f"this server's limit; simplify it")

    def _compile(self, spec: StructuredOutput, submitted: float) -> tuple[llguidance.LLMatcher | None, str | None]:
        what = f"{spec.kind.replace('_', ' ')} constraint"
        try:
            tokenizer = self.ll_tokenizer
            submitted = max(submitted, self._ll_at)
            if time.monotonic() - submitted > self.seconds:  # its callers have given up waiting
                return None, self.too_slow(spec)
            grammar = spec.llguidance_grammar()
            if len(grammar) > self.max_bytes:
                return None, (f"the {what} compiles to a grammar of {len(grammar):,} bytes, over this server's "
                              f"limit of {self.max_bytes:,}; simplify it")
            compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if compiled.is_error():
                return None, f"invalid {what}: {library_message(compiled.get_error())}"
        except MinervaError as exc:
            return None, str(exc)
        except Exception as exc:  # noqa: BLE001 - a grammar llguidance cannot even read
            return None, f"invalid {what}: {library_message(str(exc))}"
        if time.monotonic() - submitted > self.seconds:
            return None, self.too_slow(spec)
        return compiled, None


def constraint_failed(request) -> bool:
    """Whether the request's matcher has failed while following its tokens (llguidance hit one
    of its limits: the lexer's states, the parser's items); then request.error says so, and the
    request ends with it instead of an answer its constraint does not hold."""
    matcher = request.sampler.matcher
    if matcher is None or not matcher.is_error():
        return False
    if request.error is None:
        what = request.params.structured.kind.replace("_", " ")
        reason = matcher.get_error().split("<state>")[0].strip()  # without the matcher's state dump
        if reason.startswith("NoExtensionBias"):
            reason = "no token can continue the text within it"
        request.error = f"the {what} constraint could not be followed ({library_message(reason)}); simplify it"
    return True


def regex_literal(text: str) -> str:
    """`text` as a regular expression (llguidance's, Rust's syntax) that matches it alone."""
    return "".join(c if c.isalnum() or c == " " or not c.isascii() and c.isprintable() else f"\\x{{{ord(c):x}}}"
                   for c in text)


def library_message(text: str, limit: int = 500) -> str:
    """llguidance's error as one line for a client, at most `limit` characters; a panic (an
    internal limit of the library: the constraint was too large) without its backtrace."""
    if text.lstrip().startswith("panic") or "<backtrace>" in text:
        return "it is too large or too complex for the grammar compiler; simplify it"
    text = one_line(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def one_line(text: str) -> str:
    return " ".join(text.split())


@dataclass
class MaskStats:
    """What the masks have cost this process: rows masked, seconds computing their bitmasks
    (llguidance) and seconds applying them to the logits."""

    rows: int = 0
    fill_seconds: float = 0.0
    apply_seconds: float = 0.0


STATS = MaskStats()
_executor: llguidance.LLExecutor | None = None


def fill_masks(matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """The bitmask [len(matchers), ceil(vocab / 32)] int32 of the tokens each allows next
    (several matchers on llguidance's threads at once)."""
    global _executor
    start = time.perf_counter()
    mask = torch.empty(len(matchers), (vocab_size + 31) // 32, dtype=torch.int32)
    if len(matchers) == 1:
        matchers[0].unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4)
    else:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        _executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(),
                                          mask.shape[1] * 4, len(matchers))
    STATS.rows += len(matchers)
    STATS.fill_seconds += time.perf_counter() - start
    return mask


def apply_mask_(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with every token whose bit in mask [N, ceil(V / 32)] is 0 set to -inf."""
    start = time.perf_counter()
    kernels = native.for_tensor(logits)
    if kernels is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        kernels.apply_token_bitmask_(logits, mask.contiguous())
    else:
        bits = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((mask.to(logits.device).unsqueeze(-1) >> bits) & 1).bool()
        logits.masked_fill_(~allowed.reshape(mask.shape[0], -1)[:, :logits.shape[-1]], float("-inf"))
    STATS.apply_seconds += time.perf_counter() - start
    return logits
