"""Tiny random-weight checkpoints saved as SafeTensors: logits against HF transformers."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from minerva.errors import MinervaError
from minerva.models.loader import load_model
from tests.helpers.paged import paged_logits
from tests.helpers.tiny_gguf import write_gguf_from_hf
from tests.helpers.tiny_hf import CONFIGS, VOCAB, save


def logits_pair(path, ids):
    mine = paged_logits(load_model(path).model, ids, chunk=16)  # several chunks through the KV cache
    with torch.inference_mode():
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
                                           ("llama-untied", "lm_head.weight"),
                                           ("qwen3", "model.layers.0.self_attn.q_norm.weight")])
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
    del cfg["model_type"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MinervaError, match=r"config.json' names no model_type \(such as \"llama\"\)"):
        load_model(path)


def test_incomplete_rope_scaling(tmp_path):
    path = save(tmp_path, "llama-tied")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "llama3"}  # no factor
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MinervaError, match="config.json"):
        load_model(path)


@pytest.mark.parametrize("name", ["llama-untied", "llama3-rope-scaling", "tinyllama-mha", "llama-bias"])
def test_gguf_conversion_matches_transformers(tmp_path, name):
    """The same weights written as GGUF the way llama.cpp converts them (Q/K rows permuted,
    llama3 scaling as a rope_freqs tensor): Minerva's GGUF path against transformers."""
    hf_dir = save(tmp_path, name)
    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    path = tmp_path / f"{name}.gguf"
    write_gguf_from_hf(path, hf_dir)
    ids = torch.randint(0, VOCAB, (40,)).tolist()
    mine = paged_logits(load_model(path).model, ids, chunk=16)
    with torch.inference_mode():
        ref = ref_model(torch.tensor([ids])).logits[0]
    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (mine - ref).abs().max()
