"""LoRA adapters in PEFT's format against PEFT's own merged model (transformers, float32):
greedy output equal, alone and batched with the base model and other adapters; the prefix
cache kept apart per adapter; the native layer paths still taken without adapter rows;
errors for adapters that cannot apply; the server's adapter model ids."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import torch

from minerva import LLM, SamplingParams
from minerva.errors import MinervaError
from tests.helpers import tiny_hf
from tests.helpers.lora import greedy, make_adapter
from tests.helpers.server import running_server

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [(7 * i + 3) % 250 + 2 for i in range(40)]  # more than two KV blocks: the prefix cache is used


def smollm2_hf_prompt() -> list[int]:
    return [504, 3458, 314, 260, 1345, 282, 4649, 30, 2010]  # in-vocabulary ids of SmolLM2


def params(adapter=None, n=12):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, adapter=adapter)


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("lora")
    base = tiny_hf.save(tmp, "llama-untied")
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    merged = {"a1": make_adapter(hf, tmp / "a1", 1, ALL), "a2": make_adapter(hf, tmp / "a2", 2, ["q_proj", "v_proj"])}
    refs = {None: greedy(hf, PROMPT, 12), **{k: greedy(m, PROMPT, 12) for k, m in merged.items()}}
    assert len({tuple(v) for v in refs.values()}) == 3  # each adapter changes the answer
    return base, tmp, refs


def test_adapters_equal_peft_merged_alone_and_batched(tiny_adapters):
    base, tmp, refs = tiny_adapters
    llm = LLM(str(base), dtype="float32", lora={"a1": str(tmp / "a1"), "a2": str(tmp / "a2")}, kv_cache_memory=8e6)
    for name in (None, "a1", "a2", None, "a1"):  # the same prompt again: its cached blocks are its adapter's only
        assert llm.generate([PROMPT], params(name), use_tqdm=False)[0].token_ids == refs[name], name
    outs = llm.generate([PROMPT] * 4, [params(a) for a in ("a2", None, "a1", "a2")], use_tqdm=False)
    assert [o.token_ids for o in outs] == [refs["a2"], refs[None], refs["a1"], refs["a2"]]
    with pytest.raises(MinervaError, match="no LoRA adapter named 'a3' \\(adapters: a1, a2\\)"):
        llm.generate([PROMPT], params("a3"), use_tqdm=False)


def test_adapter_on_a_packed_gguf_model(smollm2_gguf, smollm2_hf, tmp_path):
    """SmolLM2 Q4_1 (packed weights, fused Q/K/V and gate/up, the native layer kernels) with
    an adapter, against PEFT's merged model on the same weights dequantized."""
    merged = make_adapter(smollm2_hf, tmp_path / "ad", 3, ALL, rank=8, std=0.05)
    prompt = smollm2_hf_prompt()
    want, plain = greedy(merged, prompt, 10), greedy(smollm2_hf, prompt, 10)
    assert want != plain
    llm = LLM(str(smollm2_gguf), dtype="float32", activations="float", lora={"ad": str(tmp_path / "ad")},
              kv_cache_memory=32e6)
    assert llm.loaded.model.layers[0].fused is not None  # the native paths exist and steps without adapters take them
    assert llm.generate([prompt], params("ad", 10), use_tqdm=False)[0].token_ids == want
    outs = llm.generate([prompt, prompt], [params(None, 10), params("ad", 10)], use_tqdm=False)
    assert [o.token_ids for o in outs] == [llm.generate([prompt], params(None, 10), use_tqdm=False)[0].token_ids, want]
    # the default dtype and activations (the native layers' adapted rows, their 8-bit kernels): batched equal to alone
    llm = LLM(str(smollm2_gguf), lora={"ad": str(tmp_path / "ad")}, kv_cache_memory=32e6)
    other = prompt[3:] + prompt[:3]
    alone = [llm.generate([p], params(a, 10), use_tqdm=False)[0].token_ids
             for p, a in ((prompt, "ad"), (other, None), (other, "ad"))]
    outs = llm.generate([prompt, other, other], [params("ad", 10), params(None, 10), params("ad", 10)], use_tqdm=False)
    assert [o.token_ids for o in outs] == alone and alone[1] != alone[2]
    # with n-gram speculation (the verification's rows adapted; a repeated prompt, so guesses come)
    llm = LLM(str(smollm2_gguf), dtype="float32", activations="float", lora={"ad": str(tmp_path / "ad")},
              kv_cache_memory=32e6, speculative="ngram")
    assert llm.generate([prompt * 3], params("ad", 10), use_tqdm=False)[0].token_ids == greedy(merged, prompt * 3, 10)
    assert llm.engine.speculator.stats.num_draft_tokens > 0


def test_adapter_on_gemma3_whose_projections_differ_in_type(gemma3_gguf, gemma3_hf, tmp_path):
    """Gemma 3 270M Q4_K_M: Q/K/V and gate/up of different GGML types (separate Linears, the
    native layer's adapters joined across them), sliding-window layers, post norms; against
    PEFT's merged model, and alone equal to batched."""
    merged = make_adapter(gemma3_hf, tmp_path / "ad", 4, ALL, rank=8, std=0.05)
    prompt = [2, 818, 5279, 529, 7001, 563, 506, 6207, 1003, 236761]
    want = greedy(merged, prompt, 10)
    assert want != greedy(gemma3_hf, prompt, 10)
    llm = LLM(str(gemma3_gguf), dtype="float32", activations="float", lora={"ad": str(tmp_path / "ad")},
              kv_cache_memory=32e6)
    layers = llm.loaded.model.layers
    assert all(layer.fused is not None for layer in layers)
    assert any(len(layer.attn.qkv_proj.linears()) > 1 or len(layer.mlp.gate_up.linears()) > 1 for layer in layers)
    assert llm.generate([prompt], params("ad", 10), use_tqdm=False)[0].token_ids == want
    outs = llm.generate([prompt, prompt], [params(None, 10), params("ad", 10)], use_tqdm=False)
    assert outs[1].token_ids == want


def test_adapters_that_cannot_apply_are_refused(tiny_adapters, tmp_path):
    base, tmp, _ = tiny_adapters
    with pytest.raises(MinervaError, match="is not a LoRA adapter: it needs adapter_config.json"):
        LLM(str(base), dtype="float32", lora={"x": str(base)})
    from transformers import AutoModelForCausalLM
    other = AutoModelForCausalLM.from_pretrained(tiny_hf.save(tmp_path, "tinyllama-mha"), dtype=torch.float32)
    make_adapter(other, tmp_path / "mha", 4, ["k_proj"])  # k_proj of 4 KV heads: 64 rows, the base has 32
    with pytest.raises(MinervaError, match=r"does not fit this model: layer 0 k_proj is 32 x 64.*another base model"):
        LLM(str(base), dtype="float32", lora={"mha": str(tmp_path / "mha")})
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_model.safetensors").write_bytes((tmp / "a1" / "adapter_model.safetensors").read_bytes())
    config = json.loads((tmp / "a1" / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(MinervaError, match="uses DoRA, which Minerva does not apply"):
        LLM(str(base), dtype="float32", lora={"d": str(dora)})
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp / "a1" / "adapter_model.safetensors"))
    for name, extra, words in [  # a layer the model lacks; a LoRA bias
        ("deep", {k.replace("layers.0.", "layers.99."): t.clone() for k, t in tensors.items() if "layers.0." in k},
         f"adapter 'deep' ({tmp_path / 'deep'}): it adapts layer 99, and the model has"),
        ("biased", {next(k for k in tensors if "lora_B" in k).replace(".weight", ".bias"): torch.zeros(4)},
         "LoRA biases (lora_bias) are not applied; use an adapter trained without them")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))
        save_file({**tensors, **extra}, str(tmp_path / name / "adapter_model.safetensors"))
        with pytest.raises(MinervaError, match=re.escape(words)):
            LLM(str(base), dtype="float32", lora={name: str(tmp_path / name)})
    llm = LLM(str(base), dtype="float32", kv_cache_memory=4e6)
    with pytest.raises(MinervaError, match="asks for the LoRA adapter 'a1', and none is loaded"):
        llm.generate([PROMPT], params("a1"), use_tqdm=False)


@pytest.mark.parametrize("change, words", [
    ({"r": 8}, "layer 0 down_proj has rank 4, and adapter_config.json says r = 8"),  # its scale would be wrong
    ({"r": None}, "r (the rank) must be an integer >= 1, got None"),
    ({"r": -4}, "r (the rank) must be an integer >= 1, got -4"),
    ({"r": 0}, "got 0"), ({"r": "four"}, "got 'four'"), ({"r": True}, "got True"),
    ({"lora_alpha": "eight"}, "lora_alpha must be a finite number, got 'eight'"),
    ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number, got nan"),
])
def test_an_adapter_config_that_does_not_say_how_to_scale_is_refused(tiny_adapters, tmp_path, change, words):
    base, tmp, _ = tiny_adapters
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_model.safetensors").write_bytes((tmp / "a1" / "adapter_model.safetensors").read_bytes())
    config = json.loads((tmp / "a1" / "adapter_config.json").read_text())
    assert config["r"] == 4
    (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(MinervaError, match=re.escape(words)):
        LLM(str(base), dtype="float32", lora={"b": str(bad)})


def test_an_unreadable_adapter_is_refused_in_one_line(tiny_adapters, tmp_path):
    base, tmp, _ = tiny_adapters
    for name, config, weights, words in [
        ("list", b"[1, 2]", None, "is not an adapter config: expected a JSON object"),
        ("deep", b"[" * 100000 + b"]" * 100000, None, "cannot read the adapter"),
        ("empty", None, b"", "cannot read the adapter"),
        ("corrupt", None, b"\xff" * 64, "cannot read the adapter"),
    ]:
        bad = tmp_path / name
        bad.mkdir()
        (bad / "adapter_config.json").write_bytes(config or (tmp / "a1" / "adapter_config.json").read_bytes())
        (bad / "adapter_model.safetensors").write_bytes(
            (tmp / "a1" / "adapter_model.safetensors").read_bytes() if weights is None else weights)
        with pytest.raises(MinervaError, match=re.escape(words)):
            LLM(str(base), dtype="float32", lora={"b": str(bad)})
    for lora in ({"a": 5}, {"": str(tmp / "a1")}, ["a1"]):
        with pytest.raises(MinervaError, match="lora must be a dict of adapter name"):
            LLM(str(base), dtype="float32", lora=lora)


def test_server_serves_each_adapter_as_a_model(tiny_adapters):
    base, tmp, refs = tiny_adapters
    llm = LLM(str(base), dtype="float32", lora={"a1": str(tmp / "a1")}, kv_cache_memory=8e6)
    with running_server(llm, served_model_name="tiny") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        cards = {m.id: m for m in client.models.list()}
        assert list(cards) == ["tiny", "a1"]
        assert cards["a1"].parent == "tiny" and cards["a1"].root == str(tmp / "a1")
        for model, ref in (("a1", refs["a1"]), ("tiny", refs[None])):
            r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.model == model
            assert r.choices[0].text == llm.tokenizer.decode(ref)
        r = httpx.post(f"{url}/v1/completions", json={"model": "a2", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404 and "'tiny' or 'a1'" in r.json()["error"]["message"]


def test_lora_command_line(tiny, tiny_adapters):
    from tests.helpers.cli import assert_clean_error, run
    assert_clean_error(run("serve", str(tiny), "--lora", "a1"), "--lora takes NAME=PATH")
    assert_clean_error(run("serve", str(tiny), "--lora", "a=x", "--lora", "a=y"), "--lora names 'a' twice")
    assert_clean_error(run("serve", str(tiny), str(tiny), "--lora", "a=x"), "--lora adapts one base model")
    assert_clean_error(run("serve", str(tiny), "--lora", f"tiny={tiny}", "--port", "0"),
                       "--lora names an adapter 'tiny', as the model is served")
    assert_clean_error(run("serve", str(tiny), "--served-model-name", "m", "n", "--lora", f"n={tiny}", "--port", "0"),
                       "--lora names an adapter 'n'")
    base, tmp, _ = tiny_adapters
    assert_clean_error(run("serve", str(tiny), "--lora", f"a1={tmp / 'a1'}", "--port", "0"),
                       "does not fit this model")  # the tiny GGUF is not the adapter's base


@pytest.mark.parametrize("act,weights", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                         (torch.bfloat16, torch.float32)])
def test_the_compiled_adapter_sum_equals_each_row_alone(act, weights):
    """`lora_add_` (rows grouped by adapter, several parts per projection, ranks with and without
    a specialized path, columns not a multiple of the kernel's block) against each row's
    x A^T B^T computed alone in float64; the base model's rows and parts no adapter
    adapts stay as they were; the torch path (no kernel) agrees too."""
    from minerva.kernels import native
    from minerva.models.lora import Adapters, LoraLinear

    gen = torch.Generator().manual_seed(5)
    inp, parts = 96, [(0, 70), (70, 40), (110, 130)]  # three parts, as a fused q/k/v projection
    owner = Adapters(["a", "b", "c"])
    adapters = {1: (16, [0, 2]), 2: (8, [1]), 3: (12, [0, 1, 2])}  # adapter -> rank, parts it adapts
    lins = [LoraLinear(owner), LoraLinear(owner)]
    for index, (rank, which) in adapters.items():
        for p in which:
            start, n = parts[p]
            A = torch.randn(rank, inp, generator=gen) / 8
            B = torch.randn(n, rank, generator=gen) / 4
            if weights == torch.bfloat16:  # the values the kernel reads
                A, B = A.bfloat16().float(), B.bfloat16().float()
            for lin in lins:
                lin.parts.setdefault(index, []).append((start, n, A, B))
    lins[0].pack(native.load(), weights)
    lins[1].pack(None, weights)
    per_seq, tokens = [1, 0, 3, 2, 1, 3, 1], [5, 2, 1, 3, 1, 6, 1]  # uneven rows per adapter, base rows among them
    owner.select(per_seq, tokens, torch.device("cpu"))
    rows = sum(tokens)
    x = torch.randn(rows, inp, generator=gen).to(act)
    y0 = torch.randn(rows, 240, generator=gen).to(act)
    want = y0.double()
    for row, a in enumerate(owner.rows.tolist()):
        for start, n, A, B in lins[0].parts.get(a, []):
            want[row, start:start + n] += x[row].double() @ A.double().T @ B.double().T
    tol = 1e-4 if act == torch.float32 else 3e-2
    for lin in lins:
        y = y0.clone()
        lin.add_(x, y)
        assert torch.allclose(y.double(), want, atol=tol, rtol=tol)
        base = owner.rows == 0
        assert torch.equal(y[base], y0[base])
        assert torch.equal(y[owner.rows == 2][:, :70], y0[owner.rows == 2][:, :70])  # a part adapter 2 leaves alone
    y = y0.clone()
    lins[0].add_(x[4:5].expand(rows, inp).contiguous(), y)  # one row alone vs beside others: the same bits
    alone = y0[0:1].clone()
    owner.select([1], [1], torch.device("cpu"))
    lins[0].add_(x[4:5], alone)
    owner.select(per_seq, tokens, torch.device("cpu"))
    assert torch.equal(y[0], alone[0])


def test_an_adapter_that_changes_nothing_is_said_and_a_damaged_one_refused(tiny_adapters, tmp_path, caplog):
    """No tensors, or NaN ones: refused; lora_alpha 0, or every lora_B zero (an untrained
    adapter): a warning, and the adapter's answers are the base model's."""
    from safetensors.torch import load_file, save_file

    base, tmp, refs = tiny_adapters
    config = json.loads((tmp / "a1" / "adapter_config.json").read_text())
    tensors = load_file(str(tmp / "a1" / "adapter_model.safetensors"))

    def adapter(name, config, tensors):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, str(tmp_path / name / "adapter_model.safetensors"))
        return str(tmp_path / name)

    with pytest.raises(MinervaError, match="holds no LoRA tensors"):
        LLM(str(base), dtype="float32", lora={"b": adapter("none", config, {})})
    key = next(iter(tensors))
    with pytest.raises(MinervaError, match=re.escape(f"{key} holds NaN or infinite values")):
        LLM(str(base), dtype="float32", lora={"b": adapter("nan", config, {**tensors, key: tensors[key] * float("nan")})})
    for name, why, cfg, ts in [
        ("alpha0", "its lora_alpha is 0", {**config, "lora_alpha": 0}, tensors),
        ("untrained", "every lora_B is zero", config,
         {k: torch.zeros_like(t) if "lora_B" in k else t for k, t in tensors.items()}),
    ]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="minerva"):
            llm = LLM(str(base), dtype="float32", kv_cache_memory=4e6, lora={"z": adapter(name, cfg, ts)})
        assert f"adapter 'z' ({tmp_path / name}) changes nothing: {why}" in caplog.text
        assert llm.generate([PROMPT], params("z"), use_tqdm=False)[0].outputs[0].token_ids == refs[None]
    # a scale no training gives: said at load, and its overflow an error, not an empty reply
    caplog.clear()
    with caplog.at_level("WARNING", logger="minerva"):
        llm = LLM(str(base), dtype="float32", kv_cache_memory=4e6,
                  lora={"z": adapter("huge", {**config, "lora_alpha": 1e38}, tensors)})
    scale = 1e38 / config["r"]
    assert f"adapter 'z' ({tmp_path / 'huge'}) scales its change by {scale:.3g} (lora_alpha / r" in caplog.text
    for sampling in (params("z"), SamplingParams(max_tokens=4, temperature=0.8, seed=1, adapter="z")):
        with pytest.raises(MinervaError, match="the model produced NaN/inf logits"):
            llm.generate([PROMPT], sampling, use_tqdm=False)
    assert llm.generate([PROMPT], params(), use_tqdm=False)[0].outputs[0].token_ids == refs[None]
