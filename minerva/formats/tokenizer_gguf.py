"""A tokenizer from GGUF metadata: llama.cpp's `tokenizer.ggml.*` keys turned into a
`tokenizers.Tokenizer` that splits text the way llama.cpp does, and the rest of what
`Tokenizer` needs (special ids, BOS/EOS defaults, the bytes of every token).

Two vocabulary kinds: `gpt2` (byte-level BPE, with llama.cpp's pre-tokenizer regexes per
`tokenizer.ggml.pre`) and `llama` (SentencePiece-style BPE ranked by token scores).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from minerva.errors import MinervaError

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

# The type llama.cpp reads each key as (and the type of a list's items; every special token
# id is an int); a value of another type comes from a corrupt or hostile file and is refused
# by `_md_get`.
_TYPES: dict[str, tuple[type, Any]] = {
    "tokenizer.ggml.model": (str, None), "tokenizer.ggml.pre": (str, None),
    "tokenizer.ggml.tokens": (list, str), "tokenizer.ggml.merges": (list, str),
    "tokenizer.ggml.token_type": (list, int), "tokenizer.ggml.scores": (list, (int, float)),
    "tokenizer.chat_template": (str, None),
}
# Special token ids: tokenizer.ggml.{bos, eos, eot, eom, unknown, padding, sep, cls, mask,
# fim_pre, ...}_token_id, each a token of the vocabulary or -1 for none (`check_token_ids`).
TOKEN_ID_KEY = re.compile(r"tokenizer\.ggml\.\w+_token_id")
NO_TOKEN = -1


def _md_get(md: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = md.get(key)
    if value is None:
        return default
    kind, item = _TYPES.get(key, (int, None) if TOKEN_ID_KEY.fullmatch(key) else (object, None))
    if not isinstance(value, kind) or (item and not all(isinstance(v, item) for v in value)):
        want = f"a list of {getattr(item, '__name__', 'number')}" if item else f"of type {kind.__name__}"
        raise MinervaError(f"GGUF metadata {key} should be {want}, not {str(value)[:60]!r}; "
                           "the file is corrupt")
    return value


def check_token_ids(md: Mapping[str, Any], n_vocab: int) -> None:
    """Refuse a special token id (BOS, EOS, padding, ... any `tokenizer.ggml.*_token_id`) that
    is no token of the `n_vocab`-token vocabulary: a corrupt id would end or pad generation
    at a token that never comes, or index past the embedding."""
    for key in md:
        if TOKEN_ID_KEY.fullmatch(key):
            value = _md_get(md, key)
            if value is not None and value != NO_TOKEN and not 0 <= value < n_vocab:
                raise MinervaError(f"GGUF metadata {key} = {value} is not a token of the {n_vocab}-token "
                                   f"vocabulary (0 to {n_vocab - 1}, or {NO_TOKEN} for none); the file is corrupt")


def _per_token(md: Mapping[str, Any], key: str, n_vocab: int) -> list | None:
    """A list the file keeps one entry a token of (types, scores), None where it has none."""
    values = _md_get(md, key)
    if values is not None and len(values) != n_vocab:
        raise MinervaError(f"GGUF metadata {key} has {len(values)} entries and tokenizer.ggml.tokens {n_vocab} "
                           "(allowed: one a token); the file is corrupt")
    return None if values is None else list(values)


def _as_bool(value: Any, default: bool) -> bool:
    if value is None:
        return default
    return bool(value)


def gguf_tokenizer_args(md: Mapping[str, Any]) -> dict[str, Any]:
    """The `Tokenizer` arguments (backend included) that a GGUF file's metadata describes."""
    model = _md_get(md, "tokenizer.ggml.model")
    tokens = _md_get(md, "tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise MinervaError(
            "GGUF metadata has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)"
        )
    if model not in ("gpt2", "llama"):
        raise MinervaError(
            f"unsupported tokenizer model {model!r} in GGUF metadata (tokenizer.ggml.model); "
            "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
        )

    if not tokens:
        raise MinervaError("GGUF metadata tokenizer.ggml.tokens is an empty vocabulary; the file is corrupt")
    tokens = [tok or f"[EMPTY_{i}]" for i, tok in enumerate(tokens)]  # as llama.cpp names empty tokens
    n_vocab = len(tokens)
    token_types = _per_token(md, "tokenizer.ggml.token_type", n_vocab) or [TOKEN_NORMAL] * n_vocab
    _per_token(md, "tokenizer.ggml.scores", n_vocab)  # read by the SentencePiece tokenizer only; checked for all

    check_token_ids(md, n_vocab)

    def token_id(key: str) -> int | None:
        value = _md_get(md, f"tokenizer.ggml.{key}")
        return None if value is None or value == NO_TOKEN else int(value)

    unk = token_id("unknown_token_id")
    build = _byte_level if model == "gpt2" else _sentencepiece
    backend, pieces, default_add_bos, strip_space = build(md, tokens, token_types, unk)
    _add_special_tokens(backend, tokens, token_types)
    extra = [token_id("eot_token_id"), token_id("eom_token_id")]
    return dict(
        backend=backend,
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        extra_eos_ids=[i for i in extra if i is not None],
        add_bos=_as_bool(md.get("tokenizer.ggml.add_bos_token"), default_add_bos),
        add_eos=_as_bool(md.get("tokenizer.ggml.add_eos_token"), False),
        chat_template=_md_get(md, "tokenizer.chat_template") or None,
        architecture=md.get("general.architecture"),
        vocab_size=n_vocab,
        unk_token_id=unk,
        pad_token_id=token_id("padding_token_id"),
        pieces=pieces,
        special=[t in (TOKEN_CONTROL, TOKEN_UNKNOWN) for t in token_types],
        strip_leading_space=strip_space,
    )


# A vocabulary kind's builder returns (backend, bytes of each token, whether BOS is added
# when the file does not say, whether decoding strips one leading space).
_Built = tuple[tokenizers.Tokenizer, list[bytes], bool, bool]


def _byte_level(md: Mapping[str, Any], tokens: list[str], token_types: list[int], unk: int | None) -> _Built:
    """`gpt2`: byte-level BPE, split first by the regexes of `tokenizer.ggml.pre`."""
    pre_name = _md_get(md, "tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise MinervaError(
            f"unsupported pre-tokenizer {pre_name!r} in GGUF metadata (tokenizer.ggml.pre)"
        )
    merges = _md_get(md, "tokenizer.ggml.merges")
    if merges is None:
        raise MinervaError("GGUF metadata has a 'gpt2' tokenizer but no tokenizer.ggml.merges")
    backend = _byte_level_bpe(tokens, list(merges), pre)
    return backend, _byte_level_pieces(tokens, token_types), pre.add_bos, False


def _sentencepiece(md: Mapping[str, Any], tokens: list[str], token_types: list[int], unk: int | None) -> _Built:
    """`llama`: SentencePiece-style BPE ranked by `tokenizer.ggml.scores`; BOS by default."""
    scores = _per_token(md, "tokenizer.ggml.scores", len(tokens)) or [0.0] * len(tokens)
    add_space_prefix = _as_bool(md.get("tokenizer.ggml.add_space_prefix"), True)
    unk_token = tokens[unk] if unk is not None else None
    backend = _sentencepiece_bpe(tokens, scores, token_types, add_space_prefix, unk_token)
    return backend, _sentencepiece_pieces(tokens, token_types), True, add_space_prefix


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
