"""Reasoning models end to end: `/v1/chat/completions` (whole and streamed), `LLM.chat` and
`minerva chat` split a reply into reasoning_content and content.

The models are tiny GGUFs with a harmony or a think-tag chat template whose sampler is
replaced by a recorded reply (tests/helpers/scripted.py): the engine, the detokenizer (special
tokens kept or not), the stop tokens, the parser and the response building all run for real."""

from __future__ import annotations

import io
import json
import re

import httpx
import pytest

from minerva import LLM, SamplingParams, cli
from minerva.chat import DIM, UNDIM
from tests.helpers.scripted import scripted, write_harmony_model, write_think_model
from tests.helpers.server import running_server

REASONING = "User says hi. Reply briefly."
ANSWER = "Hello! How can I help?"
HARMONY_REPLY = (f"<|channel|>analysis<|message|>{REASONING}<|end|>"
                 f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>")
THINK_REPLY = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}<|im_end|>"
HI = [{"role": "user", "content": "Hi"}]


def load(path) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=4e6)


@pytest.fixture(scope="module")
def harmony_llm(tmp_path_factory):
    return load(write_harmony_model(tmp_path_factory.mktemp("harmony") / "harmony.gguf"))


@pytest.fixture(scope="module")
def script():
    with scripted() as s:
        yield s


@pytest.fixture(scope="module")
def harmony(harmony_llm, script):
    with running_server(harmony_llm) as (url, _):
        yield url, harmony_llm


@pytest.fixture(scope="module")
def think(tmp_path_factory, script):
    llm = load(write_think_model(tmp_path_factory.mktemp("think") / "think.gguf"))
    with running_server(llm) as (url, _):
        yield url, llm


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": HI, **body}, timeout=60)


def stream_choices(url: str, **body) -> dict[int, list[dict]]:
    """The deltas (with their finish reasons) of each choice of a streamed chat completion."""
    out: dict[int, list[dict]] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={"messages": HI, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                out.setdefault(c["index"], []).append({**c["delta"], "finish": c["finish_reason"]})
    return out


def field(deltas: list[dict], name: str) -> str:
    return "".join(d.get(name) or "" for d in deltas)


def assert_400(r: httpx.Response, param: str, *fragments: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for f in fragments:
        assert f in error["message"], error["message"]


# ------------------------------------------------------------------ harmony


def test_harmony_model_stops_at_return_not_end(harmony_llm):
    tok = harmony_llm.tokenizer
    assert tok.token_to_id("<|return|>") in tok.eos_token_ids and tok.token_to_id("<|call|>") in tok.eos_token_ids
    assert tok.token_to_id("<|end|>") not in tok.eos_token_ids
    assert harmony_llm.reasoning.name == "harmony" and not harmony_llm.reasoning.skip_special_tokens


def test_harmony_whole_reply(harmony, script):
    url, llm = harmony
    ids = script.say(llm.tokenizer, HARMONY_REPLY)
    r = chat(url, max_tokens=200)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}
    assert choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == len(ids) - 1  # <|return|> ends it, unkept


def test_harmony_streamed_reply(harmony, script):
    url, llm = harmony
    script.say(llm.tokenizer, HARMONY_REPLY)
    choices = stream_choices(url, max_tokens=200, n=2)
    assert sorted(choices) == [0, 1]
    for deltas in choices.values():
        assert field(deltas, "reasoning_content") == REASONING and field(deltas, "content") == ANSWER
        assert [d["finish"] for d in deltas if d["finish"]] == ["stop"]
        for d in deltas:
            assert "<|" not in d.get("reasoning_content", "") + (d.get("content") or "")
        kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
        assert kinds == sorted(kinds, reverse=True) and len(kinds) > 2  # reasoning first, in several pieces


def test_harmony_cut_off_while_reasoning(harmony, script):
    url, llm = harmony
    ids = script.say(llm.tokenizer, HARMONY_REPLY)
    body_start = ids.index(llm.tokenizer.token_to_id("<|message|>")) + 1
    limit = body_start + 10
    want = llm.tokenizer.decode(ids[body_start:limit])
    assert want and REASONING.startswith(want)
    whole = chat(url, max_tokens=limit).json()["choices"][0]
    assert whole["message"]["reasoning_content"] == want and whole["message"]["content"] == ""
    assert whole["finish_reason"] == "length"
    deltas = stream_choices(url, max_tokens=limit)[0]
    assert field(deltas, "reasoning_content") == want and field(deltas, "content") == ""


def test_text_completions_are_not_split(harmony, script):
    """/v1/completions returns the text as decoded, special tokens left out as for any model."""
    url, llm = harmony
    ids = script.say(llm.tokenizer, HARMONY_REPLY)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 200}, timeout=60)
    assert r.json()["choices"][0]["text"] == llm.tokenizer.decode(ids[:-1])
    assert "reasoning_content" not in r.text


def test_reasoning_effort_reaches_the_template(harmony, script, monkeypatch):
    url, llm = harmony
    script.say(llm.tokenizer, HARMONY_REPLY)
    prompts = []
    encode = llm.encode_prompt
    monkeypatch.setattr(llm, "encode_prompt", lambda p: (isinstance(p, str) and prompts.append(p)) or encode(p))
    for effort in ("low", "high", None):
        body = {"max_tokens": 200} if effort is None else {"max_tokens": 200, "reasoning_effort": effort}
        assert chat(url, **body).status_code == 200
    assert len(prompts) == 3
    assert "Reasoning: low" in prompts[0] and "Reasoning: high" in prompts[1]
    assert "Reasoning: medium" in prompts[2]  # the template's default


@pytest.mark.parametrize("value", ["extreme", "HIGH", "", 3, ["high"]])
def test_bad_reasoning_effort_is_400(harmony, value):
    assert_400(chat(harmony[0], max_tokens=4, reasoning_effort=value), "reasoning_effort", "reasoning_effort")


@pytest.mark.parametrize("kwargs,name", [({"messages": []}, "messages"),
                                         ({"add_generation_prompt": False}, "add_generation_prompt"),
                                         ({"tools": []}, "tools"), ({"source": "x"}, "source"),
                                         ({"continue_final_message": True}, "continue_final_message")])
def test_template_kwargs_may_not_set_what_the_server_sets(harmony, kwargs, name):
    assert_400(chat(harmony[0], max_tokens=4, chat_template_kwargs=kwargs), "chat_template_kwargs", name)


def test_offline_chat_splits_the_reply(harmony_llm, script):
    script.say(harmony_llm.tokenizer, HARMONY_REPLY)
    out = harmony_llm.chat(HI, SamplingParams(max_tokens=200), reasoning_effort="low")
    assert (out.outputs[0].reasoning, out.text, out.finish_reason) == (REASONING, ANSWER, "stop")


# ------------------------------------------------------------------ think tags


def test_think_whole_and_streamed(think, script):
    """<think> is spelled in several byte tokens here: the markers arrive over several decode steps."""
    url, llm = think
    ids = script.say(llm.tokenizer, THINK_REPLY)
    assert len(ids) > len("<think>") and llm.reasoning.name == "think" and llm.reasoning.skip_special_tokens
    message = chat(url, max_tokens=200).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (REASONING, ANSWER)
    deltas = stream_choices(url, max_tokens=200)[0]
    assert field(deltas, "reasoning_content") == REASONING and field(deltas, "content") == ANSWER
    assert not any("think>" in (d.get("reasoning_content") or "") + (d.get("content") or "") for d in deltas)


def test_ollama_think_on_a_reasoning_model_and_on_one_that_is_not(think, script, tiny):
    """Ollama's think: a reasoning model's thoughts in `thinking`; a model that does not reason
    refuses it with a 400, as Ollama does (it was accepted and changed nothing)."""
    url, llm = think
    script.say(llm.tokenizer, THINK_REPLY)
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    r = httpx.post(f"{url}/api/chat", json={"model": name, "messages": HI, "think": True, "stream": False,
                                            "options": {"num_predict": 200}}, timeout=60)
    assert (r.json()["message"]["thinking"], r.json()["message"]["content"]) == (REASONING, ANSWER), r.text
    plain = LLM(str(tiny), dtype="float32", kv_cache_memory=4e6)
    with running_server(plain, served_model_name="tiny") as (other, _):
        for path, body in (("chat", {"messages": HI}), ("generate", {"prompt": "Hi"})):
            r = httpx.post(f"{other}/api/{path}", json={"model": "tiny", "think": True, "stream": False, **body},
                           timeout=60)
            assert r.status_code == 400 and "'tiny' does not think" in r.json()["error"], r.text
        r = httpx.post(f"{other}/api/chat", json={"model": "tiny", "messages": HI, "think": False, "stream": False,
                                                  "options": {"num_predict": 2}}, timeout=60)
        assert r.status_code == 200, r.text


def test_think_disabled_by_template_kwargs(think, script):
    url, llm = think
    script.say(llm.tokenizer, f"{ANSWER}<|im_end|>")
    message = chat(url, max_tokens=200, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]
    assert message["message"] == {"role": "assistant", "content": ANSWER, "reasoning_content": None}


# ------------------------------------------------------------------ minerva chat


@pytest.mark.parametrize("color", [True, False])
def test_cli_chat_dims_the_reasoning(harmony_llm, script, monkeypatch, capsys, color):
    """On a terminal (here: FORCE_COLOR) the reasoning is dimmed before the answer; elsewhere it
    goes to stderr and stdout holds the answers alone."""
    path = harmony_llm.path
    script.say(harmony_llm.tokenizer, HARMONY_REPLY)
    monkeypatch.setenv("FORCE_COLOR" if color else "NO_COLOR", "1")
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    assert cli.main(["chat", str(path), "-n", "200", "--dtype", "float32", "--kv-cache-memory", "4e6",
                     "--reasoning-effort", "high"]) == 0
    out, err = capsys.readouterr()
    if color:
        dimmed = re.findall(re.escape(DIM) + "(.*?)" + re.escape(UNDIM), out, re.S)
        assert "".join(dimmed) == REASONING  # all of it dimmed, and nothing else
        assert out.replace(DIM, "").replace(UNDIM, "") == f"> {REASONING}\n\n{ANSWER}\n> "
    else:
        assert out == f"> {ANSWER}\n> " and REASONING in err and DIM not in out + err


def test_cli_generate_splits_unless_raw(harmony_llm, script, monkeypatch, capsys):
    script.say(harmony_llm.tokenizer, HARMONY_REPLY)
    monkeypatch.setenv("NO_COLOR", "1")
    args = ["generate", str(harmony_llm.path), "Hi", "-n", "200", "--dtype", "float32", "--kv-cache-memory", "4e6"]
    assert cli.main(args) == 0
    out, err = capsys.readouterr()
    assert out == f"{ANSWER}\n" and f"{REASONING}\n" in err and "finish=stop" in err
    assert cli.main(args + ["--raw"]) == 0  # no chat template: the text as decoded, nothing split
    assert capsys.readouterr().out == harmony_llm.tokenizer.decode(script.tokens[:-1]) + "\n"


def test_anthropic_messages_carry_thinking_blocks(think, script):
    """A reasoning model through Anthropic's Messages API: a thinking block, then the text, whole and streamed."""
    import anthropic
    url, llm = think
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    script.say(llm.tokenizer, THINK_REPLY)
    m = client.messages.create(model="test-model", max_tokens=200, messages=HI)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", REASONING), ("text", ANSWER)]
    assert m.stop_reason == "end_turn"
    script.say(llm.tokenizer, THINK_REPLY)
    with client.messages.stream(model="test-model", max_tokens=200, messages=HI) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", REASONING), ("text", ANSWER)]


def test_responses_carry_reasoning_items(think, script):
    """A reasoning model through the Responses API: a reasoning item, then the message, whole and streamed."""
    import openai
    url, llm = think
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    script.say(llm.tokenizer, THINK_REPLY)
    r = client.responses.create(model="test-model", input="Hi", max_output_tokens=200)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING and r.output_text == ANSWER
    script.say(llm.tokenizer, THINK_REPLY)
    events = list(client.responses.create(model="test-model", input="Hi", max_output_tokens=200, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == REASONING and events[-1].response.output_text == ANSWER
