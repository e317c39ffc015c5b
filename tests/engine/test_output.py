"""OutputProcessor's streamed text around stop strings, driven token by token with the
tiny model's byte-level tokenizer. Reference: the rule worked out by hand (hold back
only the longest end of the text that some stop string starts with) and, for random
texts, the same rule written as a brute-force search."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minerva.engine.output import OutputProcessor
from minerva.engine.sampler import SamplingParams
from minerva.formats.gguf import GGUFFile
from minerva.formats.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(tiny).metadata)


def stream(tokenizer, text: str, stop: tuple[str, ...]) -> tuple[list[tuple[str, str]], str | None]:
    """Feed `text` token by token: (text so far, streamed so far) after each token, and the
    finish reason."""
    out = OutputProcessor("r", tokenizer, SamplingParams(max_tokens=1000, stop=stop))
    ids = tokenizer.encode(text, add_special_tokens=False)
    seen, streamed, finish = [], "", None
    for token in ids:
        _, finish = out.add(token, last_allowed=False)
        delta = out.delta(finish)
        streamed += delta.text if delta else ""
        seen.append((out.text, streamed))
        if finish:
            break
    return seen, finish


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """The longest end of `text` that is a proper beginning of some stop string (brute force)."""
    return max((k for s in stops for k in range(len(s)) if k <= len(text) and text.endswith(s[:k])), default=0)


def test_text_no_stop_can_start_is_streamed_at_once(tokenizer):
    seen, finish = stream(tokenizer, "hello world", ("THE END OF THE STORY",))
    assert finish is None
    assert all(streamed == text for text, streamed in seen)  # nothing held back, ever
    assert seen[-1][0] == "hello world"


def test_only_the_start_of_a_stop_string_is_held_back(tokenizer):
    seen, _ = stream(tokenizer, "hello THE END", ("THE END OF THE STORY",))
    assert seen[-1] == ("hello THE END", "hello ")
    seen, finish = stream(tokenizer, "hello THE END OF THE STORY and more", ("THE END OF THE STORY",))
    assert finish == "stop" and seen[-1] == ("hello ", "hello ")


@pytest.mark.parametrize("text,stops,streamed", [
    ("xab", ("abc", "bcd"), "x"),  # "ab" starts abc
    ("xbc", ("abc", "bcd"), "x"),  # "bc" starts bcd
    ("xaaa", ("aab",), "xa"),  # "aaa" starts no stop, "aa" does
    ("x b", ("c", "bb"), "x "),
    ("x a", ("c", "bb"), "x a"),  # a one-character stop is found whole or not at all
    ("a b", ("b c d e",), "a "),
])
def test_hold_back_by_hand(tokenizer, text, stops, streamed):
    seen, finish = stream(tokenizer, text, stops)
    assert finish is None and seen[-1] == (text, streamed)


@settings(max_examples=200, deadline=None)
@given(text=st.text("ab c", max_size=30), stops=st.lists(st.text("ab c", min_size=1, max_size=6), min_size=1,
                                                            max_size=3))
def test_streamed_text_is_everything_but_a_possible_stop_start(tokenizer, text, stops):
    stops = tuple(stops)
    seen, finish = stream(tokenizer, text, stops)
    for so_far, streamed in seen[:-1] if finish else seen:
        assert streamed == so_far[:len(so_far) - held_back(so_far, stops)]
    if finish:  # cut where the stop string that completed first starts, and all of that streamed
        n = next(n for n in range(1, len(text) + 1) if any(s in text[:n] for s in stops))
        assert seen[-1] == (text[:min(text.find(s) for s in stops if s in text[:n])],) * 2
    else:
        assert not any(s in text for s in stops)
