"""`minerva serve` on the real default model, through the official `openai` client over HTTP.

The reference for every output is the offline API (`LLM.generate`) on the same prompt: greedy
and seeded requests must come back token for token the same whatever else the server runs.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from minerva import LLM, SamplingParams
from minerva.kernels import native
from tests.helpers.server import metric, running_server, wait_for

pytestmark = pytest.mark.slow

KV = 128e6  # bytes: ~170 blocks of 16 tokens for SmolLM2 in float32
CHAT = [{"role": "user", "content": "Name three fruits."}]


@pytest.fixture(scope="module")
def ref(smollm2_gguf):
    return LLM(str(smollm2_gguf), device="cpu", dtype="float32", kv_cache_memory=KV)


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    llm = LLM(str(smollm2_gguf), device="cpu", dtype="float32", kv_cache_memory=KV)
    with running_server(llm, served_model_name="smollm2-135m") as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", timeout=120, max_retries=0)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def test_chat_matches_offline(client, ref):
    want = ref.chat(CHAT, greedy(16))
    got = client.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    timings = got.model_extra["timings"]
    assert timings["prompt_n"] == len(want.prompt_token_ids) and timings["predicted_per_second"] > 0


def test_chat_stream_matches_offline(client, ref):
    want = ref.chat(CHAT, greedy(16))
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=CHAT, max_completion_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_completion_stream_and_not(client, ref):
    want = ref.generate("The capital of France is", greedy(12))[0]
    got = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=12,
                                    temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.prompt_tokens == len(ref.tokenizer.encode("The capital of France is"))
    assert got.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.completions.create(model="smollm2-135m", prompt="The capital of France is",
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_token_id_prompt_and_echo(client, ref):
    ids = ref.tokenizer.encode("Once upon a time")
    want = ref.generate([ids], greedy(6))[0]
    got = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert got.choices[0].text == ref.tokenizer.decode(ids) + want.text
    assert got.usage.prompt_tokens == len(ids)


def test_stop_strings(client, ref):
    free = ref.generate("1, 2, 3, 4,", greedy(40, ignore_eos=True))[0].text
    assert " 7" in free
    got = client.completions.create(model="smollm2-135m", prompt="1, 2, 3, 4,", max_tokens=40, temperature=0,
                                    stop=[" 7", "zzz"], extra_body={"ignore_eos": True})
    assert got.choices[0].text == free[: free.index(" 7")]
    assert got.choices[0].finish_reason == "stop"


def test_stop_token_ids(client, ref):
    free = ref.generate("1, 2, 3, 4,", greedy(12, ignore_eos=True))[0]
    stop = free.token_ids[4]
    cut = free.token_ids.index(stop)  # its first place
    got = client.completions.create(model="smollm2-135m", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    choice = got.choices[0]
    assert choice.text == ref.tokenizer.decode(free.token_ids[:cut]) and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(model="smollm2-135m", prompt="1", max_tokens=2, extra_body={"stop_token_ids": [-1]})


def test_seed_reproduces_and_n(client, ref):
    args = dict(model="smollm2-135m", prompt="Write a word:", max_tokens=12, temperature=1.0, top_p=0.9, seed=7,
                n=2, extra_body={"ignore_eos": True})
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    want = ref.generate("Write a word:", SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, n=2,
                                                        ignore_eos=True))[0]
    assert [c.text for c in a.choices] == [o.text for o in want.outputs]
    assert a.choices[0].text != a.choices[1].text  # sibling seeds differ
    assert a.usage.completion_tokens == 24


def test_logprobs_shape(client, ref):
    got = client.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)
    assert all(t.token == t.top_logprobs[0].token for t in content)  # greedy picks the most likely
    ref_lp = ref.chat(CHAT, greedy(8, logprobs=3)).outputs[0].logprobs

    def text(token_id):  # the reference tokenizer's text of one token
        return ref.tokenizer.decode([token_id], skip_special_tokens=False)

    assert [t.token for t in content] == [text(w.token_id) for w in ref_lp]
    assert [t.logprob for t in content] == pytest.approx([w.logprob for w in ref_lp], abs=1e-5)
    assert [[(a.token, a.logprob) for a in t.top_logprobs] for t in content] == [
        [(text(i), pytest.approx(lp, abs=1e-5)) for i, lp in w.top] for w in ref_lp]
    assert all(t.bytes == list(t.token.encode()) for t in content)
    comp = client.completions.create(model="smollm2-135m", prompt="1, 2, 3,", max_tokens=5, temperature=0,
                                     logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == comp.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs)
    want = ref.generate("1, 2, 3,", greedy(5, logprobs=2))[0].outputs[0].logprobs
    assert lp.token_logprobs == pytest.approx([w.logprob for w in want], abs=1e-5)


def test_logprobs_of_a_character_in_several_tokens(served):
    """A character whose UTF-8 spans tokens: each token's own bytes (joined, the reply's UTF-8,
    as OpenAI's `bytes` field is for), named "bytes:\\x.." as OpenAI names them, and in the
    legacy top_logprobs one key per token."""
    url = served[0]
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Smile"}], "max_tokens": 8,
            "temperature": 0, "logprobs": True, "top_logprobs": 5, "guided_regex": "\U0001F600\U0001F600"}
    got = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    content = got["logprobs"]["content"]
    assert got["message"]["content"] == "\U0001F600\U0001F600" and len(content) > 2
    assert bytes(b for t in content for b in t["bytes"]).decode() == got["message"]["content"]
    assert any(t["token"].startswith("bytes:\\x") for t in content)
    for t in content:
        for top in t["top_logprobs"]:
            assert top["token"] == (bytes(top["bytes"]).decode() if not top["token"].startswith("bytes:") else
                                    "bytes:" + "".join(f"\\x{b:02x}" for b in top["bytes"]))
    legacy = httpx.post(f"{url}/v1/completions", json={"model": "smollm2-135m", "prompt": "Smile", "max_tokens": 4,
                                                        "temperature": 0, "logprobs": 5,
                                                        "guided_regex": "\U0001F600"}, timeout=120).json()
    assert all(len(top) == 5 for top in legacy["choices"][0]["logprobs"]["top_logprobs"])  # no two keys alike


def test_bad_requests_are_400(client, served):
    url = served[0]
    for kwargs, fragment in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                             (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
                             (dict(logprobs=99), "logprobs"),
                             (dict(max_tokens=100000), "maximum context length")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="smollm2-135m", prompt="Hi", **kwargs)
        assert fragment in e.value.message, e.value.message
        assert e.value.body["type"] == "invalid_request_error"
    limit = served[1].state.llm.engine.max_model_len
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {limit} tokens"):
        client.completions.create(model="smollm2-135m", prompt="word " * 3000, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="prompt token id 99999999 is out of range"):
        client.completions.create(model="smollm2-135m", prompt=[1, 99999999], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="logit_bias") as e:
        client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=1, logit_bias={"99999999": 1})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError, match="stop_token_ids names token id 1000000000") as e:
        client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=1,
                                  extra_body={"stop_token_ids": [2, 1000000000]})
    assert e.value.body["param"] == "stop_token_ids"
    with pytest.raises(openai.NotFoundError, match="smollm2-135m"):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    for body in (b"{not json", b"[]", b'{"prompt": 5}', b'{"messages": []}'):
        r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/completions", content=b"x" * (5 << 20))
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_models_health_tokenize(served, ref):
    url = served[0]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "smollm2-135m"
    assert models["data"][0]["max_model_len"] == served[1].state.llm.engine.max_model_len
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["tokens"] == ref.tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    chat = httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == ref.encode_prompt(ref.apply_chat_template(CHAT))
    assert httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello world"}
    assert httpx.post(f"{url}/detokenize", json={"tokens": [10**9]}).status_code == 400
    schema = httpx.get(f"{url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize",
            "/detokenize"} <= set(schema["paths"])


def test_32_concurrent_streams(served, ref):
    url = served[0]
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]
    want = [o.text for o in ref.generate(prompts, greedy(10, ignore_eos=True))]
    aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)

    async def one(prompt):
        stream = await aclient.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=10,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    got = asyncio.run(all_of_them())
    assert got == want
    wait_for(lambda: metric(url, "minerva:kv_cache_used_blocks") == 0
             and metric(url, "minerva:num_requests_running") == 0, what="KV blocks freed")
    assert metric(url, "minerva:kv_cache_usage_perc") == 0


def _started_and_cut(url: str, stream: bool) -> None:
    body = {"model": "smollm2-135m", "prompt": "Tell me a long story.", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(6):  # a few events, then hang up
                next(lines)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_blocks(served, stream):
    url = served[0]
    aborted = metric(url, "minerva:request_success_total", 'finished_reason="abort"')
    _started_and_cut(url, stream)
    wait_for(lambda: metric(url, "minerva:num_requests_running") == 0
             and metric(url, "minerva:kv_cache_used_blocks") == 0, what="the aborted request to free its blocks")
    assert metric(url, "minerva:request_success_total", 'finished_reason="abort"') == aborted + 1
    assert served[1].state.engine.num_unfinished == 0
    # and the server still serves
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_metrics_names(served):
    r = httpx.get(f"{served[0]}/metrics")
    text = r.text
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
             "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
             "generation_tokens_total", "time_to_first_token_seconds_bucket",
             "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
             "request_queue_time_seconds_bucket", "request_success_total", "cpu_pool_parallel_calls_total",
             "cpu_pool_backed_off_calls_total", "cpu_pool_stalls_total", "cpu_pool_backoffs_total",
             "cpu_pool_wait_seconds_total",
             "structured_output_rows_total", "structured_output_mask_fill_seconds_total",
             "structured_output_mask_apply_seconds_total", "tp_all_reduce_calls_total", "tp_all_reduce_seconds_total")
    for name in names:
        assert f"minerva:{name}" in text, name
    assert metric(served[0], "minerva:generation_tokens_total") > 0
    pool = native.pool_stats()  # the kernels' own counters, read after the metrics: never behind them
    if pool is not None:
        assert 0 <= metric(served[0], "minerva:cpu_pool_parallel_calls_total") <= pool["parallel_calls"]
        assert 0 <= metric(served[0], "minerva:cpu_pool_stalls_total") <= pool["stalls"]
        assert 0 <= metric(served[0], "minerva:cpu_pool_wait_seconds_total") <= pool["wait_seconds"]
    # Prometheus' text format, as prometheus_client's own parser reads it: every name is a sample
    # (not only a HELP line), labelled with the served model.
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    assert {f"minerva:{name}" for name in names} <= set(samples)
    generated = samples["minerva:generation_tokens_total"]
    assert generated.labels == {"model_name": "smollm2-135m"}
    assert generated.value == metric(served[0], "minerva:generation_tokens_total")


def test_shutdown_ends_in_flight_requests(smollm2_gguf):
    """Shutting down with a request still generating: after the shutdown timeout the stream ends
    with finish_reason "abort" and [DONE], the engine thread stops, and the request's blocks are
    freed."""
    import threading
    import time

    llm = LLM(str(smollm2_gguf), device="cpu", dtype="float32", kv_cache_memory=32e6)
    events = []
    with running_server(llm, shutdown_timeout=1.0) as (url, app):
        def client():
            body = {"prompt": "Tell me a long story.", "max_tokens": 600, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        events.append(line)
            except httpx.HTTPError as exc:
                events.append(f"closed: {type(exc).__name__}")

        t = threading.Thread(target=client)
        t.start()
        wait_for(lambda: len(events) > 4, what="the stream to start")
        start = time.monotonic()
    t.join(30)
    assert not t.is_alive() and time.monotonic() - start < 15
    data = [e for e in events if e.startswith("data: ")]
    assert data[-1] == "data: [DONE]", events[-3:]
    assert '"finish_reason": "abort"' in data[-2], data[-2]
    assert not app.state.engine.alive
    assert llm.engine.blocks.num_used_blocks == 0 and not llm.engine.has_unfinished()
