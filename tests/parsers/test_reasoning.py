"""Reasoning parsers (minerva/parsers/reasoning.py) on recorded output streams, and how a model's
format, decoding and stop tokens are chosen from its tokenizer.

The streams are written the way the models write them: harmony as OpenAI's harmony format
describes GPT-OSS's replies, think tags as Qwen3's chat template renders a reply with its
reasoning. A parser's result must not depend on how the stream was cut into pieces."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from minerva.parsers.reasoning import (HARMONY, HARMONY_MARKERS, THINK, format_for, reasoning_for, route,
                                       split_text)
from minerva.formats.tokenizer import Tokenizer

REASONING = "The user greets me. I should greet back, briefly."
ANSWER = "Hello! How can I help you today?"
GENERATION_PROMPT = "<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>Hi<|end|>" \
                    "<|start|>assistant"


def harmony(*messages: tuple[str, str], end: str = "<|return|>") -> str:
    """A reply of (header after the role, body) messages, as GPT-OSS writes one after `<|start|>assistant`."""
    parts = []
    for i, (header, body) in enumerate(messages):
        last = i == len(messages) - 1
        parts.append(("" if i == 0 else "<|start|>assistant") + header + "<|message|>" + body
                     + (end if last else "<|end|>"))
    return "".join(parts)


FULL = harmony(("<|channel|>analysis", REASONING), ("<|channel|>final", ANSWER))
QWEN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
THINKING = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"


def pieces(parser, chunks: list[str]) -> list[tuple[str, str]]:
    """What the parser gives for each chunk, the last with `finish`."""
    out = [parser.feed(c) for c in chunks]
    return out + [parser.finish()]


def joined(deltas: list[tuple[str, str]]) -> tuple[str, str]:
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas)


def no_marker_leaks(deltas: list[tuple[str, str]], markers) -> None:
    for r, c in deltas:
        for m in markers:
            assert m not in r and m not in c, (m, r, c)


# ------------------------------------------------------------------ harmony


def test_harmony_full_reply():
    assert split_text(HARMONY, GENERATION_PROMPT, FULL) == (REASONING, ANSWER)


def test_harmony_every_split_point_gives_the_whole_result():
    whole = joined(pieces(HARMONY.parser(GENERATION_PROMPT), [FULL]))
    assert whole == (REASONING, ANSWER)
    for cut in range(len(FULL) + 1):
        deltas = pieces(HARMONY.parser(GENERATION_PROMPT), [FULL[:cut], FULL[cut:]])
        assert joined(deltas) == whole, cut
        no_marker_leaks(deltas, HARMONY_MARKERS)


def test_harmony_character_by_character():
    deltas = pieces(HARMONY.parser(GENERATION_PROMPT), list(FULL))
    assert joined(deltas) == (REASONING, ANSWER)
    no_marker_leaks(deltas, HARMONY_MARKERS + ("<|", "|>"))
    # the reasoning arrives as it is written, not at the end
    assert sum(1 for r, _ in deltas if r) > len(REASONING) // 2


def test_harmony_marker_cut_across_two_pieces():
    parser = HARMONY.parser(GENERATION_PROMPT)
    first = parser.feed("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|chan")
    assert first == ("Think.", "")
    second = parser.feed("nel|>final<|mess")
    assert second == ("", "")
    assert parser.feed("age|>Done") == ("", "Done")
    assert parser.finish() == ("", "")


def test_harmony_analysis_only_cut_off():
    """max_tokens ran out while the model was still reasoning: no answer yet."""
    cut = harmony(("<|channel|>analysis", REASONING))[:-len("<|return|>")]
    cut = cut[:len(cut) - 10]
    assert split_text(HARMONY, GENERATION_PROMPT, cut) == (REASONING[:-10], "")


def test_harmony_cut_off_in_a_header():
    cut = harmony(("<|channel|>analysis", REASONING)).replace("<|return|>", "<|end|>") + "<|start|>assistant<|cha"
    assert split_text(HARMONY, GENERATION_PROMPT, cut) == (REASONING, "")


def test_harmony_final_only():
    assert split_text(HARMONY, GENERATION_PROMPT, harmony(("<|channel|>final", ANSWER))) == (None, ANSWER)


def test_harmony_commentary_and_tool_calls():
    """A preamble on the commentary channel is reasoning; a message to a tool is dropped."""
    reply = harmony(("<|channel|>analysis", "Need the weather."),
                    ("<|channel|>commentary", "Let me look that up."),
                    ("<|channel|>commentary to=functions.get_weather <|constrain|>json", '{"city": "Oslo"}'),
                    end="<|call|>")
    assert split_text(HARMONY, GENERATION_PROMPT, reply) == ("Need the weather.\n\nLet me look that up.", "")
    assert route(" to=functions.get_weather<|channel|>commentary <|constrain|>json") is None
    assert route("user<|channel|>final") is None  # another role's message is not the reply


def test_harmony_prompt_decides_the_start():
    """A prompt that already opened the final channel: the output is the answer's continuation."""
    prefilled = GENERATION_PROMPT + "<|channel|>final<|message|>Hel"
    assert split_text(HARMONY, prefilled, "lo there<|return|>") == (None, "lo there")
    assert split_text(HARMONY, "", FULL) == (REASONING, ANSWER)  # no prompt: a header comes first


def test_harmony_text_that_only_looks_like_a_marker():
    reply = harmony(("<|channel|>final", "Use <|x|> or a <| b"))
    assert split_text(HARMONY, GENERATION_PROMPT, reply) == (None, "Use <|x|> or a <| b")


# ------------------------------------------------------------------ think tags


def test_think_full_reply_and_every_split_point():
    assert split_text(THINK, QWEN_PROMPT, THINKING) == (REASONING, ANSWER)
    for cut in range(len(THINKING) + 1):
        deltas = pieces(THINK.parser(QWEN_PROMPT), [THINKING[:cut], THINKING[cut:]])
        assert joined(deltas) == (REASONING, ANSWER), cut
        no_marker_leaks(deltas, ("<think>", "</think>"))


def test_think_output_starting_inside_the_block():
    """The template opened <think> in the prompt: the output shows only </think>."""
    prompt = QWEN_PROMPT + "<think>\n"
    output = THINKING.removeprefix("<think>\n")
    for cut in range(len(output) + 1):
        deltas = pieces(THINK.parser(prompt), [output[:cut], output[cut:]])
        assert joined(deltas) == (REASONING, ANSWER), cut
    # the same output after a prompt that did not open the block: the stray </think> is dropped
    assert split_text(THINK, QWEN_PROMPT, output) == (None, output.replace("</think>", ""))


def test_think_without_thinking_passes_content_through():
    closed = QWEN_PROMPT + "<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking=False
    assert split_text(THINK, closed, ANSWER) == (None, ANSWER)


def test_think_cut_off_while_thinking():
    assert split_text(THINK, QWEN_PROMPT, "<think>\nStill going") == ("Still going", "")


def test_no_format_passes_text_through():
    assert split_text(None, "", THINKING) == (None, THINKING)


# ------------------------------------------------------------------ choosing a format


@pytest.mark.parametrize("architecture,template,want", [
    ("gpt-oss", None, HARMONY), ("gpt_oss", None, HARMONY), ("qwen3", None, THINK), ("qwen3moe", None, THINK),
    ("llama", "{{ '<|start|>' + m + '<|channel|>x<|message|>' }}", HARMONY),
    ("llama", "{% if thinking %}<think>{% endif %}", THINK),
    ("llama", "{{ messages }}", None), ("gemma3", None, None), (None, None, None),
])
def test_format_by_template_then_architecture(architecture, template, want):
    got = format_for(architecture, template)
    assert (got.name if got else None) == (want.name if want else None)


HARMONY_VOCAB = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                 "<|return|>", "<|call|>"]
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def _gguf_md(extra_tokens: list[str], token_type: int, **md) -> dict:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + extra_tokens
    return {"general.architecture": "gpt-oss", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.token_type": [1] * len(alphabet) + [token_type] * len(extra_tokens),
            "tokenizer.ggml.bos_token_id": 0, **md}


@pytest.mark.parametrize("ends", [{"tokenizer.ggml.eos_token_id": "<|return|>"},
                                  {"tokenizer.ggml.eos_token_id": "<|endoftext|>",
                                   "tokenizer.ggml.eot_token_id": "<|end|>"}])
def test_gpt_oss_gguf_stops_at_return_and_call_not_end(ends):
    """As llama.cpp: <|end|> closes the analysis message, so only <|return|> and <|call|> end a reply,
    whichever ids the file names as EOS / end of turn (and though the template writes <|end|>)."""
    alphabet = len(pre_tokenizers.ByteLevel.alphabet())
    ids = {t: alphabet + i for i, t in enumerate(HARMONY_VOCAB)}
    md = _gguf_md(HARMONY_VOCAB, 3, **{k: ids[v] for k, v in ends.items()}, **{"tokenizer.chat_template": TEMPLATE})
    tok = Tokenizer.from_gguf_metadata(md)
    assert {ids["<|return|>"], ids["<|call|>"]} <= tok.eos_token_ids
    assert ids["<|end|>"] not in tok.eos_token_ids
    fmt = reasoning_for(tok)
    assert fmt.name == "harmony" and not fmt.skip_special_tokens  # its markers are special tokens
    marked = tok.encode("<|channel|>final<|message|>Hi", add_special_tokens=False)
    assert tok.decode(marked) == "finalHi"  # what a plain decode would hand the parser
    assert tok.decode(marked, skip_special_tokens=False) == "<|channel|>final<|message|>Hi"


def test_gpt_oss_tokenizer_json_stops_at_return_and_call_not_end(tmp_path):
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_VOCAB])
    backend.save(str(tmp_path / "tokenizer.json"))
    ids = {t: backend.token_to_id(t) for t in HARMONY_VOCAB}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>", "chat_template": TEMPLATE}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|endoftext|>"]]}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.eos_token_ids == frozenset({ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"]})
    assert reasoning_for(tok).skip_special_tokens is False


@pytest.mark.parametrize("token_type,skip", [(4, True), (3, False)])
def test_think_tags_keep_special_tokens_only_when_they_are_special(token_type, skip):
    """Qwen3's <think> is an ordinary added token (user-defined): decoding keeps it anyway, and
    no other special token may leak into the answer; a vocabulary where it is a control token
    must be decoded with special tokens kept for the parser to see it."""
    md = _gguf_md(["<think>", "</think>"], token_type, **{"general.architecture": "qwen3",
                                                         "tokenizer.ggml.eos_token_id": 1})
    tok = Tokenizer.from_gguf_metadata(md)
    fmt = reasoning_for(tok)
    assert fmt.name == "think" and fmt.skip_special_tokens is skip
    assert "<think>" in tok.decode(tok.encode("<think>x", add_special_tokens=False), fmt.skip_special_tokens)


def test_other_models_have_no_format():
    md = _gguf_md([], 1, **{"general.architecture": "llama", "tokenizer.ggml.eos_token_id": 1})
    assert reasoning_for(Tokenizer.from_gguf_metadata(md)) is None
