"""`minerva serve` against careless and hostile clients: bad Unicode, loose types, fields it does
not implement, requests that can never fit, long prompts, clients that vanish, and SIGTERM with
streams in flight. Every failure is a 4xx with an OpenAI error body; nothing a client sends
costs another client its answer."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minerva import LLM
from minerva.formats.chat import GEMMA3_TEMPLATE
from minerva.serve.guard import error_response
from tests.helpers.cli import assert_clean_error, run
from tests.helpers.server import free_port, is_up, metric, running_server, wait_for
from tests.helpers.tiny_gguf import write_tiny_llama

LONG_CONTEXT = 4096  # long enough that a stream outlasts a short shutdown timeout


@pytest.fixture(scope="module")
def served(tiny):
    llm = LLM(str(tiny), device="cpu", dtype="float32", kv_cache_memory=8e6, max_num_seqs=4)
    with running_server(llm, max_waiting=8) as (url, app):
        yield url, app


def post(url: str, route: str, body: dict | str, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{url}{route}", content=content, headers={"Content-Type": "application/json"},
                      timeout=timeout)


def assert_400(r: httpx.Response, *fragments: str, param: str | None = None) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    for f in fragments:
        assert f in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# ------------------------------------------------------------------ Unicode


SURROGATE = '"a\\ud800b"'  # JSON text for a string with a lone high surrogate


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", '{"prompt": %s, "max_tokens": 2}' % SURROGATE),
    ("/v1/completions", '{"prompt": ["ok", %s], "max_tokens": 2}' % SURROGATE),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}' % SURROGATE),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}], "max_tokens": 2}' % SURROGATE),
    ("/tokenize", '{"prompt": %s}' % SURROGATE),
    ("/tokenize", '{"messages": [{"role": "user", "content": %s}]}' % SURROGATE),
])
def test_lone_surrogate_is_400(served, route, body):
    assert_400(post(served[0], route, body), "lone surrogate", "U+D800")


def test_surrogate_pair_is_fine(served):
    r = post(served[0], "/v1/completions", '{"prompt": "a\\ud83d\\ude00b", "max_tokens": 2}')
    assert r.status_code == 200, r.text


# Bodies that succeed on every route, with strings in as many fields as the route takes.
TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
RICH_BODIES = [
    ("/v1/completions", {"model": "test-model", "prompt": "hi", "max_tokens": 2, "stop": ["zz"], "user": "u",
                         "guided_choice": ["ab", "cd"]}),
    ("/v1/completions", {"prompt": ["hi", "yo"], "max_tokens": 2, "stop": "zz", "guided_regex": "[a-z]+"}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_grammar": 'root ::= "a" | "b"'}),
    ("/v1/chat/completions", {
        "model": "test-model", "max_tokens": 2, "stop": "zz", "user": "u",
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "bob"}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "description": "d",
            "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "x+"}}}}}}),
    ("/v1/chat/completions", {
        "max_tokens": 2, "tool_choice": "auto",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                     {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer", "description": "an a"}}}}}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "tool_choice": {"type": "function", "function": {"name": "f"}},
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                  "type": "object", "properties": {"b": {"enum": ["x", "y"]}}}}}]}),
    ("/v1/embeddings", {"model": "test-model", "input": ["hi", "yo"], "encoding_format": "float", "user": "u"}),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "base64"}),
    ("/tokenize", {"model": "test-model", "prompt": "hi"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/detokenize", {"model": "test-model", "tokens": [65, 66]}),
]
LONE = ["\ud800", "\udfff", "a\udc00", "\ud83d", "x\ude00y", "\udbff\udbff"]  # lone halves, no pairs
ODD = ["\x00", "\uffff", "\ufffe", "\U0010ffff", "\u202e", "\x7f\x1b[31m", "\ud83d\ude00", "\u0301"]


def _string_places(value, where=()):
    """Every path to a string in a JSON body, and to every key (as (*path, KEY, name))."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*where, "KEY", key)
            yield from _string_places(item, (*where, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _string_places(item, (*where, i))
    elif isinstance(value, str):
        yield where


def _with(body, place, text: str, at: int):
    """A copy of `body` with `text` put into the string (or key) at `place`, at offset `at`."""
    body = json.loads(json.dumps(body))
    *parents, last = place
    if len(parents) >= 1 and parents[-1] == "KEY":
        *parents, _ = parents
        holder = body
        for p in parents:
            holder = holder[p]
        old = last
        holder[old[:at] + text + old[at:]] = holder.pop(old)
        return body
    holder = body
    for p in parents:
        holder = holder[p]
    old = holder[last]
    holder[last] = old[:at] + text + old[at:]
    return body


PLACES = [(i, place) for i, (_, body) in enumerate(RICH_BODIES) for place in _string_places(body)]


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    """A server whose context holds the tool-calling conversations of RICH_BODIES."""
    path = write_tiny_llama(tmp_path_factory.mktemp("roomy") / "roomy.gguf", context=2048)
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=8e6, max_num_seqs=4)
    with running_server(llm, max_waiting=8) as (url, app):
        yield url, app


def test_rich_bodies_succeed(roomy):
    """The property below starts from bodies that work: its 400s are the text's doing."""
    for route, body in RICH_BODIES:
        r = post(roomy[0], route, body)
        assert r.status_code == 200, (route, r.text)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(PLACES), lone=st.booleans(), pick=st.integers(0, 100), at=st.integers(0, 8))
def test_any_text_in_any_string_field_is_answered_4xx_or_2xx(roomy, where, lone, pick, at):
    """A lone surrogate in any string (or key) of any route's body is a 400 with OpenAI's error
    body, naming where it is; other unusual code points (NUL, noncharacters, U+10FFFF, escapes,
    combining marks, a valid pair) never make a 500."""
    i, place = where
    route, body = RICH_BODIES[i]
    text = (LONE if lone else ODD)[pick % len(LONE if lone else ODD)]
    content = json.dumps(_with(body, place, text, at))  # ensure_ascii: a surrogate as its \\u escape
    r = post(roomy[0], route, content)
    assert r.status_code < 500, (route, content, r.status_code, r.text)
    if lone:
        error = assert_400(r, "lone surrogate", "not Unicode")
        assert error["param"] is not None
    elif r.status_code >= 400:
        error = r.json()["error"]
        assert error["code"] == r.status_code and error["message"] and error["type"], r.text
    r.content.decode("utf-8")  # every answer is UTF-8


@pytest.mark.parametrize("route", ["/v1/models/%ED%A0%80", "/v1/models/%F4%90%80%80", "/v1/models/a%00b",
                                   "/nothing/%ED%A0%80", "/v1/completions?x=%ED%A0%80"])
def test_odd_paths_and_queries_are_4xx(served, route):
    r = httpx.get(f"{served[0]}{route}", timeout=30)
    assert 400 <= r.status_code < 500 and r.json()["error"]["message"], r.text


def test_an_error_echoing_a_surrogate_is_encodable():
    """The one place errors are built makes what they echo encodable, whatever a route passes."""
    response = error_response(404, "the model '\ud800' does not exist", "mo\udfffdel")
    body = json.loads(response.body)
    assert body["error"]["message"] == "the model '\\ud800' does not exist"
    assert body["error"]["param"] == "mo\\udfffdel"


# ------------------------------------------------------------------ hostile chat templates


HOSTILE_TEMPLATES = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "string doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}{{ ns.s }}",
}


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_hostile_chat_template_fails_one_request_only(tmp_path, name):
    """A model file whose chat template would run for hours or build gigabytes: the chat request
    gets a 500 naming the limit, /health answers while it renders, and the server goes on."""
    path = write_tiny_llama(tmp_path / "hostile.gguf", context=256, chat_template=HOSTILE_TEMPLATES[name])
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=4e6)
    with running_server(llm) as (url, _):
        outcome: dict = {}

        def chat() -> None:
            outcome["start"] = time.monotonic()
            outcome["r"] = post(url, "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
            outcome["end"] = time.monotonic()

        t = threading.Thread(target=chat)
        t.start()
        health = []
        while t.is_alive():
            r = httpx.get(f"{url}/health", timeout=60)
            health.append((time.monotonic(), r.status_code))
            time.sleep(0.02)
        t.join()
        r = outcome["r"]
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert "chat template" in r.json()["error"]["message"]
        during = [code for when, code in health if outcome["start"] < when < outcome["end"]]
        if name == "nested loops":  # renders until its time budget runs out: /health answers meanwhile
            assert during and set(during) == {200}, health
        assert post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


TWO_USERS = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]


@pytest.mark.parametrize("template, status, kind, words", [
    # the model file's fault: no conversation can be rendered with it
    ("{% for %}", 500, "server_error", "invalid chat template"),
    # the conversation's: the template refuses it (raise_exception), as Gemma 3's does
    (GEMMA3_TEMPLATE, 400, "invalid_request_error", "Conversation roles must alternate"),
])
def test_a_template_that_does_not_compile_is_the_servers_fault(tmp_path, template, status, kind, words):
    """A chat template that does not compile is a 500 on every chat route (the client cannot fix
    it), in each API's error shape; one that refuses the conversation stays a 400; completions
    still work either way."""
    path = write_tiny_llama(tmp_path / "template.gguf", context=256, chat_template=template)
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=4e6)
    with running_server(llm) as (url, _):
        r = post(url, "/v1/chat/completions", {"messages": TWO_USERS, "max_tokens": 2})
        assert r.status_code == status and r.json()["error"]["type"] == kind, r.text
        assert words in r.json()["error"]["message"]
        r = post(url, "/tokenize", {"messages": TWO_USERS})
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
        r = post(url, "/api/chat", {"model": "test-model", "messages": TWO_USERS, "stream": False})
        assert r.status_code == status and list(r.json()) == ["error"] and words in r.json()["error"], r.text
        r = post(url, "/v1/messages", {"model": "test-model", "messages": TWO_USERS, "max_tokens": 2})
        anthropic_kind = "api_error" if status == 500 else "invalid_request_error"
        assert r.status_code == status and r.json()["error"]["type"] == anthropic_kind, r.text
        assert words in r.json()["error"]["message"]
        assert post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_serve_refuses_a_chat_template_that_does_not_compile_at_start(tiny, tmp_path):
    """--chat-template is checked before the server starts: one error line naming it, no server."""
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    proc = run("serve", str(tiny), "--port", str(free_port()), "--chat-template", str(bad), timeout=300)
    assert_clean_error(proc, "invalid chat template", f"the chat template file '{bad}'")


# ------------------------------------------------------------------ types and fields


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "4"), ("max_tokens", 4.0), ("stream", "yes"), ("stream", 1), ("temperature", "1"),
    ("n", True), ("seed", "7"), ("ignore_eos", "true"), ("stop", 5), ("logprobs", "2"), ("echo", 0),
])
def test_types_are_strict(served, field, value):
    r = post(served[0], "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert_400(r, field, param=field)


def test_chat_types_are_strict(served):
    url = served[0]
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_400(post(url, "/v1/chat/completions", {**base, "logprobs": "true"}), param="logprobs")
    assert_400(post(url, "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": 5}]}))
    assert post(url, "/v1/chat/completions", {**base, "temperature": 0}).status_code == 200  # int for a float


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("messages, param, words", [
    ([{"role": "user", "content": None}], "messages.0", "a user message needs content"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}], "messages.0", "system message"),
    ([{"role": "user", "content": "hi", "tool_calls": [CALL]}], "messages.0", "tool_calls belong to assistant"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "content": "{}"}], "messages.2", "a tool message needs tool_call_id"),
])
def test_messages_carry_what_their_role_needs(served, messages, param, words):
    """What OpenAI's API refuses is a 400 naming the message, not a prompt made of guesses."""
    assert_400(post(served[0], "/v1/chat/completions", {"messages": messages, "max_tokens": 2}), words, param=param)


def test_a_tool_round_trip_and_a_null_assistant_content_pass(served):
    for messages in ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "{}"}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                      {"role": "user", "content": "and?"}]):
        r = post(served[0], "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("route,base", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_stream_options_need_stream(served, route, base):
    body = {**base, "max_tokens": 2, "stream_options": {"include_usage": True}}
    assert_400(post(served[0], route, body), "stream_options is only allowed with stream: true", param="stream_options")
    assert_400(post(served[0], route, {**body, "stream": False}), "stream_options", param="stream_options")
    assert post(served[0], route, {**body, "stream": True}).status_code == 200


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
])
def test_unimplemented_fields_are_400(served, field, value):
    url = served[0]
    for route, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/completions", {"prompt": "hi"})):
        r = post(url, route, {**base, "max_tokens": 2, field: value})
        assert_400(r, f"'{field}' is not supported", param=field)


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
])
def test_tools_are_for_chat_only(served, field, value):
    r = post(served[0], "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert_400(r, f"unknown field '{field}'", param=field)


def test_unknown_field_is_400_and_neutral_values_pass(served):
    url = served[0]
    r = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_a": 0.5})
    assert_400(r, "unknown field 'top_a'", param="top_a")
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "mood": "x"}]})
    assert_400(r, "unknown field 'messages.0.mood'")
    neutral = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
               "parallel_tool_calls": True}
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                           **neutral})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("key", [" 1 ", "1_0", "\u0661", "+1", "-1", "01", "1.0", "", "0x10"])
def test_logit_bias_keys_are_plain_integers(served, key):
    r = post(served[0], "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {key: 5}})
    assert_400(r, "logit_bias key", param="logit_bias")


def test_logit_bias_plain_key_works(served):
    url = served[0]
    [b] = post(url, "/tokenize", {"prompt": "B", "add_special_tokens": False}).json()["tokens"]
    r = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                      "logit_bias": {str(b): 100}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "BBB", r.text


# ------------------------------------------------------------------ status codes


def test_long_stop_string_is_accepted(served):
    stop = "a stop string longer than sixteen characters"
    r = post(served[0], "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": stop})
    assert r.status_code == 200, r.text
    r = post(served[0], "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [stop] * 16})
    assert r.status_code == 200, r.text
    assert_400(post(served[0], "/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}), param="stop")


def test_request_beyond_max_waiting_is_400_not_503(served):
    """Nine completions can never be queued under --max-waiting 8, however idle the server is."""
    url = served[0]
    r = post(url, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2})
    error = assert_400(r, "--max-waiting 8", "9 completions")
    assert "retry-after" not in r.headers and error["type"] == "invalid_request_error"
    assert post(url, "/v1/completions", {"prompt": ["a", "b"], "n": 4, "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------ long prompts


def test_prompt_longer_than_the_context_is_refused_untokenized(served, monkeypatch):
    """A prompt with more characters than the context could hold tokens is refused without being
    tokenized; the rest are tokenized on a worker thread, never on the event loop."""
    url, app = served
    tok = app.state.llm.tokenizer
    real, threads = tok.encode, []

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(tok, "encode", spy)
    limit = app.state.llm.engine.max_model_len * tok.max_token_chars
    r = post(url, "/v1/completions", {"prompt": "x" * (limit + 1), "max_tokens": 2})
    assert_400(r, f"{limit + 1} characters", "maximum context length", param="prompt")
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (limit + 1)}]})
    assert_400(r, "characters", "maximum context length", param="messages")
    assert threads == []
    r = post(url, "/v1/completions", {"prompt": "x" * 50, "max_tokens": 2})
    assert r.status_code == 200
    r = post(url, "/tokenize", {"prompt": "abc"})
    assert r.status_code == 200 and r.json()["count"] >= 3
    assert len(threads) == 2 and "MainThread" not in threads and all(threads), threads
    loop_thread = app.state.engine._loop._thread_id
    assert all(t != loop_thread for t in threads)


# ------------------------------------------------------------------ vanishing clients


def test_soak_random_disconnects_free_every_block(served):
    """16 streaming clients, half of which go away at a random point: every survivor gets its
    whole answer and [DONE], and the KV cache ends empty."""
    url = served[0]
    rng = random.Random(1234)
    plans = [(rng.random() < 0.5, rng.randint(1, 30)) for _ in range(16)]
    results: list = [None] * len(plans)

    def client(i: int, leave: bool, after: int) -> None:
        body = {"prompt": f"client {i}", "max_tokens": 40, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                if leave and len(lines) >= after:
                    break  # leaving the block closes the connection mid-stream
        results[i] = (r.status_code, lines)

    for round_ in range(2):
        threads = [threading.Thread(target=client, args=(i, *plan)) for i, plan in enumerate(plans)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        for (leave, _), (status, lines) in zip(plans, results):
            assert status in (200, 503), status
            if status == 200 and not leave:
                data = [ln for ln in lines if ln.startswith("data: ")]
                assert data[-1] == "data: [DONE]"
                assert sum(len(json.loads(d[6:])["choices"][0]["text"]) > 0 for d in data[:-1]) >= 1
        wait_for(lambda: metric(url, "minerva:kv_cache_used_blocks") == 0
                 and metric(url, "minerva:num_requests_running") == 0, what="an idle engine")
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


# ------------------------------------------------------------------ SIGTERM


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("long") / "long.gguf", context=LONG_CONTEXT)


@pytest.mark.parametrize("shutdown_timeout,finished", [(0.5, "abort"), (120, "length")])
def test_sigterm_ends_streams_cleanly(long_tiny, shutdown_timeout, finished):
    """SIGTERM with streams in flight, read by the openai SDK: within --shutdown-timeout they
    finish ("length"); past it they end with finish_reason "abort"; either way each stream gets
    its [DONE], and the server exits 0 without a traceback."""
    from openai import OpenAI

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minerva", "serve", str(long_tiny), "--port", str(port),
                             "--kv-cache-memory", "16e6", "--shutdown-timeout", str(shutdown_timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    max_tokens = 4000 if finished == "abort" else 400  # ~1 ms a token: 4 s, or well inside the timeout
    ends: list = []
    started = threading.Semaphore(0)

    def sdk_stream() -> None:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        reasons, first = [], True
        stream = client.completions.create(model="long", prompt="once upon a time", max_tokens=max_tokens,
                                           stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:  # raises if the connection breaks
            if first:
                started.release()
                first = False
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        ends.append(("sdk", reasons))

    def raw_stream() -> None:
        body = {"prompt": "once", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                if not lines:
                    started.release()
                lines.append(line)
        data = [ln for ln in lines if ln.startswith("data: ")]
        ends.append(("raw", data[-1], json.loads(data[-2][6:])["choices"][0]["finish_reason"]))

    try:
        wait_for(lambda: is_up(url), timeout=120, what="minerva serve to start")
        threads = [threading.Thread(target=sdk_stream) for _ in range(3)] + [threading.Thread(target=raw_stream)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=shutdown_timeout + 60)
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "CancelledError" not in out, out
    assert sorted(e[0] for e in ends) == ["raw", "sdk", "sdk", "sdk"], (ends, out)
    for e in ends:
        if e[0] == "sdk":
            assert e[1] == [finished], e
        else:
            assert e[1] == "data: [DONE]" and e[2] == finished, (e, out)


# ------------------------------------------------------------------ huge grammars


def _choices(n: int) -> list[str]:
    return [f"choice number {i}" for i in range(n)]


def test_a_huge_grammar_stalls_no_one(roomy):
    """While 20,000 choices compile (on the grammar workers, not the event loop nor the engine's
    thread), another stream's tokens keep coming and /health answers at once; 100,000 choices
    are over the size budget: a 400 naming the limit, without the grammar library's internals."""
    url = roomy[0]
    arrivals, outcome = [], {}

    def stream() -> None:
        body = {"prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())

    def huge() -> None:
        outcome["start"] = time.monotonic()
        outcome["r"] = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 40,
                                                     "guided_choice": _choices(20_000)}, timeout=120)
        outcome["end"] = time.monotonic()

    streaming = threading.Thread(target=stream)
    streaming.start()
    wait_for(lambda: len(arrivals) > 5, what="the stream's first tokens")
    compiling = threading.Thread(target=huge)
    compiling.start()
    health = []
    with httpx.Client(timeout=30) as client:  # one connection: the time is the server's, not a handshake's
        while compiling.is_alive():
            start = time.monotonic()
            assert client.get(f"{url}/health").status_code == 200
            health.append((start, time.monotonic() - start))
            time.sleep(0.01)
    compiling.join()
    streaming.join()
    assert outcome["r"].status_code == 200, outcome["r"].text
    assert outcome["r"].json()["choices"][0]["text"] in _choices(20_000)
    during = [took for when, took in health if outcome["start"] < when < outcome["end"]]
    assert len(during) >= 3, health  # the compilation took long enough to be watched
    assert max(during) < 0.2, during
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if outcome["start"] < b < outcome["end"]]
    assert gaps and max(gaps) < 0.5, gaps

    start = time.monotonic()
    r = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_choice": _choices(100_000)},
             timeout=120)
    error = assert_400(r, "over this server's limit of 524,288")
    assert "panic" not in error["message"] and "backtrace" not in error["message"]
    assert time.monotonic() - start < 30


def test_a_grammar_over_the_time_budget_is_a_400_and_stays_refused(roomy, monkeypatch):
    grammars = roomy[1].state.llm.engine.grammars
    monkeypatch.setattr(grammars, "seconds", 0.001)  # 20,000 choices take tens of ms on any machine
    body = {"prompt": "hi", "max_tokens": 2, "guided_choice": _choices(20_000) + ["timed"]}
    assert_400(post(roomy[0], "/v1/completions", body), "did not compile within 0.001 s")
    time.sleep(1.0)  # long after the worker has finished: still refused (the refusal is cached)
    assert_400(post(roomy[0], "/v1/completions", body), "did not compile within 0.001 s")
    monkeypatch.setattr(grammars, "seconds", 10.0)
    assert post(roomy[0], "/v1/completions", {**body, "guided_choice": ["a", "b"]}).status_code == 200


def test_a_panicking_grammar_library_is_one_plain_line():
    from minerva.engine.structured import library_message
    text = "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n   0: x\n"
    assert library_message(text) == "it is too large or too complex for the grammar compiler; simplify it"
    assert library_message("at 1(8): unknown name\n  1 | start: foo\n") == "at 1(8): unknown name 1 | start: foo"


@pytest.mark.parametrize("body, param, words", [
    # a field a union reads several ways: the problem, not "not a string"
    ('{"prompt": "hi", "stop": [""]}', "stop.0", "at least 1 character"),
    ('{"prompt": "hi", "stop": [%s]}' % ",".join(['"s"'] * 17), "stop", "at most 16 items"),
    ('{"prompt": [1, -1]}', "prompt.1", "greater than or equal to 0"),
    ('{"prompt": "hi", "temperature": NaN}', "temperature", "finite number"),
    ('{"prompt": "hi", "min_p": Infinity}', "min_p", "finite number"),
    # a body that is not one JSON object: no character offset taken for a field
    ('{"prompt": "hi", "max_tokens": 2} xyz', None, "not valid JSON"),
    (b'{"prompt": "\xff\xfe"}', None, "could not be read as JSON"),
])
def test_errors_name_the_problem(served, body, param, words):
    r = httpx.post(f"{served[0]}/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param and "more problems" not in r.text, r.text


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # no finite value


@pytest.mark.parametrize("route, body, param, words", [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "Field required"),
    *[("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}}, "response_format.json_schema.schema", "valid dictionary")
      for schema in (True, False)],
    ("/v1/completions", {"prompt": "hi", "guided_grammar": ""}, "guided_grammar", "non-empty"),
    # constraints that compile and that the grammar engine cannot follow
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "guided_regex": "a{1000000}"}, "guided_regex",
     "could not be followed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "guided_grammar": "root ::= root"}, "guided_grammar",
     "could not be followed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "guided_json": RECURSIVE}, "guided_json",
     "could not be followed"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ("/detokenize", {"tokens": [65, 10**6]}, "tokens.1", "out of range"),
    # a server without --speculative: guesses asked for are not silently dropped (0 asks for none)
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "speculative_tokens": 3}, "speculative_tokens",
     "without speculative decoding"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema", "needs its schema"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                          "schema": {"type": "bogus"}}}}, "text.format", "bogus"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4, "text": {"format": {
        "type": "json_schema", "name": "x", "schema": RECURSIVE}}}, "text.format", "could not be followed"),
])
def test_an_error_about_one_field_names_it(served, route, body, param, words):
    r = post(served[0], route, body)
    assert_400(r, words, param=param)
    if route == "/v1/responses":  # in this API's names
        assert "response_format" not in r.text, r.text


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "guided_regex": "a{1000000}"}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": RECURSIVE}}}),
])
def test_a_constraint_that_cannot_be_followed_names_its_field_in_a_stream_too(served, route, body):
    with httpx.stream("POST", f"{served[0]}{route}", json={**body, "stream": True}, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert "could not be followed" in error["message"] and error["code"] == 400, error
    assert error["param"] == ("guided_regex" if "guided_regex" in body else "response_format"), error


def test_what_asks_for_nothing_still_passes(served):
    """The refusals above are for what asks for something: speculative_tokens 0 and a schema given pass."""
    assert post(served[0], "/v1/completions", {"prompt": "hi", "max_tokens": 2, "speculative_tokens": 0}
                ).status_code == 200
    r = post(served[0], "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{"), r.text
    assert post(served[0], "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}).status_code == 200


def test_a_compressed_body_is_named(served):
    r = httpx.post(f"{served[0]}/v1/completions", content=gzip.compress(b'{"prompt": "hi"}'),
                   headers={"content-type": "application/json", "content-encoding": "gzip"}, timeout=60)
    assert r.status_code == 400 and "gzip-encoded" in r.json()["error"]["message"], r.text


def test_a_model_giving_nan_fails_its_requests_in_one_line_and_the_server_goes_on(tiny, caplog):
    """The NaN-logits error reaches the client as it is (a 500: the server's model is at
    fault, not the request), the log has one line and no traceback, and /health still answers."""
    import logging
    import math

    import torch
    llm = LLM(str(tiny), dtype="float32", kv_cache_memory=4e6)
    with torch.inference_mode():
        llm.loaded.model.norm.weight.fill_(math.nan)
    with caplog.at_level(logging.ERROR), running_server(llm) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 500 and "the model produced NaN/inf logits" in r.json()["error"]["message"], r.text
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    failed = [rec for rec in caplog.records if "engine step failed" in rec.getMessage()]
    assert failed and all(rec.exc_info is None for rec in failed)


def test_a_conversation_that_cannot_fit_is_refused_before_its_template_runs(served):
    """More messages than the context has tokens, or more characters than it can hold: a 400
    naming messages before the chat template renders (60,000 messages took its whole time
    budget on a busy server, and came back a 500 blaming the template)."""
    url, _ = served
    many = [{"role": "user", "content": "hi"}] * 300  # the tiny model's context: 256 tokens
    assert_400(post(url, "/v1/chat/completions", {"messages": many, "max_tokens": 1}),
               "the conversation (messages) has 300 items, more than this model's context of 256 tokens",
               param="messages")
    long = [{"role": "user", "content": "x" * 100_000}]
    assert_400(post(url, "/v1/chat/completions", {"messages": long, "max_tokens": 1}),
               "the conversation (messages) holds 100000 characters", param="messages")
    assert post(url, "/v1/chat/completions", {"messages": many[:3], "max_tokens": 1}).status_code == 200


def test_max_connections_fits_the_open_files_limit(monkeypatch, caplog):
    """The soft open-files limit is raised to the hard one, and a --max-connections past what
    it holds is lowered with a warning (accept() failing first made asyncio spin and log)."""
    import logging
    import resource

    from minerva.serve import server
    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.update(now=value))
    assert server.connection_cap(1024) == 1024 and limits["now"] == (4096, 4096)
    limits["now"] = (1024, 1024)
    with caplog.at_level(logging.WARNING, logger="minerva.serve"):
        assert server.connection_cap(1024) == 1024 - server.RESERVED_FILES
    assert "--max-connections 1024 lowered to 896: the open-files limit (ulimit -n) is 1024" in caplog.text


def test_accept_running_out_of_files_is_logged_once_without_a_traceback(caplog):
    import asyncio
    import logging

    from minerva.serve.server import quiet_accept_errors
    handler, loop, passed = quiet_accept_errors(), asyncio.new_event_loop(), []
    loop.default_exception_handler = passed.append
    try:
        with caplog.at_level(logging.WARNING, logger="minerva.serve"):
            for _ in range(1000):
                handler(loop, {"message": "socket.accept() out of system resource",
                               "exception": OSError(24, "Too many open files")})
            handler(loop, {"message": "something else"})
    finally:
        loop.close()
    assert [r.getMessage() for r in caplog.records].count(
        "cannot accept connections: [Errno 24] Too many open files (the open-files limit, ulimit -n; "
        "see --max-connections)") == 1
    assert all(r.exc_info is None for r in caplog.records) and passed == [{"message": "something else"}]
