"""Tiny random-weight checkpoints saved as SafeTensors: logits against HF transformers."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig)

from minerva.engine.kv_cache import ContiguousKVCache, run_tokens
from minerva.errors import MinervaError
from minerva.models.loader import load_model

VOCAB = 257  # the tiny GGUF vocabulary: 256 byte symbols and one merge


def write_tokenizer(path):
    """A byte-level tokenizer with VOCAB tokens (256 bytes, one merge): a complete model directory."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet) + ["Ġt"])}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": sorted(alphabet)[0]}))


COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama-tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama-untied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=500000.0),
    "llama3-rope-scaling": lambda: LlamaConfig(
        **COMMON, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "tinyllama-mha": lambda: LlamaConfig(**{**COMMON, "num_key_value_heads": 4}),
    "mistral-sliding": lambda: MistralConfig(**COMMON, sliding_window=8, tie_word_embeddings=False),
    "gemma3": lambda: Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16,
                                       sliding_window=8, query_pre_attn_scalar=16,
                                       layer_types=["sliding_attention", "full_attention"] * 2),
}


def save(tmp_path, name, dtype=torch.float32, shard=None):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms too, so an off-by-one norm convention shows up
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.5)
    model = model.to(dtype)
    path = tmp_path / name
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    write_tokenizer(path)
    return path


def logits_pair(path, ids):
    loaded = load_model(path)
    m = loaded.model
    cache = ContiguousKVCache(m.config, len(ids), torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        mine = m.logits(run_tokens(m, cache, ids, chunk=16))  # several chunks through the KV cache
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(
            torch.tensor([ids])).logits[0]
    return mine, ref


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    ids = torch.randint(0, VOCAB, (40,)).tolist()  # longer than the sliding windows
    mine, ref = logits_pair(save(tmp_path, name), ids)
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (mine - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoint(tmp_path, dtype):
    ids = torch.randint(0, VOCAB, (20,)).tolist()
    mine, ref = logits_pair(save(tmp_path, "llama-untied", dtype=dtype), ids)
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint(tmp_path):
    path = save(tmp_path, "llama-untied", shard="50KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    ids = torch.randint(0, VOCAB, (20,)).tolist()
    mine, ref = logits_pair(path, ids)
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config,tensor", [("llama-untied", "model.layers.1.mlp.up_proj.weight"),
                                           ("llama-untied", "lm_head.weight")])
def test_missing_tensor_is_a_clear_error(tmp_path, config, tensor):
    from safetensors.torch import load_file, save_file

    path = save(tmp_path, config)
    tensors = load_file(path / "model.safetensors")
    del tensors[tensor]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MinervaError, match=tensor.split(".")[-2]):
        load_model(path)


def test_unsupported_model_type(tmp_path):
    path = save(tmp_path, "llama-tied")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt_bigcode"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MinervaError, match="gpt_bigcode.*not supported"):
        load_model(path)


def test_incomplete_rope_scaling(tmp_path):
    path = save(tmp_path, "llama-tied")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "llama3"}  # no factor
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MinervaError, match="config.json"):
        load_model(path)



@pytest.mark.parametrize("name", ["llama-untied", "llama3-rope-scaling", "tinyllama-mha"])
def test_gguf_conversion_matches_transformers(tmp_path, name):
    """The same weights written as GGUF the way llama.cpp converts them (Q/K rows permuted,
    llama3 scaling as a rope_freqs tensor): Minerva's GGUF path against transformers."""
    from tests.tiny_gguf import write_llama_from_hf

    hf_dir = save(tmp_path, name)
    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    path = write_llama_from_hf(tmp_path / f"{name}.gguf", ref_model)
    ids = torch.randint(0, VOCAB, (40,)).tolist()
    loaded = load_model(path)
    cache = ContiguousKVCache(loaded.config, len(ids), torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        mine = loaded.model.logits(run_tokens(loaded.model, cache, ids, chunk=16))
        ref = ref_model(torch.tensor([ids])).logits[0]
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (mine - ref).abs().max()
