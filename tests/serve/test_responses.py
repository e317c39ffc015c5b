"""OpenAI's Responses API with the official `openai` SDK against a live server (SmolLM2): whole
and streamed answers equal to the chat route's, a forced function call and its output round
trip, structured output, previous_response_id chains, the store, errors."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.helpers.server import metric, wait_for


INSTRUCTIONS = "You are a terse assistant."
QUESTION = "Name three colours of the rainbow."
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served}/v1", api_key="sk-test", max_retries=0, timeout=120)


def chat(client, messages, max_tokens):
    return client.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0)


def test_whole_and_streamed_answers_are_the_chat_routes(client):
    want = chat(client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], 24)
    r = client.responses.create(model="smollm2", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=24,
                                temperature=0, store=False, metadata={"run": "1"})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "smollm2"
    assert r.output_text == want.choices[0].message.content
    assert r.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == want.usage.prompt_tokens and r.usage.output_tokens == want.usage.completion_tokens
    kinds, text = [], ""
    for e in client.responses.create(model="smollm2", instructions=INSTRUCTIONS, temperature=0, stream=True,
                                     input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                                     max_output_tokens=24):
        kinds.append(e.type)
        if e.type == "response.output_text.delta":
            text += e.delta
        final = e
    assert text == r.output_text and final.response.output_text == text
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{r.status}"]


def test_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model="smollm2", input="Write a long story about a dragon.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[-1].status == "incomplete"  # the item cut short, too


@pytest.mark.parametrize("body", [{"input": "Say hi", "max_output_tokens": 6},
                                  {"input": "Weather in Paris?", "tool_choice": "required", "max_output_tokens": 40,
                                   "tools": [WEATHER]}])
def test_every_event_and_response_is_valid_as_the_sdk_types_say(served, body):
    """Each streamed event validated (not merely constructed) as its type in the openai SDK, and
    the Response of the same request: every field the SDK requires is there."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    events, headers = [], {"Authorization": "Bearer sk-test"}
    with httpx.stream("POST", f"{served}/v1/responses", json={"model": "smollm2", "temperature": 0, "stream": True,
                                                             **body}, headers=headers, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    assert [type(adapter.validate_python(e)).__name__ for e in events][-1] in ("ResponseCompletedEvent",
                                                                              "ResponseIncompleteEvent")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == events[-1]["response"]["output"]  # the items as the Response holds them, statuses too
    whole = httpx.post(f"{served}/v1/responses", json={"model": "smollm2", "temperature": 0, **body},
                       headers=headers, timeout=60).json()
    Response.model_validate(whole)


def test_function_call_and_its_output(client):
    ask = "What is the weather in Paris?"
    r = client.responses.create(model="smollm2", input=ask, tools=[WEATHER], temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64)
    call = next(item for item in r.output if item.type == "function_call")
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    pieces, done = "", None
    for e in client.responses.create(model="smollm2", input=ask, tools=[WEATHER], tool_choice="required",
                                     temperature=0, max_output_tokens=64, stream=True):
        if e.type == "response.function_call_arguments.delta":
            pieces += e.delta
        elif e.type == "response.function_call_arguments.done":
            done = e.arguments
    assert pieces == done == call.arguments
    answer = client.responses.create(model="smollm2", previous_response_id=r.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=32, input=[{"type": "function_call_output",
                                                                   "call_id": call.call_id,
                                                                   "output": json.dumps({"temp": 14})}])
    assert answer.status in ("completed", "incomplete") and answer.output
    assert answer.usage.input_tokens > r.usage.input_tokens  # the call and its output are in the prompt


def test_structured_output(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    r = client.responses.create(model="smollm2", input=QUESTION, temperature=0, max_output_tokens=48,
                                text={"format": {"type": "json_schema", "name": "colours", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_a_schema_that_cannot_be_followed_names_text_format(served, client):
    """Whole, a 400 whose param is text.format (the chat route's response_format, in this API's
    name); streamed, the error event carries the same param."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # no finite value
    text = {"format": {"type": "json_schema", "name": "loop", "schema": schema}}
    with pytest.raises(openai.BadRequestError, match="could not be followed") as e:
        client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=8, text=text)
    assert e.value.body["param"] == "text.format", e.value.body
    with httpx.stream("POST", f"{served}/v1/responses", headers={"Authorization": "Bearer sk-test"}, timeout=60,
                      json={"model": "smollm2", "input": QUESTION, "max_output_tokens": 8, "text": text,
                            "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    error = next(e for e in events if e["type"] == "error")
    assert error["param"] == "text.format" and "could not be followed" in error["message"], error
    assert events[-1]["type"] == "response.failed", events[-1]


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="smollm2", input="My name is Ada.", temperature=0, max_output_tokens=16)
    second = client.responses.create(model="smollm2", input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=16)
    want = chat(client, [{"role": "user", "content": "My name is Ada."},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "What is my name?"}], 16)
    assert second.output_text == want.choices[0].message.content
    assert second.usage.input_tokens == want.usage.prompt_tokens and second.previous_response_id == first.id


def test_the_store(served, client):
    r = client.responses.create(model="smollm2", input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="smollm2", input="Hi", previous_response_id="resp_nothing")


@pytest.mark.parametrize("body, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "text-only models"),
    ({"input": "Hi", "background": True}, "background responses are not supported"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools of type 'web_search'"),
    ({"input": "Hi", "max_output_tokens": "4"}, "max_output_tokens"),
    ({"input": "Hi", "top_logprobs": 21}, "top_logprobs"),
    # malformed fields of their own: 400s naming them (these were 500s)
    ({"input": "Hi", "text": {"format": "json"}}, "text.format"),
    ({"input": "Hi", "reasoning": {"effort": ["low"]}}, "reasoning.effort"),
    ({"input": [{"type": "message", "role": "user", "content": None}]}, "input.0.content: expected a string"),
    ({"input": [{"type": "message", "role": "user", "content": 5}]}, "input.0.content: expected a string"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input.0.output: expected"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "needs its text"),
    # nothing that would change the answer is dropped
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "Hi", "text": {"format": {"type": "text"}, "zzz": 1}}, "text.zzz"),
    ({"input": "Hi", "reasoning": {"effort": "low", "zzz": 1}}, "reasoning.zzz"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "needs its schema"),
    # the chat route's checks, in this API's names
    ({"input": []}, "input: an empty list"),
    ({"input": "Hi", "max_output_tokens": 10**6}, "max_output_tokens asks for"),
    ({"input": "Hi", "truncation": "sometimes"}, "truncation"),
    ({"input": "Hi", "previous_response_id": ""}, "previous_response_id"),  # not the same as none
    ({"input": "Hi", "tools": [{"type": "function", "name": "f b"}]}, "tools.0.name"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": 5}},
     "tool_choice"),
])
def test_errors(served, body, words):
    r = httpx.post(f"{served}/v1/responses", json={"model": "smollm2", **body},
                   headers={"Authorization": "Bearer sk-test"}, timeout=60)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    error = r.json()["error"]
    assert "messages" not in error["message"] and "max_tokens " not in error["message"], error
    assert error["param"] is None or not error["param"].startswith(("messages", "max_tokens")), error
    assert httpx.post(f"{served}/v1/responses", json={"input": "Hi"}).status_code == 401


def test_a_request_without_a_model_names_the_one_that_answered(served):
    headers = {"Authorization": "Bearer sk-test"}
    r = httpx.post(f"{served}/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "smollm2", r.text
    with httpx.stream("POST", f"{served}/v1/responses", headers=headers, timeout=60,
                      json={"input": "Hi", "max_output_tokens": 2, "stream": True}) as s:
        snapshots = [json.loads(line[6:])["response"] for line in s.iter_lines()
                     if line.startswith("data: ") and '"response"' in line]
    assert [x["model"] for x in snapshots] == ["smollm2"] * 3, snapshots


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-5' does not exist; this server serves 'smollm2'"):
        client.responses.create(model="gpt-5", input="Hi")


def test_a_streamed_response_is_stored_while_it_streams_and_when_its_client_hangs_up(served, client):
    headers = {"Authorization": "Bearer sk-test"}
    body = {"model": "smollm2", "max_output_tokens": 1000, "temperature": 0, "stream": True,
            "input": "Count from 1 to 500, separated by commas."}
    with httpx.stream("POST", f"{served}/v1/responses", json=body, headers=headers, timeout=60) as s:
        events = (json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: "))
        rid = next(events)["response"]["id"]
        said = "".join(next(e for e in events if e["type"] == "response.output_text.delta")["delta"]
                       for _ in range(8))
        streaming = client.responses.retrieve(rid)
        assert streaming.status == "in_progress" and streaming.output_text.startswith(said[:1]), streaming
        assert streaming.output[0].status == "in_progress" and streaming.usage is None
        with pytest.raises(openai.BadRequestError, match="still in progress"):
            client.responses.create(model="smollm2", input="Go on", previous_response_id=rid, max_output_tokens=2)
    # hung up: the generation stops, and what was said is kept
    wait_for(lambda: client.responses.retrieve(rid).status != "in_progress", what="the response stored")
    cancelled = client.responses.retrieve(rid)
    assert cancelled.status == "cancelled" and cancelled.output_text.startswith(said), cancelled
    assert cancelled.output[0].status == "incomplete" and len(cancelled.output_text) < 1500
    follow = client.responses.create(model="smollm2", input="Go on", previous_response_id=rid, max_output_tokens=2)
    assert follow.status == "incomplete"
    # deleted while streaming: it stays deleted
    with httpx.stream("POST", f"{served}/v1/responses", json=body, headers=headers, timeout=60) as s:
        events = (json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: "))
        rid = next(events)["response"]["id"]
        next(e for e in events if e["type"] == "response.output_text.delta")
        client.responses.delete(rid)
    wait_for(lambda: metric(served, "minerva:num_requests_running", headers=headers) == 0, what="the request ended")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)


def test_logprobs_asked_by_include_or_top_logprobs(served, client):
    """include: ["message.output_text.logprobs"] (and top_logprobs) give the output text's tokens
    with their log probabilities, as the chat route computes them; streamed, on each delta."""
    r = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=6, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    text = r.output[0].content[0]
    ref = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                         max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    theirs = ref.choices[0].logprobs.content
    assert [(p.token, p.logprob, len(p.top_logprobs)) for p in text.logprobs] == \
        [(p.token, p.logprob, 2) for p in theirs] and len(theirs) == 6
    assert client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=2).output[0].content[0].logprobs \
        is None  # not asked: none
    with client.responses.stream(model="smollm2", input=QUESTION, max_output_tokens=6, temperature=0,
                                 include=["message.output_text.logprobs"]) as stream:
        events = list(stream)
    deltas = [p.token for e in events if e.type == "response.output_text.delta" for p in e.logprobs]
    final = events[-1].response  # response.incomplete: cut at 6 tokens (the SDK's helper wants a completed one)
    assert deltas == [p.token for p in theirs] == [p.token for p in final.output[0].content[0].logprobs]


def test_truncation_auto_drops_the_oldest_items_until_it_fits(served, client):
    room = httpx.get(f"{served}/v1/models", headers={"Authorization": "Bearer sk-test"}).json()["data"][0]
    context = room["max_model_len"]
    old = [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "Noted."},
           {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
           {"type": "function_call_output", "call_id": "c1", "output": '{"temp": 20}'}]
    ask = [{"role": "user", "content": "Hi"}]
    body = dict(model="smollm2", input=old + ask, instructions=INSTRUCTIONS, max_output_tokens=context - 250,
                temperature=0, tools=[WEATHER])
    with pytest.raises(openai.BadRequestError, match="max_output_tokens asks for"):
        client.responses.create(**body)  # truncation "disabled", the default
    r = client.responses.create(**body, truncation="auto")
    want = client.chat.completions.create(model="smollm2", messages=[{"role": "system", "content": INSTRUCTIONS}, *ask],
                                          tools=[{"type": "function", "function": {
                                              k: v for k, v in WEATHER.items() if k != "type"}}],
                                          max_tokens=context - 250, temperature=0)
    assert r.truncation == "auto" and r.usage.input_tokens == want.usage.prompt_tokens
    assert r.output_text == want.choices[0].message.content
    # What fits is not cut; what cannot fit even alone is still refused.
    short = client.responses.create(**{**body, "max_output_tokens": 8}, truncation="auto")
    assert short.usage.input_tokens > want.usage.prompt_tokens + 400
    with pytest.raises(openai.BadRequestError, match=r"even cut as far as truncation \"auto\" cuts \(the "
                                                     r"system instructions, .*\), the conversation does not fit: .*max_output_tokens asks for"):
        client.responses.create(**{**body, "max_output_tokens": context}, truncation="auto")


def test_the_store_holds_a_bounded_amount_of_text():
    """Stored conversations count their text: past the store's budget the oldest responses go (the
    newest always stays), and one conversation keeps its newest turns up to its own budget,
    system messages and the last turn whatever their size; a delete gives its share back."""
    from minerva.serve.responses import Store, text_size

    def turn(i, chars):
        return [{"role": "user", "content": f"{i}:" + "u" * chars}, {"role": "assistant", "content": "a" * chars}]

    store = Store(size=100, chars=10_000, each=10_000)
    for i in range(30):
        store.put(f"r{i}", {"id": f"r{i}"}, turn(i, 1000))  # 2003 characters each: 4 fit in 10,000
    assert list(store.items) == [f"r{i}" for i in range(26, 30)]
    assert store.total == sum(text_size(m) for _, c in store.items.values() for m in c) <= 10_000
    store.remove("r29")
    assert list(store.items)[-1] == "r28" and store.total == sum(
        text_size(m) for _, c in store.items.values() for m in c)

    chain = [{"role": "system", "content": "s" * 3000}]
    for i in range(10):  # a chain: each response ends the conversation of the one before
        chain = chain + turn(i, 1000)
        store.put(f"c{i}", {"id": f"c{i}"}, chain)
    kept = store.items["c9"][1]
    assert kept[0] == chain[0] and kept[-2:] == chain[-2:]  # the system message and the last turn
    assert sum(map(text_size, kept)) <= 10_000 and kept[1]["content"].startswith("7:")  # turns 7-9 of 0-9
    assert list(store.items) == ["c9"]  # the chain's earlier responses are past the budget

    agent = [{"role": "user", "content": "Fix the bug."}]  # one user message, then many tool steps
    for i in range(20):
        agent += [{"role": "assistant", "content": None, "tool_calls": [
                      {"id": f"c{i}", "type": "function", "function": {"name": "run", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": f"c{i}", "content": f"{i}:" + "o" * 1000}]
    store.put("agent", {"id": "agent"}, agent)
    kept = store.items["agent"][1]
    assert kept[0] == agent[0] and kept[-2:] == agent[-2:] and sum(map(text_size, kept)) <= 10_000
    assert len(kept) < len(agent) and kept[1]["role"] == "assistant"  # the oldest steps went, whole

    huge = [{"role": "user", "content": "x" * 50_000}]
    store.put("huge", {"id": "huge"}, huge)  # alone past both budgets: still kept (its turn is the last)
    assert list(store.items) == ["huge"] and store.items["huge"][1] == huge
