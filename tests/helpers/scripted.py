"""Tiny GGUF models whose "model" writes a recorded reply: the engine, the detokenizer, the stop
rules and the server run as they are; only the sampler is stood in for."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from tests.helpers.tiny_gguf import TINY_CONTEXT, write_tiny_llama

HARMONY_TOKENS = ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>")
# Written for these tests in the shape of GPT-OSS's template: a system message that names the
# reasoning effort (its default "medium"), the messages, and `<|start|>assistant` to answer.
HARMONY_TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
                    "{% for m in messages %}<|start|>{{ m.role }}"
                    "{% if m.role == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>"
                    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
# In the shape of Qwen3's: ChatML, and with enable_thinking false an empty think block in the prompt.
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")


def write_harmony_model(path: Path) -> Path:
    """A tiny llama with harmony's special tokens (control tokens, as in GPT-OSS's GGUF) and a harmony template."""
    return write_tiny_llama(path, context=TINY_CONTEXT, chat_template=HARMONY_TEMPLATE, special_tokens=HARMONY_TOKENS)


def write_think_model(path: Path) -> Path:
    """A tiny llama with a think-tag template; its vocabulary spells <think> in several byte tokens."""
    return write_tiny_llama(path, context=TINY_CONTEXT, chat_template=THINK_TEMPLATE,
                            special_tokens=("<|im_start|>", "<|im_end|>"))


class Script:
    """Stands in for `minerva.engine.runner.sample_batch`: a request's i-th sampled token is
    `tokens[i]` whatever its logits (the last one again once the script runs out)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.drawn: dict[int, tuple] = {}  # id(state) -> (state, tokens drawn for it)

    def __call__(self, logits, states) -> list[int]:
        out = []
        for s in states:  # counted here: a decode burst draws several before the engine records them
            i = self.drawn.get(id(s), (s, 0))[1]
            self.drawn[id(s)] = (s, i + 1)  # the state kept, so its id is not reused
            out.append(self.tokens[min(i, len(self.tokens) - 1)])
        return out

    def say(self, tokenizer, text: str, stop: int | None = None) -> list[int]:
        """Script `text` (its special tokens as their ids), then `stop`; returns the ids."""
        self.tokens = tokenizer.encode(text, add_special_tokens=False) + ([stop] if stop is not None else [])
        return self.tokens


@contextlib.contextmanager
def scripted():
    """A `Script` in place of the sampler while the context lasts."""
    script = Script()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("minerva.engine.runner.sample_batch", script)
        yield script
