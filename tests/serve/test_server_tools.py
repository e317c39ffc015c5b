"""Tool calling through `/v1/chat/completions` with the `openai` SDK: the round trip (call ->
tool result -> answer) for `auto`, `required` and a named function, whole and streamed, on
SmolLM2 (whose template has no tool support: the built-in format); a template with its own
format whose marker is a special token (a scripted tiny model); and the 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from minerva import LLM
from minerva.parsers.tools import make_plan
from tests.helpers.scripted import HARMONY_TEMPLATE, HARMONY_TOKENS, scripted
from tests.helpers.server import running_server
from tests.helpers.tiny_gguf import write_tiny_llama
from tests.parsers.test_tools import TIME, WEATHER

pytestmark = pytest.mark.slow

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def shot(city: str, i: int, temp: int) -> list[dict]:
    """One earlier exchange: the question, the call, its result and the answer."""
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps({"temp": temp})},
            {"role": "assistant", "content": f"It is {temp} degrees in {city}."}]


# Three earlier exchanges: enough for the 135M model to call the tool by itself (greedy).
SHOTS = shot("London", 1, 12) + shot("Rome", 2, 20) + shot("Oslo", 3, 3)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    # float activations: the greedy replies this file expects are the model's on every CPU (int8
    # activations' rounding differs by build: on an AVX2 machine the 'auto' shot answered in text)
    llm = LLM(str(smollm2_gguf), device="cpu", dtype="float32", activations="float", kv_cache_memory=64e6)
    with running_server(llm, served_model_name="smollm2") as (url, app):
        yield url, llm


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", timeout=120, max_retries=0)


def streamed(client, model: str = "smollm2", **kwargs):
    """A streamed reply joined as the SDK's users join it: content, and calls by index."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or ():
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert call["id"] is None  # the id and the name come once, with the first piece
                    call["id"], call["name"] = tc.id, tc.function.name
                call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def check_call(name: str, arguments: str, tool: dict) -> dict:
    assert name == tool["function"]["name"]
    args = json.loads(arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.parametrize("choice", ["auto", "required", NAMED], ids=["auto", "required", "named"])
def test_round_trip(client, choice):
    messages = (SHOTS if choice == "auto" else []) + ASK
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, TIME],
                                       tool_choice=choice, temperature=0, max_tokens=80)
    choice0 = r.choices[0]
    assert choice0.finish_reason == "tool_calls", choice0
    message = choice0.message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert check_call(call.function.name, call.function.arguments, WEATHER)["city"] == "Paris"
    assert call.id.startswith("call_") and call.type == "function"
    # The SDK's own message goes back (with what else the server sent in it), with the tool's
    # result; the model answers in text.
    sent = {**message.model_dump(exclude_none=True), "reasoning_content": None, "refusal": None, "annotations": []}
    messages += [sent, {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 18})}]
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, TIME],
                                       temperature=0, max_tokens=40)
    answer = r.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls and answer.message.content, answer
    if choice == "auto":
        assert "18" in answer.message.content  # it read the result
    # Streamed, the same call comes in pieces that join to the whole reply's.
    content, calls, finish = streamed(client, messages=(SHOTS if choice == "auto" else []) + ASK,
                                      tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_tokens=80)
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == (call.function.name,
                                                                     json.loads(call.function.arguments))


def test_required_with_n_and_sampling(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       n=3, temperature=0.7, seed=5, max_tokens=120)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            check_call(call.function.name, call.function.arguments, WEATHER if call.function.name == "get_weather"
                       else TIME)
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=120)
    assert len(r.choices[0].message.tool_calls) == 1


def test_stop_strings_do_not_cut_a_reply_held_to_json(client):
    """A stop string the JSON would hold (here the city's name, or a key) does not end a forced
    call or a schema-held answer: their JSON ends them (the stop string was matched inside them)."""
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=120, stop=["Paris", "city"])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    schema = WEATHER["function"]["parameters"]
    r = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=60, stop=["city"],
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "w", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    free = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=60, stop=["the"])
    assert free.choices[0].finish_reason == "stop" and "the" not in free.choices[0].message.content  # others: as ever


def test_cut_off_call_finishes_with_length(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice=NAMED,
                                       temperature=0, max_tokens=3)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.message.tool_calls[0].function.arguments)
    # "required" too: the call written so far, never the grammar's array as content, streamed or not
    for tokens in (12, 16):
        r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=tokens)
        c = r.choices[0]
        assert c.finish_reason == "length" and not c.message.content and c.message.tool_calls, c
        assert c.message.tool_calls[0].function.name == "get_weather"
        assert '{"city": "Paris"}'.startswith(c.message.tool_calls[0].function.arguments)
        content, calls, finish = streamed(client, messages=ASK, tools=[WEATHER], tool_choice="required",
                                          temperature=0, max_tokens=tokens)
        assert (content, finish) == ("", "length") and calls[0]["arguments"] == c.message.tool_calls[0].function.arguments


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(model="smollm2", messages=SHOTS + ASK, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content


def error(r: httpx.Response, param: str | None, fragment: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()["error"]
    assert body["param"] == param and fragment in body["message"], body


def test_bad_tool_requests_are_400(served):
    url = served[0]

    def post(**body):
        return httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)

    error(post(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
          "'nope', which is not among the tools")
    error(post(tool_choice="required"), "tool_choice", "needs tools")
    error(post(tools=[WEATHER, WEATHER]), "tools", "given twice")
    error(post(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
          "response_format", "already constrains the output")
    error(post(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools.0.function.name",
          "should match pattern")
    error(post(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "invalid field")
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                "properties": {"x": {"type": 7}}}}}
    r = post(tools=[bad_schema], tool_choice="required")
    error(r, "tools", "the parameters of the function 'f' are not a usable JSON schema")
    listed = {"type": "function", "function": {"name": "f", "parameters": {"type": "array", "items": {"type": "integer"}}}}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        error(post(tools=[listed], tool_choice=choice), "tools",
              'the parameters of \'f\' must be a schema of type "object" (the arguments by name), got type "array"')
    image = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": image}]}, timeout=60)
    error(r, "messages.0", "content parts of type 'image_url' are not supported")
    assert "takes no images" in r.json()["error"]["message"] and "more problems" not in r.json()["error"]["message"]


# ------------------------------------------------------------------ a template's own format

# In the shape of Mistral's: the tools in [AVAILABLE_TOOLS], calls after the [TOOL_CALLS] control token.
MISTRAL_TEMPLATE = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
                    "{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}"
                    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
                    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")
MISTRAL_TOKENS = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "</s>")


def test_a_templates_own_format_with_special_markers(tmp_path):
    path = write_tiny_llama(tmp_path / "mistral.gguf", context=1024, chat_template=MISTRAL_TEMPLATE,
                            special_tokens=MISTRAL_TOKENS, eos_token="</s>")
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=4e6)
    assert (llm.tool_format.name, llm.tool_format.native, llm.tool_format.skip_special_tokens) == ("mistral", True,
                                                                                                  False)
    history = [{"role": "user", "content": "Rome?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
               {"role": "tool", "tool_call_id": "call_9", "content": "20"}]
    prompt = llm.apply_chat_template(history, tools=[WEATHER])
    assert prompt.startswith("[AVAILABLE_TOOLS][{") and '[TOOL_CALLS][{"name": "get_weather", "arguments": ' \
                                                           '{"city": "Rome"}}][TOOL_RESULTS]20' in prompt
    reply = 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    with scripted() as script, running_server(llm) as (url, _):
        script.say(llm.tokenizer, reply + "</s>")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        r = client.chat.completions.create(model="test-model", messages=ASK, tools=[WEATHER], max_tokens=120)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", {"city": "Rome"})]
        content, calls, finish = streamed(client, model="test-model", messages=ASK, tools=[WEATHER], max_tokens=120)
        assert (content, finish) == ("Checking.", "tool_calls") and calls[0]["name"] == "get_weather"
        # Without tools the markers are not kept: the reply is decoded as for any chat.
        r = client.chat.completions.create(model="test-model", messages=ASK, max_tokens=120)
        assert r.choices[0].message.content == reply.replace("[TOOL_CALLS]", "")
    llm.close()



# In the shape of GPT-OSS's: the tools in a developer message, calls as messages to functions.NAME.
HARMONY_TOOLS_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools\nnamespace functions { "
    "{% for t in tools %}type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;{% endfor %}"
    "}<|end|>{% endif %}" + HARMONY_TEMPLATE.removeprefix(
        "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"))


def test_harmony_calls(tmp_path):
    """GPT-OSS writes a call as a commentary message to functions.NAME after its reasoning."""
    path = write_tiny_llama(tmp_path / "harmony.gguf", context=1024, chat_template=HARMONY_TOOLS_TEMPLATE,
                            special_tokens=HARMONY_TOKENS, eos_token="<|return|>")  # not `"`, a byte of JSON
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=4e6)
    assert (llm.tool_format.name, llm.tool_format.native) == ("harmony", True)
    assert "type get_weather = " in llm.apply_chat_template(ASK, tools=[WEATHER])
    reply = ("<|channel|>analysis<|message|>The user wants the weather.<|end|>"
             "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
             '<|message|>{"city": "Paris"}<|call|>')
    with scripted() as script:
        script.say(llm.tokenizer, reply)
        out = llm.chat(ASK, tools=[WEATHER], use_tqdm=False).outputs[0]  # offline (not while the server runs)
        assert out.reasoning == "The user wants the weather." and out.tool_calls[0].name == "get_weather"
        served_harmony(llm, script, reply)
    llm.close()


def served_harmony(llm, script, reply: str) -> None:
    with running_server(llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        r = client.chat.completions.create(model="test-model", messages=ASK, tools=[WEATHER, TIME], max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        content, calls, finish = streamed(client, model="test-model", messages=ASK, tools=[WEATHER], max_tokens=200)
        assert (content, finish) == ("", "tool_calls") and [(c["name"], json.loads(c["arguments"])) for c in calls] \
            == [("get_weather", {"city": "Paris"})]
        # Forced, the reply is one harmony message to the function, its body held to the schema.
        script.say(llm.tokenizer, reply[reply.index("<|start|>assistant") + len("<|start|>assistant"):])
        r = client.chat.completions.create(model="test-model", messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == [
            ("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_harmony_forced_call_grammar(tmp_path, choice):
    """What the grammar of a forced harmony call lets through, token by token (llguidance)."""
    path = write_tiny_llama(tmp_path / "harmony.gguf", context=1024, chat_template=HARMONY_TOOLS_TEMPLATE,
                            special_tokens=HARMONY_TOKENS, eos_token="<|return|>")
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=4e6)
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    output = make_plan([WEATHER, TIME], tool_choice, None).output(llm.tool_format)

    def accepted(text: str) -> bool:
        matcher = llm.engine.grammars.matcher(output)
        return all(matcher.consume_token(t) for t in llm.tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()

    head = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"
    assert accepted(head.format("get_weather") + '{"city": "Paris"}<|call|>')
    assert accepted(head.format("get_time") + '{"zone": "UTC"}<|call|>') == (choice == "required")
    assert not accepted(head.format("get_weather") + '{"town": "Paris"}<|call|>')  # not the schema
    assert not accepted(head.format("get_weather") + '{"city": "Paris"}')  # not closed
    assert not accepted("<|channel|>final<|message|>It is sunny.<|return|>")  # an answer, not a call
    llm.close()


def test_text_after_a_call_comes_after_it(tmp_path):
    """A reply that writes text, a call, then more text: the chat stream's chunks, the Responses
    items and Anthropic's content blocks, streamed or whole, come in that order, however the
    decode bursts cut the reply."""
    import anthropic

    path = write_tiny_llama(tmp_path / "hermes.gguf", context=1024, special_tokens=("<|end|>",),
                            eos_token="<|end|>")  # no template: the built-in format
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=4e6)
    assert llm.tool_format.name == "hermes"
    reply = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call> Done.'
    with scripted() as script, running_server(llm) as (url, _):
        script.say(llm.tokenizer, reply + "<|end|>")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        order = []
        for chunk in client.chat.completions.create(model="test-model", messages=ASK, tools=[WEATHER], stream=True,
                                                    max_tokens=200):
            for choice in chunk.choices:  # a chunk's content comes before its calls
                if choice.delta.content and order and order[-1] != "call":
                    order[-1] += choice.delta.content
                elif choice.delta.content:
                    order.append(choice.delta.content)
                order += ["call"] * len(choice.delta.tool_calls or [])
        assert [text.strip() for text in order] == ["Checking.", "call", "Done."]
        stream = client.responses.create(model="test-model", input="Rome?", tools=[
            {"type": "function", **WEATHER["function"]}], stream=True)
        items = [e.item for e in stream if e.type == "response.output_item.done"]
        assert [i.type for i in items] == ["message", "function_call", "message"]
        assert items[0].content[0].text == "Checking." and items[2].content[0].text == "Done."
        whole = client.responses.create(model="test-model", input="Rome?", tools=[
            {"type": "function", **WEATHER["function"]}])  # the same items, in the same order
        assert [(i.type, getattr(i, "name", None) or i.content[0].text) for i in whole.output] == [
            ("message", "Checking."), ("function_call", "get_weather"), ("message", "Done.")]
        messages = anthropic.Anthropic(base_url=url, api_key="unused", timeout=60, max_retries=0)
        with messages.messages.stream(model="test-model", max_tokens=200, messages=ASK, tools=[{
                "name": "get_weather", "description": WEATHER["function"]["description"],
                "input_schema": WEATHER["function"]["parameters"]}]) as events:
            final = events.get_final_message()
        assert [b.type for b in final.content] == ["text", "tool_use", "text"]
        assert final.content[1].input == {"city": "Rome"} and final.content[2].text == "Done."
        whole = messages.messages.create(model="test-model", max_tokens=200, messages=ASK, tools=[{
            "name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}])
        assert [b.model_dump(include={"type", "text", "input"}) for b in whole.content] == [
            {"type": "text", "text": "Checking."}, {"type": "tool_use", "input": {"city": "Rome"}},
            {"type": "text", "text": "Done."}]
        chat = client.chat.completions.create(model="test-model", messages=ASK, tools=[WEATHER], max_tokens=200)
        assert whole.stop_reason == "tool_use" and (whole.usage.input_tokens, whole.usage.output_tokens) == (
            chat.usage.prompt_tokens, chat.usage.completion_tokens)
    llm.close()


STRICT_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}}}}


@pytest.mark.parametrize("value", [r'"\ud800"', "NaN", "1e999", "-Infinity"], ids=["surrogate", "nan", "huge", "inf"])
def test_a_call_whose_arguments_are_not_strict_json_stays_text(served, value):
    """A model's call whose arguments a client could not read back (an escaped lone surrogate,
    NaN, a number out of JSON's range: Python's reader takes each) is no call: the reply is the
    text, 200, whole and streamed, never a 500 or arguments that JSON.parse refuses."""
    import re
    text = '<tool_call>{"name":"f","arguments":{"a":' + value + '}}</tool_call>'
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60,
            "temperature": 0, "tools": [STRICT_TOOL], "guided_regex": re.escape(text)}
    r = httpx.post(served[0] + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert not message.get("tool_calls") and message["content"] == text
    with httpx.stream("POST", served[0] + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert s.status_code == 200
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == text
    assert not any(e["choices"][0]["delta"].get("tool_calls") for e in events if e["choices"])
    good = re.escape('<tool_call>{"name":"f","arguments":{"a":"\\ud83d\\ude00"}}</tool_call>')  # a pair: a call
    call = httpx.post(served[0] + "/v1/chat/completions", json={**body, "guided_regex": good}, timeout=120).json()
    assert json.loads(call["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": "\U0001F600"}
