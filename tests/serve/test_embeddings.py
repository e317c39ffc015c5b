"""`/v1/embeddings` on SmolLM2: the final hidden state of each input's last token, L2-normalized,
equal to transformers' on the same GGUF (its last hidden state, after the final norm), whatever
else shares the batch, as floats or base64 through the `openai` SDK; bad inputs are 400s."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from minerva import LLM
from tests.helpers.server import running_server

pytestmark = pytest.mark.slow
TEXTS = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock prices fell sharply today."]


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    llm = LLM(str(smollm2_gguf), device="cpu", dtype="float32", activations="float", kv_cache_memory=64e6)
    with running_server(llm, served_model_name="smollm2") as (url, _):
        yield url, llm


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def test_matches_transformers(served, client, smollm2_hf):
    url, llm = served
    ids = [llm.encode_prompt(t) for t in TEXTS]
    r = httpx.post(f"{url}/v1/embeddings", json={"input": ids, "model": "smollm2"}, timeout=60).json()
    assert r["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    assert [d["index"] for d in r["data"]] == [0, 1, 2] and r["model"] == "smollm2"
    for d, x in zip(r["data"], ids):
        with torch.no_grad():
            out = smollm2_hf(torch.tensor([x]), output_hidden_states=True)
        ref = torch.nn.functional.normalize(out.hidden_states[-1][0, -1].double(), dim=0)
        mine = torch.tensor(d["embedding"], dtype=torch.float64)
        assert mine.shape == ref.shape == (llm.config.hidden_size,)
        assert abs(mine.norm().item() - 1) < 1e-5
        assert (mine - ref).abs().max().item() < 1e-4, (mine - ref).abs().max().item()


def test_batched_equals_alone_and_base64(client):
    together = client.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
    for text, d in zip(TEXTS, together.data):
        alone = client.embeddings.create(model="smollm2", input=text, encoding_format="float").data[0]
        np.testing.assert_allclose(alone.embedding, d.embedding, rtol=0, atol=1e-6)
    raw = client.embeddings.with_raw_response.create(model="smollm2", input=TEXTS[:1], encoding_format="base64")
    packed = raw.http_response.json()["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(packed), dtype="<f4"),
                                  np.array(together.data[0].embedding, dtype=np.float32))
    vectors = np.array([d.embedding for d in together.data])
    similar, unrelated = vectors[0] @ vectors[1], vectors[0] @ vectors[2]
    assert similar > unrelated  # two sentences about a cat on a mat are nearer than one about stocks


def test_bad_inputs_are_400(served):
    url, llm = served

    def post(**body):
        return httpx.post(f"{url}/v1/embeddings", json={"model": "smollm2", **body}, timeout=60)

    for body, param, fragment in [
        ({"input": ""}, "input", "an input is empty"),
        ({"input": []}, "input", "an input is empty"),
        ({"input": ["a", ""]}, "input", "an input is empty"),
        ({"input": "hi", "dimensions": 7}, "dimensions", f"have {llm.config.hidden_size} dimensions"),
        ({"input": [10**9]}, "input", "out of range"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": [1] * llm.engine.max_model_len}, "input", "input 0 has"),
        ({"input": [[1]] * 300}, "input", "300 embeddings (inputs)"),
    ]:
        r = post(**body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and fragment in r.json()["error"]["message"], r.text
    assert post(input="hi", model="other").status_code == 404
    assert post(input="hi", dimensions=llm.config.hidden_size).status_code == 200


def test_truncate_prompt_tokens_keeps_the_last_tokens(served, client):
    url, llm = served
    ids = llm.encode_prompt(TEXTS[2])
    cut = client.embeddings.create(model="smollm2", input=[ids], extra_body={"truncate_prompt_tokens": 4})
    last = client.embeddings.create(model="smollm2", input=[ids[-4:]])
    assert cut.usage.prompt_tokens == 4
    np.testing.assert_allclose(cut.data[0].embedding, last.data[0].embedding, rtol=0, atol=1e-6)
    whole = client.embeddings.create(model="smollm2", input=[ids], extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)  # -1: as many as the model takes, all of these
    most = llm.engine.max_model_len - 1
    for k, fragment in [(0, "must be -1"), (-2, "must be -1"), (most + 1, f"takes ({most})")]:
        r = httpx.post(f"{url}/v1/embeddings", json={"model": "smollm2", "input": "hi", "truncate_prompt_tokens": k},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
        assert fragment in r.json()["error"]["message"], r.text
