"""Tokenizers and chat templates.

The reference is transformers' tokenizer built from the same GGUF file
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`). Building it takes ~20 s
for Gemma's 262k vocabulary, so it is saved once into pytest's cache directory
(keyed by file, size, mtime and library versions) and reloaded from there.

Where transformers' GGUF conversion and llama.cpp disagree, we follow llama.cpp
(and the model's own tokenizer.json); those cases have their own tests below.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from minerva.errors import MinervaError
from minerva.formats.chat import (CHATML_TEMPLATE, GEMMA3_TEMPLATE, TemplateCompileError, chat_template_for,
                                  render_chat)
from minerva.formats.tokenizer import IncrementalDetokenizer, Tokenizer
from minerva.formats.tokenizer_gguf import PRE_TOKENIZERS

CORPUS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "   three leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "double  space",
    "many          spaces in          a row",
    " " * 20,
    "a" + " " * 25 + "b",
    "line one\nline two",
    "para one\n\n\npara two",
    "\n",
    "\n\n\n",
    "\n" * 34,
    "\t\t",
    "\ttab\tseparated\tvalues\t",
    " \n \n\t \r\n",
    "Caf\u00e9 d\u00e9j\u00e0 vu, na\u00efve fa\u00e7ade, \u00fcber Stra\u00dfe",
    "e\u0301 combining accent",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u4e2d\u6587\u6587\u672c",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "emoji \U0001F600\U0001F680\u2728 \U0001F44D\U0001F3FD",
    "family \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 and \U0001F3F3\ufe0f\u200d\U0001F308",
    "flags \U0001F1EF\U0001F1F5\U0001F1FA\U0001F1F8\U0001F1E9\U0001F1EA",
    "rare \U00013000 \ua66e \U0001D518\U0001D52B",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class A:\n\tdef f(self):\n\t\treturn {'k': [1, 2, 3]}  # comment\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "1 12 123 1234 12345 123456789",
    "3.14159 2.71828 -42 +7 1e-9 0x1F",
    "1,000,000 and 1.000.000 and 10%",
    "don't won't it's we're they've I'm you'll he'd",
    "DON'T SHOUT IT'S LOUD",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "text<|endoftext|>more text",
    "<bos><eos><pad>",
    "<div><span>html</span></div>",
    "URL: https://example.com/path?q=1&r=two#frag",
    "email@example.com, @handle, #hashtag, $100, ~tilde, ^caret, |pipe|",
    "mixed: English, \u4e2d\u6587, \u0627\u0644\u0639\u0631\u0628\u064a\u0629, "
    "\u0939\u093f\u0928\u094d\u0926\u0940, \U0001F600",
    "<0x41> literal byte token text",
    "zero\u200bwidth\u200bspace and nbsp\u00a0here",
    "\u00a0\u2003\u3000 unicode spaces",
    "control \x01\x02 chars \x7f",
    "\ufffd replacement char",
    "The quick brown fox jumps over the lazy dog. " * 5,
]

STREAM_TEXTS = [
    "emoji \U0001F600\U0001F680 family \U0001F468\u200d\U0001F469\u200d\U0001F467 flags \U0001F1EF\U0001F1F5",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 and \u4e2d\u6587 \U00013000\ua66e\U0001D518\U0001D52B done",
    "Caf\u00e9 \u0645\u0631\u062d\u0628\u0627 \u0928\u092e\u0938\u094d\u0924\u0947 \U0001F44D\U0001F3FD!",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer with \u00e9moji \U0001F600"},
]


# ---------------------------------------------------------------------------
# fixtures: our tokenizers and transformers' from the same files
# ---------------------------------------------------------------------------


def _metadata(path: Path) -> dict:
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}


def _reference(path: Path, config):
    """transformers' tokenizer for a GGUF, cached as a tokenizer.json in pytest's cache."""
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    st = path.stat()
    key = f"{path.name}-{st.st_size}-{st.st_mtime_ns}-tf{transformers.__version__}-tk{tokenizers.__version__}"
    cache = getattr(config, "cache", None)
    if cache is not None:
        target = Path(cache.mkdir("minerva-tokenizer-reference")) / key
        if (target / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(target))
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if cache is not None:
        tmp = target.with_name(key + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        ref.save_pretrained(str(tmp))
        try:
            os.replace(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return ref


class Pair:
    def __init__(self, name, tok, ref):
        self.name, self.tok, self.ref = name, tok, ref


def _pair(name: str, path: Path, config) -> Pair:
    return Pair(name, Tokenizer.from_gguf_metadata(_metadata(path)), _reference(path, config))


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, pytestconfig):
    return _pair("smollm2", smollm2_gguf, pytestconfig)


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf, pytestconfig):
    return _pair("gemma3", gemma3_gguf, pytestconfig)


@pytest.fixture(params=["smollm2", "gemma3"])
def pair(request) -> Pair:
    return request.getfixturevalue(request.param)


def _show(tok_or_ref, ids):
    if isinstance(tok_or_ref, Tokenizer):
        return [tok_or_ref.id_to_token(i) for i in ids]
    return tok_or_ref.convert_ids_to_tokens(ids)


# ---------------------------------------------------------------------------
# real models against transformers
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_encode_matches_transformers(pair):
    bad = []
    for text in CORPUS:
        ours, ref = pair.tok.encode(text), pair.ref.encode(text)
        if ours != ref:
            bad.append(f"{text!r}\n  ours {_show(pair.tok, ours)}\n  ref  {_show(pair.ref, ref)}")
    assert not bad, f"{pair.name}: {len(bad)} mismatches\n" + "\n".join(bad)


@pytest.mark.slow
def test_encode_without_special_tokens_matches_transformers(pair):
    for text in CORPUS:
        assert pair.tok.encode(text, add_special_tokens=False) == pair.ref.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_decode_matches_transformers_and_round_trips(pair):
    for text in CORPUS:
        ids = pair.tok.encode(text)
        for skip in (True, False):
            assert pair.tok.decode(ids, skip_special_tokens=skip) == pair.ref.decode(ids, skip_special_tokens=skip)
        plain = pair.tok.encode(text, add_special_tokens=False)
        assert pair.tok.decode(plain, skip_special_tokens=False) == text


@pytest.mark.slow
def test_token_bytes_join_to_the_texts_utf8(pair):
    """Each token's own bytes (the logprobs' `bytes`), pieces of characters included, join to
    the text's UTF-8; an id out of the vocabulary is one clear error."""
    for text in CORPUS + ["\U0001F600 \u4e2d\u6587 caf\u00e9 \U0001F9D1\u200D\U0001F52C"]:
        ids = pair.tok.encode(text, add_special_tokens=False)
        assert b"".join(pair.tok.token_bytes(i) for i in ids) == text.encode("utf-8"), text
    with pytest.raises(MinervaError, match="out of range"):
        pair.tok.token_bytes(pair.tok.vocab_size)


@pytest.mark.slow
def test_smollm2_special_tokens(smollm2):
    tok = smollm2.tok
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert not tok.add_bos
    # <|im_end|> is both EOS and the template's end of turn.
    assert tok.eos_token_ids == frozenset({2})
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.encode("") == [] and tok.encode("", add_special_tokens=False) == []
    assert tok.chat_template == smollm2.ref.chat_template


@pytest.mark.slow
def test_gemma3_special_tokens(gemma3):
    tok = gemma3.tok
    assert tok.vocab_size == 262144
    assert tok.bos_token_id == 2 and tok.eos_token_id == 1 and tok.add_bos
    # <eos> plus the built-in template's <end_of_turn>
    assert tok.eos_token_ids == frozenset({1, 106})
    assert tok.chat_template is None
    assert tok.encode("") == [2] and tok.encode("", add_special_tokens=False) == []
    assert tok.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)[0] == 105
    assert tok.encode("hi <end_of_turn>")[-1] == 106
    assert tok.encode("hi")[0] == 2 and tok.encode("hi", add_special_tokens=False)[0] != 2


@pytest.mark.slow
def test_smollm2_digits_split_like_llama_cpp(smollm2):
    """llama.cpp's 'smollm' pre-tokenizer splits every digit off before the GPT-2
    regex, as SmolLM2's own tokenizer.json does (Digits + ByteLevel). transformers'
    GGUF conversion leaves that step out, so whitespace right before a digit (or
    any Unicode number) comes out differently there; compare with transformers
    given SmolLM2's real pre-tokenizer instead."""
    from tokenizers import pre_tokenizers

    ref = smollm2.ref.backend_tokenizer
    saved = ref.pre_tokenizer
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    try:
        for text in ["  1  2   3", "x \u0661\u0662\u0663 \u00b2 \u216b", "a\t\t9\r\n7", *CORPUS]:
            assert smollm2.tok.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
    finally:
        ref.pre_tokenizer = saved
    assert smollm2.tok.encode("  1  2   3") == [256, 33, 256, 34, 333, 35]  # ĠĠ 1 ĠĠ 2 ĠĠĠ 3


@pytest.mark.slow
def test_gemma3_space_runs_like_llama_cpp(gemma3):
    """Gemma's runs of 2..31 spaces are user-defined tokens, matched whole in the
    raw text, longest first, as llama.cpp (and SentencePiece) do. transformers
    turns them into BPE merges instead; both agree up to 31 spaces."""
    tok, ref = gemma3.tok, gemma3.ref
    for n in range(2, 32):
        assert tok.encode(" " * n) == [2, tok.token_to_id(" " * n)] == ref.encode(" " * n)
    assert tok.encode(" " * 40) == [2, tok.token_to_id(" " * 31), tok.token_to_id(" " * 9)]
    assert tok.decode(tok.encode("a" + " " * 40 + "b")) == "a" + " " * 40 + "b"


@pytest.mark.slow
def test_incremental_detokenizer(pair):
    for text in STREAM_TEXTS + CORPUS:
        ids = pair.tok.encode(text)
        detok = IncrementalDetokenizer(pair.tok)
        deltas = [detok.add(i) for i in ids]
        tail = detok.flush()
        assert "".join(deltas) + tail == pair.tok.decode(ids) == detok.text
        if "\ufffd" not in text:
            assert all("\ufffd" not in d for d in deltas), (text, deltas)
            assert tail == ""
    # a character split over byte tokens is held back, then emitted whole
    ids = pair.tok.encode("\U00013000", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(pair.tok)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["\U00013000"]


@pytest.mark.slow
def test_incremental_detokenizer_on_arbitrary_ids(pair):
    """Whatever a model samples -- lone or invalid byte tokens, special tokens --
    the streamed text adds up to decode()."""
    import random

    rng = random.Random(0)
    tok = pair.tok
    # ids that are no text on their own: partial UTF-8 bytes and special tokens
    byte_like = [i for i in range(tok.vocab_size) if tok.decode([i]) in ("", "\ufffd")][:512]
    assert any(tok.decode([i]) == "\ufffd" for i in byte_like)
    for _ in range(300):
        ids = [rng.choice(byte_like) if byte_like and rng.random() < 0.5 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 24))]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            streamed = "".join(detok.add(i) for i in ids) + detok.flush()
            assert streamed == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.slow
def test_incremental_detokenizer_keeps_special_tokens_when_asked(gemma3):
    tok = gemma3.tok
    ids = tok.encode("<start_of_turn>model\nHi \U0001F600<end_of_turn>")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == "<bos><start_of_turn>model\nHi \U0001F600<end_of_turn>"


@pytest.mark.slow
def test_incremental_detokenizer_flushes_incomplete_tail(smollm2):
    tok = smollm2.tok
    ids = tok.encode("\U0001F600", add_special_tokens=False)[:-1]  # a cut-off emoji
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(i) for i in ids) == ""
    assert detok.flush() == tok.decode(ids)


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2):
    tok, ref = smollm2.tok, smollm2.ref
    bos, eos = tok.id_to_token(tok.bos_token_id), tok.id_to_token(tok.eos_token_id)
    for messages in (CONVERSATION, CONVERSATION[1:], CONVERSATION[:3]):
        for gen in (True, False):
            ours = render_chat(tok.chat_template, messages, bos_token=bos, eos_token=eos, add_generation_prompt=gen)
            assert ours == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    text = render_chat(tok.chat_template, CONVERSATION, bos_token=bos, eos_token=eos)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.encode(text) == ref.encode(text)


@pytest.mark.slow
def test_gemma3_builtin_template(gemma3):
    tok, ref = gemma3.tok, gemma3.ref
    template = chat_template_for(tok.chat_template, "gemma3")
    assert template == GEMMA3_TEMPLATE
    bos, eos = tok.id_to_token(tok.bos_token_id), tok.id_to_token(tok.eos_token_id)
    text = render_chat(template, CONVERSATION, bos_token=bos, eos_token=eos)
    assert text == (
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4.<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3? Answer with \u00e9moji \U0001F600<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ref.chat_template = GEMMA3_TEMPLATE  # the same template through transformers' renderer
    try:
        for messages in (CONVERSATION, CONVERSATION[1:]):
            for gen in (True, False):
                ours = render_chat(template, messages, bos_token=bos, eos_token=eos, add_generation_prompt=gen)
                assert ours == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    finally:
        ref.chat_template = None
    ids = tok.encode(text, add_special_tokens=False)  # the template writes <bos> itself
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and ids.count(106) == 3
    with pytest.raises(MinervaError, match="alternate"):
        render_chat(template, [{"role": "assistant", "content": "x"}], bos_token=bos, eos_token=eos)


@pytest.mark.slow
def test_from_pretrained_dir_matches_transformers(pair, tmp_path):
    pair.ref.save_pretrained(str(tmp_path))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    for text in CORPUS + [" " * 40, "  1  2   3"]:
        assert tok.encode(text) == pair.ref.encode(text), text
        ids = pair.ref.encode(text)
        assert tok.decode(ids) == pair.ref.decode(ids, skip_special_tokens=True)
    assert tok.bos_token_id == pair.tok.bos_token_id
    assert tok.chat_template == pair.ref.chat_template
    assert tok.vocab_size == pair.tok.vocab_size
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.add(i) for i in ids]
        assert "".join(deltas) + detok.flush() == tok.decode(ids) == text
        assert all("\ufffd" not in d for d in deltas)
    # a byte run with an invalid byte in it streams the same as it decodes
    ids = tok.encode("\U0001F600x\U00013000", add_special_tokens=False)
    ids = ids[:2] + ids[-3:] + ids[2:]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(i) for i in ids) + detok.flush() == tok.decode(ids)


# ---------------------------------------------------------------------------
# small synthetic vocabularies (no model files)
# ---------------------------------------------------------------------------

_BYTES = [f"<0x{b:02X}>" for b in range(256)]


def _spm_md(pieces: dict[str, float], **extra) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + _BYTES + list(pieces)
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0] + [0.0] * 256 + list(pieces.values()),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        **extra,
    }


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text, add_special_tokens=False)]


def test_spm_merges_follow_scores():
    # llama.cpp joins the pair whose joined token scores highest first.
    base = {"\u2581": -1.0, "a": -1.0, "b": -1.0, "c": -1.0}
    tok = Tokenizer.from_gguf_metadata(_spm_md({**base, "ab": -3.0, "bc": -2.0}))
    assert _pieces(tok, "abc") == ["\u2581", "a", "bc"]
    tok = Tokenizer.from_gguf_metadata(_spm_md({**base, "ab": -2.0, "bc": -3.0}))
    assert _pieces(tok, "abc") == ["\u2581", "ab", "c"]
    tok = Tokenizer.from_gguf_metadata(_spm_md({**base, "ab": -2.0, "bc": -3.0, "\u2581ab": -2.5,
                                                "\u2581abc": -4.0}))
    assert _pieces(tok, "abc") == ["\u2581abc"]
    assert _pieces(tok, "abc abc") == ["\u2581abc", "\u2581abc"]


def test_spm_defaults_byte_fallback_and_space_prefix():
    tok = Tokenizer.from_gguf_metadata(_spm_md({"\u2581": -1.0, "a": -1.0, "\u2581a": -1.5}))
    assert tok.add_bos  # SentencePiece vocabularies add BOS unless the file says otherwise
    assert tok.encode("a") == [1, tok.token_to_id("\u2581a")]
    assert _pieces(tok, "a\u00e9") == ["\u2581a", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("a \u00e9 a")) == "a \u00e9 a"  # the prefix space is stripped again
    assert _pieces(tok, "<s>a") == ["<s>", "\u2581a"]  # a space prefix after a special token too
    tok = Tokenizer.from_gguf_metadata(_spm_md({"\u2581": -1.0, "a": -1.0, "\u2581a": -1.5},
                                               **{"tokenizer.ggml.add_space_prefix": False,
                                                  "tokenizer.ggml.add_bos_token": False,
                                                  "tokenizer.ggml.add_eos_token": True}))
    assert tok.encode("a a") == [tok.token_to_id("a"), tok.token_to_id("\u2581a"), 2]
    assert tok.decode(tok.encode(" a")) == " a"


def _gpt2_md(pre: str = "gpt-2", **extra) -> dict:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "hell o", "\u0120 w", "\u0120w o", "r l", "\u0120wo rl", "\u0120worl d"]
    tokens = ["<|endoftext|>"] + alphabet + ["he", "ll", "hell", "hello", "\u0120w", "\u0120wo", "rl",
                                             "\u0120worl", "\u0120world", "<|user|>"]
    return {
        "general.architecture": "gpt2",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 2) + [4],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        **extra,
    }


def test_byte_level_bpe():
    tok = Tokenizer.from_gguf_metadata(_gpt2_md())
    assert not tok.add_bos
    assert _pieces(tok, "hello world") == ["hello", "\u0120world"]
    assert _pieces(tok, "hello<|user|>world<|endoftext|>") == ["hello", "<|user|>", "w", "o", "rl", "d",
                                                                 "<|endoftext|>"]
    text = "hello world \u00e9\U0001F600 <|user|>"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("x<|endoftext|>"), skip_special_tokens=False) == "x<|endoftext|>"
    assert tok.decode(tok.encode("x<|endoftext|>")) == "x"
    assert Tokenizer.from_gguf_metadata(_gpt2_md("llama-bpe")).add_bos  # llama.cpp's default for llama3
    assert not Tokenizer.from_gguf_metadata(_gpt2_md("llama-bpe", **{"tokenizer.ggml.add_bos_token": False})).add_bos


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_known_pre_tokenizers_build(pre):
    tok = Tokenizer.from_gguf_metadata(_gpt2_md(pre))
    text = "hello world 12345 it's  \u00e9 \u4e2d\u6587\n\n\tx"
    assert tok.decode(tok.encode(text)) == text


def test_eot_and_eom_ids_end_generation():
    md = _gpt2_md(**{"tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.eom_token_id": 6})
    assert Tokenizer.from_gguf_metadata(md).eos_token_ids == frozenset({0, 5, 6})


def test_unknown_tokenizer_model():
    with pytest.raises(MinervaError, match="'rwkv'") as e:
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a", "b"]})
    assert "\n" not in str(e.value)
    with pytest.raises(MinervaError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata({"general.architecture": "llama"})


def test_unknown_pre_tokenizer():
    with pytest.raises(MinervaError, match="'made-up-pre'"):
        Tokenizer.from_gguf_metadata(_gpt2_md("made-up-pre"))


def test_gpt2_without_merges():
    md = _gpt2_md()
    del md["tokenizer.ggml.merges"]
    with pytest.raises(MinervaError, match="merges"):
        Tokenizer.from_gguf_metadata(md)


def test_from_pretrained_dir_needs_tokenizer_json(tmp_path):
    with pytest.raises(MinervaError, match="tokenizer.json"):
        Tokenizer.from_pretrained_dir(tmp_path)


def test_from_pretrained_dir_reads_configs(tmp_path):
    gguf_tok = Tokenizer.from_gguf_metadata(_gpt2_md())
    gguf_tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": {"content": "<|user|>"}, "add_bos_token": True,
        "chat_template": CHATML_TEMPLATE,
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    user = tok.token_to_id("<|user|>")
    assert tok.bos_token_id == 0 and tok.eos_token_id == user
    assert tok.eos_token_ids == frozenset({0, 7, user})
    assert tok.add_bos and tok.encode("hello") == [0, tok.token_to_id("hello")]
    assert tok.chat_template == CHATML_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_pretrained_dir(tmp_path).chat_template == "{{ messages[0]['content'] }}"


def test_from_pretrained_dir_leaves_out_ids_outside_the_vocabulary(tmp_path, caplog):
    """BOS/EOS ids in generation_config.json or config.json that are no token of the vocabulary
    (past it, negative, not an integer) are each a warning naming the file, and left out."""
    gguf_tok = Tokenizer.from_gguf_metadata(_gpt2_md())
    gguf_tok.backend.save(str(tmp_path / "tokenizer.json"))
    n = gguf_tok.backend.get_vocab_size(with_added_tokens=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": n + 5, "eos_token_id": "x"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "bos_token_id": 3,
                                                      "eos_token_id": [-5, 99999, 7, True]}))
    with caplog.at_level(logging.WARNING, logger="minerva"):
        tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.bos_token_id == 3 and tok.encode("hello")[0] == 3  # config.json's, the first one in range
    assert tok.eos_token_ids == frozenset({7})
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 5, warned
    assert f"generation_config.json: bos_token_id {n + 5} is no token id of this vocabulary (0 to {n - 1})" in warned[0]
    assert 'generation_config.json: eos_token_id "x" is no token id' in warned[1]
    assert all("config.json: eos_token_id" in w and "left out" in w for w in warned[2:])
    assert [w.split("eos_token_id ")[1].split()[0] for w in warned[2:]] == ["-5", "99999", "true"]


def test_from_pretrained_dir_neither_cuts_nor_pads_a_prompt(tmp_path):
    """A truncation or padding block saved in tokenizer.json (a training-time setting) is off,
    as transformers has it: a prompt keeps every token and gets none added."""
    gguf_tok = Tokenizer.from_gguf_metadata(_gpt2_md())
    text = "hello world hello world hello world"
    want = gguf_tok.encode(text, add_special_tokens=False)
    assert len(want) > 3
    saved = json.loads(gguf_tok.backend.to_str())
    saved["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
    saved["padding"] = {"strategy": {"Fixed": 40}, "direction": "Right", "pad_to_multiple_of": None,
                        "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(saved))
    assert Tokenizer.from_pretrained_dir(tmp_path).encode(text, add_special_tokens=False) == want


def test_a_chat_template_file_that_is_not_utf8_is_named(tmp_path):
    Tokenizer.from_gguf_metadata(_gpt2_md()).backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff{{ messages }}")
    with pytest.raises(MinervaError, match=r"chat_template.jinja: cannot read the chat template \('utf-8' codec"):
        Tokenizer.from_pretrained_dir(tmp_path)


# ---------------------------------------------------------------------------
# chat templates: sandbox, helpers, errors
# ---------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "hi"}]

MALICIOUS = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__.os }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ self.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ messages[0].items.__self__ }}",
    "{% set x = messages.append({'role': 'user', 'content': 'x'}) %}",
    "{% set x = messages[0].update({'role': 'x'}) %}",
    "{% set ns = namespace(_secret=1) %}",
    "{{ (messages|attr('__class__')) }}",
]


@pytest.mark.parametrize("template", MALICIOUS)
def test_sandbox_blocks_python_internals(template):
    with pytest.raises(MinervaError) as e:
        render_chat(template, MSGS, bos_token="<s>", eos_token="</s>")
    message = str(e.value)
    assert "\n" not in message
    for leak in ("<class", "<function", "<built-in", "<module", "__builtins__", "popen"):
        assert leak not in message


def test_template_helpers():
    text = render_chat("{{ messages|tojson }}", [{"role": "user", "content": "\u00e9<&>"}], bos_token="", eos_token="")
    assert text == '[{"role": "user", "content": "\u00e9<&>"}]'
    assert render_chat("{{ messages[0]|tojson(indent=2, sort_keys=True) }}", MSGS, bos_token="", eos_token="") == (
        '{\n  "content": "hi",\n  "role": "user"\n}')
    assert render_chat("{{ strftime_now('%Y') }}", MSGS, bos_token="", eos_token="") == str(datetime.now().year)
    looped = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
              "{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }};{% endfor %}")
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_chat(looped, msgs, bos_token="", eos_token="") == "a;"
    assert render_chat("{{ bos_token }}{% generation %}{{ eos_token }}{% endgeneration %}", MSGS,
                       bos_token="<s>", eos_token="</s>") == "<s></s>"
    ns = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    assert render_chat(ns, msgs, bos_token="", eos_token="") == "3"
    assert render_chat("{{ dict(a=1)|tojson }}", MSGS, bos_token="", eos_token="") == '{"a": 1}'
    # trim_blocks / lstrip_blocks
    assert render_chat("  {% if true %}\nx\n  {% endif %}\n", MSGS, bos_token="", eos_token="") == "x\n"
    assert render_chat("{{ add_generation_prompt }}", MSGS, bos_token="", eos_token="",
                       add_generation_prompt=False) == "False"


@pytest.mark.parametrize("template,match", [
    ("{% for %}", "invalid chat template"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{{ messages[5].content.upper() }}", "chat template error"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("", "empty"),
])
def test_template_errors(template, match):
    """Each one line; only a template that does not compile is a TemplateCompileError (the
    server's fault, a 500), not one that refuses the conversation or fails rendering it."""
    with pytest.raises(MinervaError, match=match) as e:
        render_chat(template, MSGS, bos_token="", eos_token="")
    assert "\n" not in str(e.value)
    assert isinstance(e.value, TemplateCompileError) == (template == "{% for %}")


@pytest.mark.parametrize("messages", [
    "hi",
    [],
    ["hi"],
    [{"content": "hi"}],
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": 3, "content": "hi"}],
    [{"role": "user", "content": "hi", "extra": object()}],
])
def test_invalid_messages(messages):
    with pytest.raises(MinervaError):
        render_chat(CHATML_TEMPLATE, messages, bos_token="", eos_token="")


def test_chat_template_for():
    assert chat_template_for("{{ x }}", "gemma3") == "{{ x }}"
    assert chat_template_for(None, "gemma3") == GEMMA3_TEMPLATE
    assert chat_template_for("", "gemma3") == GEMMA3_TEMPLATE
    assert chat_template_for(None, "llama") == CHATML_TEMPLATE
    assert render_chat(CHATML_TEMPLATE, MSGS, bos_token="", eos_token="") == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
