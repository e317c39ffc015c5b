"""Tiny random-weight transformers checkpoints saved as SafeTensors model directories."""

from __future__ import annotations

import json

import gguf
import numpy as np
import torch
from gguf.quants import quantize
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, Qwen3Config, Qwen3MoeConfig)

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
MOE = dict(**COMMON, head_dim=16, moe_intermediate_size=32, initializer_range=0.1)
CONFIGS = {
    "llama-tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama-untied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=500000.0),
    "llama-bias": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    "llama3-rope-scaling": lambda: LlamaConfig(
        **COMMON, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "tinyllama-mha": lambda: LlamaConfig(**{**COMMON, "num_key_value_heads": 4}),
    "mistral-sliding": lambda: MistralConfig(**COMMON, sliding_window=8, tie_word_embeddings=False),
    "gemma3": lambda: Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16,
                                       sliding_window=8, query_pre_attn_scalar=16,
                                       layer_types=["sliding_attention", "full_attention"] * 2),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True),
    # Mixture of experts, with weights 5x the default scale so the routing shows in the
    # logits. qwen3-moe: 8 experts, 2 a token; layer 1 keeps a dense MLP (mlp_only_layers).
    "qwen3-moe": lambda: Qwen3MoeConfig(**MOE, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                        mlp_only_layers=[1], tie_word_embeddings=False),
    "qwen3-moe-unnormalized": lambda: Qwen3MoeConfig(**MOE, num_experts=4, num_experts_per_tok=3,
                                                     norm_topk_prob=False),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                     initializer_range=0.1, tie_word_embeddings=False),
    # GPT-OSS: 128-token windows shrunk to 8; YaRN over an original context of 32 so that
    # the ramp falls inside the 8 frequencies of a 16-dim head
    "gpt-oss": lambda: GptOssConfig(**{**MOE, "intermediate_size": 32, "num_hidden_layers": 4}, num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                                    rope_parameters={
                                        "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": False, "original_max_position_embeddings": 32,
                                        "rope_theta": 150000.0}),
    "mixtral-full": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                          initializer_range=0.1, tie_word_embeddings=False),
}


def save(tmp_path, name, dtype=torch.float32, shard=None, config=None):
    """Save the random model CONFIGS[name] (seeded, so the same every time) under tmp_path/name;
    `config`, when given, is the transformers config to use instead."""
    torch.manual_seed(0)
    config = config or CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms too, so an off-by-one norm convention shows up
        for n, p in model.named_parameters():
            if "norm" in n or (n.endswith(".bias") and name == "llama-bias"):  # biases start at 0
                p.normal_(0.0, 0.5)
            if n.endswith("experts.gate_up_proj") and name == "gpt-oss":
                p.mul_(40.0)  # gate and up values past GPT-OSS's clamp at ±7
    model = model.to(dtype)
    path = tmp_path / name
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    write_tokenizer(path)
    return path


def to_mxfp4(path):
    """Rewrite a saved GPT-OSS checkpoint's experts as the published checkpoints store them:
    MXFP4 `*_blocks` [experts, out, in / 32, 16] and `*_scales` [experts, out, in / 32], values
    quantized by the gguf package (elements 2j and 2j + 1 in the low and high nibble of byte j),
    with the config's `quantization_config`; transformers dequantizes them when it loads."""
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(1, 2).float()  # input-major -> [experts, out, in]
        experts, rows, cols = w.shape
        q = quantize(w.reshape(-1, cols).numpy(), gguf.GGMLQuantizationType.MXFP4)
        q = q.reshape(experts, rows, cols // 32, 17)
        elements = np.concatenate([q[..., 1:] & 15, q[..., 1:] >> 4], axis=-1)  # GGML: j and j + 16
        blocks = elements[..., 0::2] | (elements[..., 1::2] << 4)
        tensors[name + "_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
        tensors[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(q[..., 0]))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return path

