"""Llama family: Llama 2/3, Mistral, SmolLM2, TinyLlama."""

from __future__ import annotations

from minerva.models.config import ModelConfig
from minerva.models.layers import (Attention, CausalLM, DecoderLayer, GatedMLP, Linear, RMSNorm,
                                   Rotary, rope_inv_freq)
from minerva.models.weights import WeightSource


def build(config: ModelConfig, w: WeightSource) -> CausalLM:
    factors = w.tensor("rope_freqs") if w.has("rope_freqs") else None
    rotary = Rotary(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, factors))
    eps = config.rms_norm_eps
    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        attn = Attention(config, i, *(Linear(w.weight(p + n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                         rotary=rotary)
        mlp = GatedMLP(*(Linear(w.weight(p + n)) for n in ("gate_proj", "up_proj", "down_proj")),
                       activation="silu")
        layers.append(DecoderLayer(attn, mlp, RMSNorm(w.tensor(p + "input_norm"), eps),
                                   RMSNorm(w.tensor(p + "pre_mlp_norm"), eps)))
    embed = w.weight("embed_tokens")
    head = embed if config.tie_word_embeddings else w.weight("lm_head")
    return CausalLM(config, embed, layers, RMSNorm(w.tensor("norm"), eps), Linear(head))


