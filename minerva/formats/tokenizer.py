"""Tokenizers: built from GGUF metadata or a Hugging Face model directory.

The actual tokenization runs in the `tokenizers` library. What a file says is
translated into a `tokenizers.Tokenizer` that behaves the way llama.cpp and Hugging
Face do for that model by `tokenizer_gguf.py` (llama.cpp's `tokenizer.ggml.*` keys)
and `tokenizer_hf.py` (a `tokenizer.json` and its configs); this module holds the
bits around it: BOS/EOS handling, the set of ids that end a generation, decoding and
streaming detokenization.

    md = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    tok = Tokenizer.from_gguf_metadata(md)
    ids = tok.encode("Hello")
    text = tok.decode(ids)
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Iterable, Mapping

import tokenizers

from minerva.errors import MinervaError
from minerva.formats.chat import chat_template_for
from minerva.formats.tokenizer_gguf import gguf_tokenizer_args
from minerva.formats.tokenizer_hf import hf_tokenizer_args

# Tokens that end a turn in the chat formats we know. One of them counts as an
# end of generation when the model's chat template writes it (see
# `Tokenizer.eos_token_ids`); the list mirrors llama.cpp's end-of-generation
# detection.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<|EOT|>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
    "<|end_of_turn|>",
    "<turn|>",
)


class Tokenizer:
    """Text <-> token ids for one model.

    Build it with `from_gguf_metadata` or `from_pretrained_dir`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_ids: Iterable[int] = (),
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        architecture: str | None = None,
        vocab_size: int | None = None,
        backend_adds_special: bool = False,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        pieces: list[bytes] | None = None,
        special: list[bool] | None = None,
        strip_leading_space: bool = False,
    ):
        self._backend = backend
        # For GGUF vocabularies: the bytes each token stands for, and which ids
        # are special. Decoding joins the bytes and decodes them once, so a
        # character's text never depends on the tokens around it (tokenizers'
        # ByteFallback turns a whole run of byte tokens into U+FFFD when any of
        # it is invalid, which would make streaming and full decodes differ).
        self._pieces = pieces
        self._special = special
        self._strip_leading_space = strip_leading_space
        self._bos = bos_token_id
        self._eos = eos_token_id
        self._add_bos = bool(add_bos) and bos_token_id is not None
        self._add_eos = bool(add_eos) and eos_token_id is not None
        # A tokenizer.json carries a post-processor that may add BOS/EOS itself.
        self._backend_adds_special = backend_adds_special
        self._backend_adds_bos = False
        if backend_adds_special and bos_token_id is not None:
            probe = backend.encode("a", add_special_tokens=True).ids
            self._backend_adds_bos = bool(probe) and probe[0] == bos_token_id
        self._chat_template = chat_template
        self.architecture = architecture
        self._vocab_size = vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id

        self._file_eos_ids = set(int(i) for i in extra_eos_ids if i is not None)
        if eos_token_id is not None:
            self._file_eos_ids.add(int(eos_token_id))
        # the model's own template, else the built-in one for its architecture
        self.use_chat_template(chat_template_for(chat_template, architecture or ""))

    def use_chat_template(self, template: str) -> None:
        """Render chat requests with `template` (`resolved_chat_template`); the end-of-turn token
        it writes after each message ends a generation too."""
        self.resolved_chat_template = template
        eos_ids = set(self._file_eos_ids)
        for name in END_OF_TURN_TOKENS:
            if name in template:
                token_id = self._backend.token_to_id(name)
                if token_id is not None:
                    eos_ids.add(token_id)
        eos_ids = _harmony_ends(self._backend, eos_ids)
        self._eos_ids = frozenset(i for i in eos_ids if 0 <= i < self._vocab_size)

    # -- construction ------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes from its metadata dict."""
        return cls(**gguf_tokenizer_args(md))

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> "Tokenizer":
        """Build the tokenizer of a Hugging Face model directory (tokenizer.json & co.)."""
        return cls(**hf_tokenizer_args(path))

    # -- properties --------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end a generation: EOS, EOT/EOM, and the chat template's end-of-turn token."""
        return self._eos_ids

    @property
    def chat_template(self) -> str | None:
        """The chat template the model files carry (None if they carry none)."""
        return self._chat_template

    @property
    def add_bos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` starts with BOS."""
        return self._add_bos or self._backend_adds_bos

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """Whether decoding with `skip_special_tokens` leaves this token out."""
        if self._pieces is not None:  # decoded from the GGUF byte table, as `decode` does
            return 0 <= token_id < len(self._special) and self._special[token_id]
        return token_id in self._special_ids

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # -- encode / decode ---------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text map to their ids."""
        if not isinstance(text, str):
            raise MinervaError(f"cannot tokenize a {type(text).__name__}: expected a string")
        check_unicode(text)
        # encode_batch_fast releases the GIL while it works (encode does not), so a long prompt
        # tokenized on a worker thread does not stall the event loop or the engine thread.
        ids = self._backend.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens and self._backend_adds_special
        )[0].ids
        if add_special_tokens:
            if self._add_bos:
                ids.insert(0, self._bos)
            if self._add_eos:
                ids.append(self._eos)
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (an upper bound), so
        `len(text) / max_token_chars` is a lower bound on the tokens of `text`: a check of a
        prompt's length that costs nothing next to tokenizing it."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a character's UTF-8 for a byte token; for
        a vocabulary without a byte table, the UTF-8 of its text)."""
        if not 0 <= token_id < self._vocab_size:
            raise MinervaError(f"token id {token_id} is out of range for a vocabulary of {self._vocab_size}")
        if self._pieces is None:
            return self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return self._pieces[token_id]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self._vocab_size:
                raise MinervaError(f"token id {i} is out of range for a vocabulary of {self._vocab_size}")
        if self._pieces is None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        pieces = self._pieces
        if skip_special_tokens:
            special = self._special
            data = b"".join([pieces[i] for i in ids if not special[i]])
        else:
            data = b"".join([pieces[i] for i in ids])
        text = data.decode("utf-8", errors="replace")
        if self._strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self._vocab_size}, bos={self._bos}, eos={sorted(self._eos_ids)}, "
            f"add_bos={self.add_bos}, architecture={self.architecture!r})"
        )


def _harmony_ends(backend: tokenizers.Tokenizer, eos_ids: set[int]) -> set[int]:
    """The ends of generation of a harmony vocabulary (GPT-OSS), where `<|end|>` closes every
    message, the reasoning ones included, and the reply goes on after it: only `<|return|>`
    (the answer is done) and `<|call|>` (a tool is called) end a generation. As llama.cpp
    does, a vocabulary that has both of those is taken for a harmony one, whatever its files
    name as EOS or end of turn."""
    end, ret, call = (backend.token_to_id(t) for t in ("<|end|>", "<|return|>", "<|call|>"))
    if ret is None or call is None:
        return eos_ids
    return (eos_ids | {ret, call}) - {end}


def check_unicode(text: str) -> None:
    """A MinervaError when `text` holds a lone UTF-16 surrogate (JSON's "\\ud800" decodes to
    one), which no tokenizer can encode: valid text has surrogates only as pairs."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, kept by Python's surrogateescape (stdin, files)
            raise MinervaError(f"the text is not UTF-8: byte 0x{code - 0xDC00:02X} at character {exc.start}; "
                               "give UTF-8 text") from None
        raise MinervaError(f"the text has a lone surrogate U+{code:04X} at character "
                           f"{exc.start}; send valid Unicode (surrogates only in pairs)") from None


class IncrementalDetokenizer:
    """Streaming decode: feed ids one at a time, get the newly completed text.

    Text is held back while it ends in an incomplete UTF-8 sequence (a
    byte-fallback or byte-level token that is only part of a character), so no
    U+FFFD is emitted for a character that the next token completes. The
    concatenation of everything `add` returns plus `flush()` equals
    `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        # ids[_prefix:_read] were decoded already; text of ids[_prefix:] minus
        # the text of ids[_prefix:_read] is what is new. Decoding from a
        # little before the new ids keeps decoders that look at neighbours
        # (leading-space stripping, byte fusion) consistent with a full decode.
        self._prefix = 0
        self._read = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self._prefix = self._read
            self._read = len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix:], self._skip)
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
