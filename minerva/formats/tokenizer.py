"""Tokenizers: built from GGUF metadata or a Hugging Face model directory.

The actual tokenization runs in the `tokenizers` library; this module only
translates what a file says (llama.cpp's `tokenizer.ggml.*` keys, or a
`tokenizer.json`) into a `tokenizers.Tokenizer` that behaves the way llama.cpp
and Hugging Face do for that model, plus the bits around it: BOS/EOS handling,
the set of ids that end a generation, and streaming detokenization.

    md = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    tok = Tokenizer.from_gguf_metadata(md)
    ids = tok.encode("Hello")
    text = tok.decode(ids)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from minerva.errors import MinervaError
from minerva.formats.chat import chat_template_for

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# ---------------------------------------------------------------------------
# Pre-tokenizer regexes for byte-level BPE vocabularies, from llama.cpp
# (src/llama-vocab.cpp, `llm_tokenizer_bpe`). Each entry is a list of regexes
# applied one after another: every regex splits the pieces the previous one
# left, keeping the text it does not match as pieces of their own -- what
# `pre_tokenizers.Split(..., behavior="isolated")` does.
# ---------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + "(?:" + _CONTRACTIONS + ")?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + "(?:" + _CONTRACTIONS + ")?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


class _Pre:
    """How llama.cpp treats one `tokenizer.ggml.pre` value."""

    __slots__ = ("regexes", "ignore_merges", "add_bos")

    def __init__(self, regexes: list[str], *, ignore_merges: bool = False, add_bos: bool = False):
        self.regexes = regexes
        self.ignore_merges = ignore_merges
        self.add_bos = add_bos


_DEFAULT = _Pre([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"])
_PRE_GPT2 = _Pre([_GPT2])
_PRE_LLAMA3 = _Pre([_LLAMA3], ignore_merges=True, add_bos=True)
_PRE_LLAMA3_REGEX = _Pre([_LLAMA3])
_PRE_STARCODER = _Pre([r"\p{N}", _GPT2])  # digits one by one, then GPT-2
_PRE_QWEN2 = _Pre([_QWEN2])
_PRE_GPT4O = _Pre([_GPT4O])

PRE_TOKENIZERS: dict[str, _Pre] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        ["gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en", "jina-v2-es",
         "jina-v2-de", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "trillion", "exaone4",
         "granite-docling", "a.x-4.0", "mellum"],
        _PRE_GPT2,
    ),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2"], _PRE_LLAMA3),
    **dict.fromkeys(["dbrx", "smaug-bpe", "chatglm-bpe", "glm4"], _PRE_LLAMA3_REGEX),
    # llama.cpp gives SmolLM (and StarCoder & co.) the GPT-2 regex after
    # splitting every digit on its own -- as SmolLM's tokenizer.json does with
    # its `Digits(individual_digits=True)` pre-tokenizer.
    **dict.fromkeys(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
                     "mellum2"], _PRE_STARCODER),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "kormo", "f2llmv2"],
                    _PRE_QWEN2),
    "qwen35": _Pre([_QWEN35]),
    "tekken": _Pre([_TEKKEN], ignore_merges=True, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"], _PRE_GPT4O),
    "falcon": _Pre([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense"], _Pre(_DEEPSEEK3)),
    **dict.fromkeys(["bloom", "poro-chat", "gpt3-finnish"], _Pre([_BLOOM])),
    "viking": _Pre([_BLOOM, r"\p{N}"]),
}

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


def _md_get(md: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = md.get(key, default)
    return default if value is None else value


def _as_bool(value: Any, default: bool) -> bool:
    if value is None:
        return default
    return bool(value)


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

        eos_ids = set(int(i) for i in extra_eos_ids if i is not None)
        if eos_token_id is not None:
            eos_ids.add(int(eos_token_id))
        # The end-of-turn token the chat template (the model's own, else the
        # built-in one for its architecture) writes after each message.
        template = chat_template_for(chat_template, architecture or "")
        self.resolved_chat_template = template  # what chat requests are rendered with
        for name in END_OF_TURN_TOKENS:
            if name in template:
                token_id = backend.token_to_id(name)
                if token_id is not None:
                    eos_ids.add(token_id)
        self._eos_ids = frozenset(i for i in eos_ids if 0 <= i < self._vocab_size)

    # -- construction ------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes from its metadata dict."""
        model = md.get("tokenizer.ggml.model")
        tokens = md.get("tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise MinervaError(
                "GGUF metadata has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)"
            )
        if model not in ("gpt2", "llama"):
            raise MinervaError(
                f"unsupported tokenizer model {model!r} in GGUF metadata (tokenizer.ggml.model); "
                "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
            )

        tokens = list(tokens)
        n_vocab = len(tokens)
        for i, tok in enumerate(tokens):
            if not tok:  # as llama.cpp does
                tokens[i] = f"[EMPTY_{i}]"
        token_types = list(_md_get(md, "tokenizer.ggml.token_type", []))
        if len(token_types) != n_vocab:
            token_types = [TOKEN_NORMAL] * n_vocab

        def token_id(key: str) -> int | None:
            value = md.get(f"tokenizer.ggml.{key}")
            if value is None:
                return None
            value = int(value)
            return value if 0 <= value < n_vocab else None

        bos = token_id("bos_token_id")
        eos = token_id("eos_token_id")
        unk = token_id("unknown_token_id")
        pad = token_id("padding_token_id")

        if model == "gpt2":
            pre_name = _md_get(md, "tokenizer.ggml.pre", "default")
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise MinervaError(
                    f"unsupported pre-tokenizer {pre_name!r} in GGUF metadata (tokenizer.ggml.pre)"
                )
            merges = md.get("tokenizer.ggml.merges")
            if merges is None:
                raise MinervaError("GGUF metadata has a 'gpt2' tokenizer but no tokenizer.ggml.merges")
            backend = _byte_level_bpe(tokens, list(merges), pre)
            default_add_bos = pre.add_bos
            pieces = _byte_level_pieces(tokens, token_types)
            strip_space = False
        else:
            scores = list(_md_get(md, "tokenizer.ggml.scores", []))
            if len(scores) != n_vocab:
                scores = [0.0] * n_vocab
            add_space_prefix = _as_bool(md.get("tokenizer.ggml.add_space_prefix"), True)
            unk_token = tokens[unk] if unk is not None else None
            backend = _sentencepiece_bpe(tokens, scores, token_types, add_space_prefix, unk_token)
            default_add_bos = True
            pieces = _sentencepiece_pieces(tokens, token_types)
            strip_space = add_space_prefix

        _add_special_tokens(backend, tokens, token_types)

        add_bos = _as_bool(md.get("tokenizer.ggml.add_bos_token"), default_add_bos)
        add_eos = _as_bool(md.get("tokenizer.ggml.add_eos_token"), False)
        extra = [token_id("eot_token_id"), token_id("eom_token_id")]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            extra_eos_ids=[i for i in extra if i is not None],
            add_bos=add_bos,
            add_eos=add_eos,
            chat_template=md.get("tokenizer.chat_template") or None,
            architecture=md.get("general.architecture"),
            vocab_size=n_vocab,
            unk_token_id=unk,
            pad_token_id=pad,
            pieces=pieces,
            special=[t in (TOKEN_CONTROL, TOKEN_UNKNOWN) for t in token_types],
            strip_leading_space=strip_space,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> "Tokenizer":
        """Build the tokenizer of a Hugging Face model directory (tokenizer.json & co.)."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise MinervaError(f"{path}: no tokenizer.json in the model directory")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
            raise MinervaError(f"{tj}: cannot load tokenizer: {str(e).splitlines()[0] if str(e) else e}") from None

        config = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")

        def token_of(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                return backend.token_to_id(value)
            return None

        bos = token_of(config.get("bos_token"))
        eos = token_of(config.get("eos_token"))
        if bos is None and isinstance(gen.get("bos_token_id"), int):
            bos = gen["bos_token_id"]
        if bos is None and isinstance(model_config.get("bos_token_id"), int):
            bos = model_config["bos_token_id"]
        extra_eos: list[int] = []
        for source in (gen, model_config):
            value = source.get("eos_token_id")
            if isinstance(value, int):
                extra_eos.append(value)
            elif isinstance(value, list):
                extra_eos.extend(v for v in value if isinstance(v, int))
        if eos is None and extra_eos:
            eos = extra_eos[0]

        template = _chat_template_from_config(path, config)

        # Does the post-processor already add BOS/EOS?
        probe = backend.encode("a", add_special_tokens=True).ids
        plain = backend.encode("a", add_special_tokens=False).ids
        adds_bos = bos is not None and len(probe) > len(plain) and probe[0] == bos
        adds_eos = eos is not None and len(probe) > len(plain) and probe[-1] == eos
        want_bos = config.get("add_bos_token")
        want_eos = config.get("add_eos_token")
        add_bos = bool(want_bos) and not adds_bos
        add_eos = bool(want_eos) and not adds_eos

        architecture = model_config.get("model_type")
        pieces = _byte_fallback_pieces(backend)
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            extra_eos_ids=extra_eos,
            add_bos=add_bos,
            add_eos=add_eos,
            chat_template=template,
            architecture=architecture,
            backend_adds_special=True,
            unk_token_id=token_of(config.get("unk_token")),
            pad_token_id=token_of(config.get("pad_token")),
            **(pieces or {}),
        )

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

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # -- encode / decode ---------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text map to their ids."""
        if not isinstance(text, str):
            raise MinervaError(f"cannot tokenize a {type(text).__name__}: expected a string")
        ids = self._backend.encode(
            text, add_special_tokens=add_special_tokens and self._backend_adds_special
        ).ids
        if add_special_tokens:
            if self._add_bos:
                ids.insert(0, self._bos)
            if self._add_eos:
                ids.append(self._eos)
        return ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

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


# ---------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------


def _byte_level_bpe(tokens: list[str], merges_md: list[str], pre: _Pre) -> tokenizers.Tokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for m in merges_md:
        pos = m.find(" ", 1)  # as llama.cpp splits a merge
        if pos < 0:
            continue
        a, b = m[:pos], m[pos + 1:]
        if a in vocab and b in vocab and a + b in vocab:
            merges.append((a, b))
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges, byte_fallback=False)
    except Exception as e:  # noqa: BLE001
        raise MinervaError(f"GGUF tokenizer: cannot build BPE model: {str(e).splitlines()[0]}") from None
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges equivalent to llama.cpp's SentencePiece-BPE tokenizer.

    llama.cpp repeatedly joins the adjacent pair whose joined text is the
    vocabulary token with the highest score. As a BPE merge list: every split
    of a token into two vocabulary tokens is a merge, ranked by the score of
    the joined token (ties: the longer left part first, then the token id).
    """
    ranked = []
    append = ranked.append
    for tok, i in vocab.items():
        n = len(tok)
        if n < 2:
            continue
        score = -scores[i]
        for k in range(1, n):
            a = tok[:k]
            if a in vocab:
                b = tok[k:]
                if b in vocab:
                    append((score, -k, i, a, b))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]


def _sentencepiece_bpe(
    tokens: list[str],
    scores: list[float],
    token_types: list[int],
    add_space_prefix: bool,
    unk_token: str | None,
) -> tokenizers.Tokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = _spm_merges(tokens, scores, vocab)
    has_bytes = all(f"<0x{b:02X}>" in vocab for b in range(256))
    try:
        bpe = models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=unk_token,
            fuse_unk=True,
            byte_fallback=has_bytes,
        )
    except Exception as e:  # noqa: BLE001
        raise MinervaError(f"GGUF tokenizer: cannot build BPE model: {str(e).splitlines()[0]}") from None
    backend = tokenizers.Tokenizer(bpe)
    # llama.cpp escapes spaces as U+2581 and, with add_space_prefix, puts one in
    # front of every stretch of text (the start, and after each special token).
    norm = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    backend.normalizer = normalizers.Sequence(norm)
    backend.pre_tokenizer = None
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    return backend


def _byte_level_pieces(tokens: list[str], token_types: list[int]) -> list[bytes]:
    """Bytes of each token of a byte-level vocabulary (as llama.cpp's token_to_piece)."""
    byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
    pieces = []
    for tok, kind in zip(tokens, token_types):
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
            pieces.append(tok.encode("utf-8"))
            continue
        try:
            pieces.append(bytes(byte_of[ch] for ch in tok))
        except KeyError:  # not spelled in the byte alphabet: take the text as it is
            pieces.append(tok.encode("utf-8"))
    return pieces


def _sentencepiece_pieces(tokens: list[str], token_types: list[int]) -> list[bytes]:
    """Bytes of each token of a SentencePiece vocabulary: U+2581 is a space, <0xNN> one byte."""
    pieces = []
    for tok, kind in zip(tokens, token_types):
        if kind == TOKEN_BYTE and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            try:
                pieces.append(bytes([int(tok[3:5], 16)]))
                continue
            except ValueError:
                pass
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            pieces.append(tok.encode("utf-8"))
        else:
            pieces.append(tok.replace("\u2581", " ").encode("utf-8"))
    return pieces


def _byte_fallback_pieces(backend: tokenizers.Tokenizer) -> dict | None:
    """For a tokenizer.json whose decoder is SentencePiece-style byte fallback
    (Replace U+2581 -> " ", ByteFallback, Fuse, optionally Strip one leading
    space), the byte table `Tokenizer` decodes with; None for any other decoder,
    which then decodes through `tokenizers` as it is."""
    try:
        decoder = json.loads(backend.decoder.__getstate__())
    except Exception:  # noqa: BLE001 - no decoder, or one that does not serialize
        return None
    steps = decoder.get("decoders") if decoder.get("type") == "Sequence" else None
    if not steps:
        return None
    kinds = [d.get("type") for d in steps]
    strip = kinds[-1] == "Strip"
    if strip:
        last = steps[-1]
        if (last.get("content"), last.get("start"), last.get("stop")) != (" ", 1, 0):
            return None
        kinds = kinds[:-1]
    if kinds != ["Replace", "ByteFallback", "Fuse"]:
        return None
    replace = steps[0]
    if replace.get("pattern") != {"String": "\u2581"} or replace.get("content") != " ":
        return None
    n = backend.get_vocab_size(with_added_tokens=True)
    special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    pieces: list[bytes] = []
    for i in range(n):
        tok = backend.id_to_token(i)
        if tok is None:
            pieces.append(b"")
        elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">") and i not in special_ids:
            try:
                pieces.append(bytes([int(tok[3:5], 16)]))
            except ValueError:
                pieces.append(tok.replace("\u2581", " ").encode("utf-8"))
        else:
            pieces.append(tok.replace("\u2581", " ").encode("utf-8"))
    return {
        "pieces": pieces,
        "special": [i in special_ids for i in range(n)],
        "strip_leading_space": strip,
        "vocab_size": n,
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens and user-defined ones plain
    added tokens, so both are matched whole in the raw text as llama.cpp does."""
    special = []
    user = []
    for tok, kind in zip(tokens, token_types):
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            special.append(AddedToken(tok, special=True, normalized=False))
        elif kind == TOKEN_USER_DEFINED:
            user.append(AddedToken(tok, special=False, normalized=False))
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise MinervaError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _chat_template_from_config(path: Path, config: dict) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        value = named.get("default") or next(iter(named.values()), None)
        return value if isinstance(value, str) else None
    return None
