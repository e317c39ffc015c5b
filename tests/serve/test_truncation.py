"""The Responses API's truncation "auto": which cuts a conversation has, that the smallest cut
that fits is found in a few renderings, and a real template that wants alternating roles
(Gemma 3's) served a long conversation."""

from __future__ import annotations

import asyncio
import math

import openai
import pytest

from minerva import LLM
from minerva.serve.convert import ContextError
from minerva.serve.truncation import Cuts, fitting
from tests.helpers.server import running_server


def test_whole_turns_go_first_then_the_last_turns_oldest_steps():
    roles = ["system", "user", "assistant", "user", "assistant", "tool", "developer", "user", "assistant", "tool",
             "assistant", "tool", "assistant", "tool"]
    assert list(Cuts(roles)) == [
        [0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],  # the first turn
        [0, 6, 7, 8, 9, 10, 11, 12, 13],  # the second: the rest starts at the last user message
        [0, 6, 7, 10, 11, 12, 13],  # then the last turn's first step (a call and its result)
        [0, 6, 7, 12, 13],  # its latest step stays
    ]
    assert list(Cuts(["system", "user"])) == [] and list(Cuts(["system", "assistant"])) == []
    assert list(Cuts(["assistant", "tool", "user"])) == [[2]]  # a conversation that starts without a user message


@pytest.mark.parametrize("fits", [0, 1, 2, 5, 6, 7, 8, 9, 100, 998, 999, 1000])
def test_the_smallest_cut_that_fits_in_a_few_tries(fits):
    """The smallest cut that fits, found in a few tries that render (beside the whole
    conversation, once) a few times what fits, however long the conversation."""
    roles = ["system"] + ["user", "assistant"] * 1000 + ["user"]
    items = list(range(len(roles)))
    tries = []

    async def attempt(kept):
        tries.append(len(kept))
        if len(kept) > 1 + 2 * fits + 1:  # fits: the number of earlier turns that fit beside the last
            raise ContextError("too long")
        return kept

    kept = asyncio.run(fitting(items, roles, attempt))
    assert kept == [0] + items[len(items) - 1 - 2 * fits:]
    assert len(tries) <= 2 + 2 * math.ceil(math.log2(len(Cuts(roles)))) + 1
    assert tries[0] == len(items)  # the whole conversation once, then about what fits each try
    assert sum(tries[1:]) <= len(kept) * (4 + 2 * math.log2(len(kept))), tries
    assert fits > 9 or sum(tries[1:]) <= 8 * len(kept) + 16, tries  # a context that holds a few turns


def test_nothing_fits_is_the_largest_cuts_error():
    """Where even the largest cut does not fit, the error is that cut's (what the client must
    change is what is left), said to be after the cut."""
    async def attempt(kept):
        raise ContextError(f"{len(kept)} items")

    with pytest.raises(ContextError, match=r'^even cut as far as truncation "auto" cuts \(.*\), the conversation '
                                           r"does not fit: 1 items$"):
        asyncio.run(fitting(list(range(5)), ["user", "assistant", "user", "assistant", "user"], attempt))


@pytest.mark.slow
def test_a_template_that_wants_alternating_roles(gemma3_gguf):
    llm = LLM(str(gemma3_gguf), device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=32e6)
    turns = []
    for i in range(6):
        turns += [{"role": "user", "content": f"Remember fact number {i}: the colour of box {i} is shade {i}."},
                  {"role": "assistant", "content": f"Noted: box {i} is shade {i}."}]
    ask = [{"role": "user", "content": "Which shade is box 5?"}]
    with running_server(llm, served_model_name="gemma") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.responses.create(model="gemma", input=turns + ask, max_output_tokens=64)
        r = client.responses.create(model="gemma", input=turns + ask, max_output_tokens=64, truncation="auto",
                                    temperature=0)
        kept = None
        for k in range(0, len(turns) + 1, 2):  # the longest run of whole turns that fits, by the chat route
            try:
                kept = client.chat.completions.create(model="gemma", messages=turns[k:] + ask, max_tokens=64,
                                                      temperature=0)
                break
            except openai.BadRequestError:
                continue
        assert kept is not None and 0 < k < len(turns)
        assert r.usage.input_tokens == kept.usage.prompt_tokens and r.output_text == kept.choices[0].message.content
        stream = client.responses.create(model="gemma", input=turns + ask, max_output_tokens=64, truncation="auto",
                                         temperature=0, stream=True)
        done = [e.response for e in stream if e.type in ("response.completed", "response.incomplete")]
        assert done[0].output_text == r.output_text
    llm.close()
