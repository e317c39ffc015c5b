"""The server's conversions alone (no model, no server): request bodies to `SamplingParams`, the
API's request rules, and results to OpenAI's shapes, checked against the `openai` package's own
pydantic types (the schema its client parses) and the server's published response models."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from minerva.engine.sampler import SamplingParams, TokenLogprob
from minerva.errors import MinervaError
from minerva.serve import convert
from minerva.serve import protocol as P
from minerva.serve import response_bodies as R
from minerva.serve.convert import APIError, Reply

CHAT = [{"role": "user", "content": "Hi"}]
TEXTS = {0: "Hel", 1: "lo", 2: " wörld", 3: "!"}  # a toy vocabulary; ö is two bytes in UTF-8


def token_text(token_id: int) -> str:
    return TEXTS[token_id]


def lp(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token_id, logprob, top)


HEAD = {"id": "x-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}


def chat_reply(logprobs: bool = False) -> Reply:
    return Reply(True, logprobs, HEAD, token_text)


def text_reply(logprobs: bool = False) -> Reply:
    return Reply(False, logprobs, {**HEAD, "object": "text_completion"}, token_text)


def parse_event(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event[len("data: "):])


# ------------------------------------------------------------------ requests


def test_sampling_params_from_a_chat_body():
    body = P.ChatCompletionRequest(messages=CHAT, max_tokens=5, max_completion_tokens=9, n=2, temperature=0.5,
                                   top_k=-1, top_p=0.9, min_p=0.1, seed=3, stop="\n", logit_bias={"7": -100},
                                   logprobs=True, top_logprobs=4, ignore_eos=True, speculative_tokens=2)
    assert convert.chat_max_tokens(body) == 9  # max_completion_tokens wins over the older max_tokens
    assert convert.chat_logprobs_count(body) == 4
    params = convert.sampling_params(body, convert.chat_max_tokens(body), convert.chat_logprobs_count(body))
    assert params == SamplingParams(max_tokens=9, n=2, temperature=0.5, top_k=0, top_p=0.9, min_p=0.1, seed=3,
                                    stop=("\n",), logit_bias={7: -100}, logprobs=4, ignore_eos=True,
                                    speculative_tokens=2)


def test_chat_max_tokens_and_logprobs_defaults():
    body = P.ChatCompletionRequest(messages=CHAT, max_tokens=5)
    assert convert.chat_max_tokens(body) == 5
    assert convert.chat_max_tokens(P.ChatCompletionRequest(messages=CHAT)) is None
    assert convert.chat_logprobs_count(body) is None  # no logprobs asked for
    assert convert.chat_logprobs_count(P.ChatCompletionRequest(messages=CHAT, logprobs=True)) == 0


@pytest.mark.parametrize("stop,want", [("x", ("x",)), (["a", "bc"], ("a", "bc")), (None, ())])
def test_stop_string_or_list(stop, want):
    body = P.CompletionRequest(prompt="p", stop=stop)
    assert convert.sampling_params(body, 4, None).stop == want


def test_logit_bias_keys_become_token_ids():
    assert convert.logit_bias({"0": 1.5, "42": -100}) == {0: 1.5, 42: -100}
    assert convert.logit_bias(None) == {}
    with pytest.raises(APIError) as e:
        convert.logit_bias({"hello": 1})
    assert e.value.status == 400 and e.value.param == "logit_bias" and "'hello'" in e.value.message


@pytest.mark.parametrize("key", ["-1", "+1", " 1", "1_0", "\u0661", "01", "", "9" * 5000])
def test_logit_bias_key_is_plain_digits(key):
    with pytest.raises(APIError, match="logit_bias key") as info:
        convert.sampling_params(P.CompletionRequest(prompt="p", logit_bias={key: 2}), 4, None)
    assert info.value.status == 400 and info.value.param == "logit_bias"


@pytest.mark.parametrize("prompt_len,asked,limit,want", [(10, None, 100, 90), (10, 90, 100, 90), (10, 1, 100, 1),
                                                         (99, None, 100, 1)])
def test_max_tokens_within_the_context(prompt_len, asked, limit, want):
    assert convert.max_tokens_within(prompt_len, asked, limit, "prompt") == want


@pytest.mark.parametrize("prompt_len,asked,more", [(10, 91, " and max_tokens asks for 91 more"),
                                                   (100, None, ""), (150, 1, " and max_tokens asks for 1 more")])
def test_max_tokens_beyond_the_context_is_400(prompt_len, asked, more):
    with pytest.raises(APIError) as e:
        convert.max_tokens_within(prompt_len, asked, 100, "messages")
    assert e.value.status == 400 and e.value.param == "messages"
    assert e.value.message.startswith(f"this model's maximum context length is 100 tokens, but the prompt has "
                                      f"{prompt_len} tokens{more};")
    assert e.value.message.endswith("shorten the prompt or lower max_tokens")


def test_a_prompt_that_fills_the_context_under_ollamas_rule_names_no_max_tokens():
    """Ollama's num_predict is cut at the context: only the prompt can be too long there."""
    assert convert.max_tokens_within(90, 50, 100, "prompt", to_context=True) == 10
    with pytest.raises(APIError) as e:
        convert.max_tokens_within(100, 50, 100, "prompt", to_context=True)
    assert e.value.message.endswith("has 100 tokens; shorten the prompt") and "max_tokens" not in e.value.message


def test_completion_prompts():
    assert convert.completion_prompts(P.CompletionRequest(prompt="a")) == ["a"]
    assert convert.completion_prompts(P.CompletionRequest(prompt=[1, 2])) == [[1, 2]]
    assert convert.completion_prompts(P.CompletionRequest(prompt=["a", "b"])) == ["a", "b"]
    assert convert.completion_prompts(P.CompletionRequest(prompt=[[1], [2, 3]])) == [[1], [2, 3]]
    for body, param in [(dict(prompt=[]), "prompt"), (dict(prompt=["a"] * (P.MAX_PROMPTS + 1)), "prompt"),
                        (dict(prompt="a", suffix="z"), "suffix"), (dict(prompt="a", echo=True, logprobs=1), "echo")]:
        with pytest.raises(APIError) as e:
            convert.completion_prompts(P.CompletionRequest(**body))
        assert e.value.status == 400 and e.value.param == param


def test_chat_messages_join_content_parts():
    body = P.ChatCompletionRequest(messages=[{"role": "system", "content": ""},
                                             {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}])
    assert convert.chat_messages(body.messages) == [{"role": "system", "content": ""},
                                                    {"role": "user", "content": "ab"}]


# ------------------------------------------------------------------ numbers


def test_finite():
    assert convert.finite(-0.5) == -0.5 and convert.finite(-math.inf) == -9999.0
    assert convert.finite(math.nan) == -9999.0


def test_chat_logprobs():
    items = [lp(0, -0.1, (0, -0.1), (1, -math.inf)), lp(2, -2.0, (3, -1.0), (2, -2.0))]
    got = convert.chat_logprobs(items, lambda i: token_text(i).encode())
    assert got == [
        {"token": "Hel", "logprob": -0.1, "bytes": list(b"Hel"),
         "top_logprobs": [{"token": "Hel", "logprob": -0.1, "bytes": list(b"Hel")},
                          {"token": "lo", "logprob": -9999.0, "bytes": list(b"lo")}]},
        {"token": " wörld", "logprob": -2.0, "bytes": list(" wörld".encode()),
         "top_logprobs": [{"token": "!", "logprob": -1.0, "bytes": [33]},
                          {"token": " wörld", "logprob": -2.0, "bytes": list(" wörld".encode())}]}]
    assert len(got[1]["bytes"]) == 7  # bytes, not characters


def test_completion_logprobs_offsets_count_characters():
    items = [lp(0, -0.1, (0, -0.1)), lp(2, -0.2, (2, -0.2), (3, -math.inf)), lp(3, -0.3)]
    got = convert.completion_logprobs(items, 5, token_text, lambda i: token_text(i).encode())
    assert got == {"tokens": ["Hel", " wörld", "!"], "token_logprobs": [-0.1, -0.2, -0.3],
                   "top_logprobs": [{"Hel": -0.1}, {" wörld": -0.2, "!": -9999.0}, {}],
                   "text_offset": [5, 8, 14]}
    assert convert.completion_logprobs([], 3, token_text, str.encode) == {"tokens": [], "token_logprobs": [],
                                                              "top_logprobs": [], "text_offset": []}


# a character in three tokens of its UTF-8 (😀: f0 9f 98 80), each decoded alone to U+FFFD
PIECES = {10: b"\xf0\x9f", 11: b"\x98", 12: b"\x80", 13: b"ok"}


def test_logprobs_of_the_pieces_of_a_character_keep_their_bytes():
    """A token that is a piece of a character's UTF-8: its own bytes (joined, the character)
    and OpenAI's "bytes:\\x.." name, so that different pieces stay different keys of the
    legacy top_logprobs; the text offsets count what each decodes to alone."""
    items = [lp(10, -0.1, (10, -0.1), (11, -0.5), (12, -0.7)), lp(11, -0.2), lp(12, -0.3), lp(13, -0.4)]
    chat = convert.chat_logprobs(items, PIECES.__getitem__)
    assert bytes(b for x in chat for b in x["bytes"]).decode() == "\U0001F600ok"
    assert [x["token"] for x in chat] == ["bytes:\\xf0\\x9f", "bytes:\\x98", "bytes:\\x80", "ok"]
    assert [t["bytes"] for t in chat[0]["top_logprobs"]] == [[0xF0, 0x9F], [0x98], [0x80]]
    legacy = convert.completion_logprobs(items, 0, lambda i: PIECES[i].decode("utf-8", "replace"), PIECES.__getitem__)
    assert legacy["top_logprobs"][0] == {"bytes:\\xf0\\x9f": -0.1, "bytes:\\x98": -0.5, "bytes:\\x80": -0.7}
    assert legacy["text_offset"] == [0, 1, 2, 3]


def test_usage():
    assert convert.usage(7, 3) == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def test_timings():
    got = convert.timings([10.0, 10.5], [10.2, 10.3], [11.2, 11.0], prompt_n=4, predicted_n=5)
    assert got == pytest.approx({"prompt_n": 4, "prompt_ms": 200.0, "prompt_per_token_ms": 50.0,
                                 "prompt_per_second": 20.0, "predicted_n": 5, "predicted_ms": 1000.0,
                                 "predicted_per_token_ms": 200.0, "predicted_per_second": 5.0})
    R.Timings.model_validate(got)
    assert convert.timings([10.0], [], [11.0], 4, 5) is None  # no token yet
    zero = convert.timings([1.0], [1.0], [1.0], 0, 0)
    assert zero["prompt_per_token_ms"] == zero["predicted_per_second"] == 0.0


def test_group_timings_reads_tracked_requests():
    def tracked(sched, first, end):
        return SimpleNamespace(scheduled_time=sched, finish_time=end,
                               request=SimpleNamespace(first_token_time=first))

    group = [tracked(1.0, 1.5, 3.0), tracked(None, None, None)]
    assert convert.group_timings(group, 2, 3) == convert.timings([1.0], [1.5], [3.0], 2, 3)
    assert convert.group_timings([tracked(None, None, None)], 2, 3) is None


# ------------------------------------------------------------------ responses


def test_chat_response_is_openai_shaped():
    reply = chat_reply(logprobs=True)
    choices = [reply.choice(0, "Hello", "stop", [lp(0, -0.1, (0, -0.1)), lp(1, -0.2, (1, -0.2))]),
               reply.choice(1, "", "length", [])]
    body = reply.response(choices, convert.usage(3, 2), None)
    got = ChatCompletion.model_validate(body)
    assert got.object == "chat.completion" and got.id == "x-1" and got.model == "m"
    assert got.choices[0].message.content == "Hello" and got.choices[0].message.role == "assistant"
    assert [t.token for t in got.choices[0].logprobs.content] == ["Hel", "lo"]
    assert got.choices[1].logprobs.content == [] and got.usage.total_tokens == 5
    R.ChatCompletionResponse.model_validate(body)
    assert chat_reply().choice(0, "a", "stop", [lp(0, -0.1)])["logprobs"] is None  # none asked for


def test_completion_response_is_openai_shaped():
    reply = text_reply(logprobs=True)
    body = reply.response([reply.choice(0, "echo:Hello", "length", [lp(0, -0.1), lp(1, -0.2)], offset=5)],
                          convert.usage(2, 2), convert.timings([0.0], [0.1], [0.2], 2, 2))
    got = Completion.model_validate(body)
    assert got.object == "text_completion" and got.choices[0].text == "echo:Hello"
    assert got.choices[0].logprobs.text_offset == [5, 8]
    assert body["timings"]["predicted_n"] == 2
    R.CompletionResponse.model_validate(body)


def test_chat_stream_chunks_are_openai_shaped():
    reply = chat_reply(logprobs=True)
    opening = parse_event(reply.chunk(reply.opening(["", ""])))
    first = ChatCompletionChunk.model_validate(opening)
    assert [(c.index, c.delta.role, c.delta.content) for c in first.choices] == [(0, "assistant", ""),
                                                                                (1, "assistant", "")]
    middle = ChatCompletionChunk.model_validate(parse_event(reply.chunk([reply.delta(1, "lo", None, [lp(1, -0.2)])])))
    assert middle.choices[0].delta.content == "lo" and middle.choices[0].logprobs.content[0].token == "lo"
    last = parse_event(reply.chunk([reply.delta(1, "", "stop", [])]))
    assert last["choices"][0]["delta"] == {}  # the finishing chunk of a chat carries no content
    assert ChatCompletionChunk.model_validate(last).choices[0].finish_reason == "stop"
    usage = ChatCompletionChunk.model_validate(parse_event(reply.chunk([], usage=convert.usage(3, 1))))
    assert usage.choices == [] and usage.usage.total_tokens == 4


def test_reasoning_replies_carry_reasoning_content():
    """A model with a reasoning parser: messages and deltas carry reasoning_content beside content,
    still valid for the openai client (which keeps the field as an extra) and the server's schema."""
    reply = Reply(True, False, HEAD, token_text, reasoning=True)
    body = reply.response([reply.choice(0, "Hi!", "stop", [], reasoning="They greet me."),
                           reply.choice(1, "Hi!", "stop", [])], convert.usage(3, 2), None)
    got = ChatCompletion.model_validate(body)
    assert got.choices[0].message.content == "Hi!"
    assert got.choices[0].message.model_extra["reasoning_content"] == "They greet me."
    assert body["choices"][1]["message"]["reasoning_content"] is None  # no reasoning: null, not ""
    assert R.ChatCompletionResponse.model_validate(body).choices[0].message.reasoning_content == "They greet me."
    deltas = [reply.delta(0, "", None, [], reasoning="They"), reply.delta(0, "Hi", None, [], reasoning=" greet."),
              reply.delta(0, "!", None, []), reply.delta(0, "", "stop", [])]
    assert [d.model_dump(exclude_unset=True)["delta"] for d in deltas] == [{"reasoning_content": "They"},
                                            {"reasoning_content": " greet.", "content": "Hi"},
                                            {"content": "!"}, {}]
    for d in deltas:
        ChatCompletionChunk.model_validate(parse_event(reply.chunk([d])))
    assert "reasoning_content" not in chat_reply().choice(0, "Hi!", "stop", [])["message"]  # other models


def test_template_variables():
    body = P.ChatCompletionRequest(messages=CHAT, reasoning_effort="high",
                                   chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low"})
    assert convert.template_variables(body) == {"enable_thinking": False, "reasoning_effort": "high"}
    assert convert.template_variables(P.ChatCompletionRequest(messages=CHAT)) == {}
    for name in ("messages", "bos_token", "add_generation_prompt"):
        with pytest.raises(APIError, match=name) as e:
            convert.template_variables(P.ChatCompletionRequest(messages=CHAT, chat_template_kwargs={name: 1}))
        assert e.value.status == 400 and e.value.param == "chat_template_kwargs"


def test_completion_stream_chunks_are_openai_shaped():
    reply = text_reply()
    assert reply.opening(["", ""]) == []  # nothing to echo: no opening chunk
    # OpenAI's Completion type wants a finish_reason, which a stream's earlier chunks lack (its
    # client builds stream chunks without validating them): those are compared key for key.
    opening = parse_event(reply.chunk(reply.opening(["", "Hi"])))
    assert opening == {**reply.head, "choices": [{"index": 1, "text": "Hi", "logprobs": None,
                                                  "finish_reason": None}]}
    assert set(opening["choices"][0]) == set(Completion.model_fields["choices"].annotation.__args__[0].model_fields)
    chunk = Completion.model_validate(parse_event(reply.chunk([reply.delta(0, "lo", "length", [lp(1, -0.2)])])))
    assert chunk.choices[0].text == "lo" and chunk.choices[0].finish_reason == "length"
    assert chunk.choices[0].logprobs is None


def test_reply_new_heads():
    chat = Reply.new(True, False, "m", token_text)
    text = Reply.new(False, False, "m", token_text)
    assert chat.head["id"].startswith("chatcmpl-") and chat.head["object"] == "chat.completion.chunk"
    assert text.head["id"].startswith("cmpl-") and text.head["object"] == "text_completion"
    assert chat.head["id"] != Reply.new(True, False, "m", token_text).head["id"]
    assert chat.head["model"] == "m" and isinstance(chat.head["created"], int)


def test_chunk_refuses_nan():
    with pytest.raises(ValueError):
        chat_reply().chunk([], usage={"x": math.nan})


def test_stream_error_events():
    assert parse_event(convert.stream_error(MinervaError("bad"))) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": 400}}
    assert parse_event(convert.stream_error(MinervaError("bad", "logit_bias")))["error"]["param"] == "logit_bias"
    assert parse_event(convert.stream_error(RuntimeError("bug")))["error"]["code"] == 500
    assert convert.arguments_object('{"a": NaN, "b": 1}') == {} and convert.arguments_object('{"b": 1, "a": [2') == {"b": 1, "a": [2]}
    assert convert.DONE == "data: [DONE]\n\n"


def test_error_body():
    assert convert.error_body(404, "no", "model") == {
        "error": {"message": "no", "type": "invalid_request_error", "param": "model", "code": 404}}
    R.ErrorResponse.model_validate(convert.error_body(400, "x"))
