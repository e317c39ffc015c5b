"""Anthropic's Messages API with the official `anthropic` SDK against a live server (SmolLM2):
whole and streamed answers equal to the chat route's, a forced tool call and its result
round trip, stop sequences, token counting, errors in Anthropic's shape, the API key."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest


SYSTEM = "You are a terse assistant."
GREEDY = {"temperature": 0}  # the SDK no longer has sampling arguments; the API still takes them
ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served, api_key="sk-test", max_retries=0, timeout=120)


def chat_answer(served, messages, max_tokens, **extra):
    oai = openai.OpenAI(base_url=f"{served}/v1", api_key="sk-test", max_retries=0)
    return oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens, extra_body=GREEDY,
                                       **extra)


def test_whole_and_streamed_answers_are_the_chat_routes(served, client):
    want = chat_answer(served, [{"role": "system", "content": SYSTEM}, *ASK], 24)
    m = client.messages.create(model="smollm2", max_tokens=24, system=SYSTEM, messages=ASK, metadata={"user_id": "u-1"},
                               service_tier="auto", extra_body={"temperature": 0, "top_k": 40})
    assert m.type == "message" and m.role == "assistant" and m.model == "smollm2" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    assert m.usage.input_tokens == want.usage.prompt_tokens and m.usage.output_tokens == want.usage.completion_tokens
    kinds = []
    with client.messages.stream(model="smollm2", max_tokens=24, system=[{"type": "text", "text": SYSTEM}],
                                messages=ASK, extra_body=GREEDY) as stream:
        for e in stream:
            kinds.append(e.type)
        final = stream.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.input_tokens == m.usage.input_tokens and final.usage.output_tokens == m.usage.output_tokens
    raw = [k for k in kinds if k not in ("text", "content_block_delta")]  # the SDK's own 'text' events aside
    assert raw[:2] == ["message_start", "content_block_start"] and raw[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(client):
    text = client.messages.create(model="smollm2", max_tokens=24, messages=ASK, extra_body=GREEDY).content[0].text
    word = text.split()[1]
    m = client.messages.create(model="smollm2", max_tokens=24, messages=ASK, extra_body=GREEDY, stop_sequences=[word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert text.startswith(m.content[0].text) and word not in m.content[0].text


def test_forced_tool_call_and_its_result(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(model="smollm2", max_tokens=64, messages=ask, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    call = next(b for b in m.content if b.type == "tool_use")
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(model="smollm2", max_tokens=64, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    s_call = next(b for b in streamed.content if b.type == "tool_use")
    assert (s_call.name, s_call.input) == (call.name, call.input) and streamed.stop_reason == "tool_use"
    answer = client.messages.create(model="smollm2", max_tokens=32, tools=[WEATHER], extra_body=GREEDY, messages=[
        *ask, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": json.dumps({"temp": 14, "sky": "clear"})}]}])
    assert answer.content and answer.content[0].type in ("text", "tool_use")
    none = client.messages.create(model="smollm2", max_tokens=16, messages=ask, tools=[WEATHER],
                                  tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in none.content] == ["text"] and none.stop_reason != "tool_use"


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_a_tool_call_cut_by_max_tokens_keeps_what_was_written(client, choice):
    """Cut in its arguments: the input holds what was written whole, as the SDK assembles the
    same call streamed (it was {} whole, and the internal JSON array as text with "any")."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model="smollm2", messages=ask, tools=[WEATHER], tool_choice=choice, extra_body=GREEDY)
    whole = client.messages.create(max_tokens=64, **kwargs).content[0].input
    assert whole == {"city": "Paris"}
    inputs = []
    for n in range(1, 40):
        m = client.messages.create(max_tokens=n, **kwargs)
        if m.stop_reason != "max_tokens":
            break
        with client.messages.stream(max_tokens=n, **kwargs) as stream:
            streamed = stream.get_final_message()
        assert [b.type for b in m.content] == [b.type for b in streamed.content], (m, streamed)
        assert all(b.type == "tool_use" for b in m.content), m  # never the call's JSON as text
        if m.content:
            assert m.content[0].input == streamed.content[0].input and m.content[0].input.items() <= whole.items()
            inputs.append(m.content[0].input)
    assert whole in inputs  # cut after its last value, before the closing brace


def test_count_tokens(client):
    counted = client.messages.count_tokens(model="smollm2", system=SYSTEM, messages=ASK)
    m = client.messages.create(model="smollm2", max_tokens=1, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == m.usage.input_tokens > 10
    with_tools = client.messages.count_tokens(model="smollm2", messages=ASK, tools=[WEATHER])
    assert with_tools.input_tokens > client.messages.count_tokens(model="smollm2", messages=ASK).input_tokens


def post(served, body, key="sk-test", path="/v1/messages"):
    return httpx.post(f"{served}{path}", json=body, headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
                      timeout=60)


@pytest.mark.parametrize("body, status, kind, words", [
    ({"model": "smollm2", "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": ASK}, 404, "not_found_error", "'smollm2'"),
    ({"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     400, "invalid_request_error", "text-only models"),
    ({"model": "smollm2", "max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305",
                                                                        "name": "web_search"}]},
     400, "invalid_request_error", "server tool"),
    ({"model": "smollm2", "max_tokens": 4, "messages": ASK, "temperature": "hot"}, 400, "invalid_request_error",
     "temperature"),
    # a tool_result's content that is neither text nor text blocks (was a 500)
    *[({"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": content}]}]}, 400, "invalid_request_error", words)
      for content, words in ((5, "messages.0.content.0.content: expected a string"),
                             (True, "expected a string"), ({"type": "text"}, "expected a string"),
                             (["a"], "expected text blocks"), ([{"type": "text", "text": 5}], "needs its text"))],
    # a tool_choice that needs tools, without them
    ({"model": "smollm2", "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "needs tools"),
    ({"model": "smollm2", "max_tokens": 4, "messages": ASK, "tools": [], "tool_choice": {"type": "tool", "name": "f"}},
     400, "invalid_request_error", "needs tools"),
    ({"model": "smollm2", "max_tokens": 4, "messages": ASK, "thinking": {"type": "bogus", "budget_tokens": "lots"}},
     400, "invalid_request_error", "thinking"),
    ({"model": "smollm2", "max_tokens": 4, "messages": ASK, "stop_sequences": [""]}, 400, "invalid_request_error",
     "stop_sequences.0: String should have at least 1 character"),
    # a tool's input is an object of named values
    ({"model": "smollm2", "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"},
      "tools": [{"name": "f", "input_schema": {"type": "array", "items": {"type": "integer"}}}]}, 400,
     "invalid_request_error", 'must be a schema of type "object" (the arguments by name), got type "array"'),
    # a client tool says what its input is, as Anthropic's API asks
    ({"model": "smollm2", "max_tokens": 4, "messages": ASK, "tools": [{"name": "f", "description": "d"}]}, 400,
     "invalid_request_error", "the tool 'f' has no input_schema"),
    # the chat route's check, in this API's names (it said tool_choice "required", response_format)
    ({"model": "smollm2", "max_tokens": 4, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, 400,
     "invalid_request_error", 'a forced tool call (tool_choice "any" or "tool") already constrains the output; '
                              'leave out output_config.format'),
])
def test_errors_in_anthropics_shape(served, body, status, kind, words):
    r = post(served, body)
    assert r.status_code == status
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and words in err["error"]["message"], err


def test_api_key(served, client):
    r = post(served, {"model": "smollm2", "max_tokens": 2, "messages": ASK}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = anthropic.Anthropic(base_url=served, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="smollm2", max_tokens=2, messages=ASK)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=2, messages=ASK)


def test_structured_output(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    m = client.messages.create(model="smollm2", max_tokens=48, messages=ASK, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_a_final_assistant_message_is_continued(served, client, smollm2_gguf, smollm2_hf):
    """A prefill: the reply goes on from the last assistant text (Anthropic's documented
    behaviour; Ollama's /api/chat too), as transformers renders continue_final_message; the
    reply is transformers' greedy continuation of that prompt."""
    from transformers import AutoTokenizer

    from tests.helpers.hf import hf_greedy

    messages = [{"role": "user", "content": "What is the capital of France? Reply as JSON."},
                {"role": "assistant", "content": '{"capital": "'}]
    ref = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith('<|im_start|>assistant\n{"capital": "')
    ids = ref.encode(text, add_special_tokens=False)
    assert client.messages.count_tokens(model="smollm2", messages=messages).input_tokens == len(ids)
    expected = ref.decode(hf_greedy(smollm2_hf, ids, 8, {ref.eos_token_id, ref.convert_tokens_to_ids("<|im_end|>")}))
    assert expected.startswith("Paris")
    reply = client.messages.create(model="smollm2", max_tokens=8, messages=messages, extra_body=GREEDY)
    assert reply.content[0].text == expected and reply.usage.input_tokens == len(ids)
    ollama = httpx.post(f"{served}/api/chat", headers={"Authorization": "Bearer sk-test"}, timeout=60, json={
        "model": "smollm2", "messages": messages, "stream": False, "options": {"temperature": 0, "num_predict": 8}})
    assert ollama.json()["message"]["content"] == expected, ollama.text
    # the chat route as vLLM names it; both at once is refused
    oai = openai.OpenAI(base_url=f"{served}/v1", api_key="sk-test", max_retries=0)
    chat = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, extra_body={
        **GREEDY, "add_generation_prompt": False, "continue_final_message": True})
    assert chat.choices[0].message.content == expected
    with pytest.raises(openai.BadRequestError, match="set add_generation_prompt false"):
        oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                    extra_body={"continue_final_message": True})
    with pytest.raises(openai.BadRequestError, match="it must be an assistant's, with text"):
        oai.chat.completions.create(model="smollm2", messages=messages[:1], max_tokens=8, extra_body={
            "add_generation_prompt": False, "continue_final_message": True})
