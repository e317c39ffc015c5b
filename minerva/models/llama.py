"""Llama family: Llama 2/3, Mistral, SmolLM2, TinyLlama; Qwen3 (the same block with
QK-norm); and their mixture-of-experts forms, Mixtral and Qwen3-MoE."""

from __future__ import annotations

from minerva.models.causal_lm import CausalLM
from minerva.models.config import ModelConfig
from minerva.models.layers import (Attention, DecoderLayer, GatedMLP, Linear, MoE, RMSNorm,
                                   Rotary, rope_inv_freq)
from minerva.models.weights import WeightSource

FFN = ("gate_proj", "up_proj", "down_proj")


def linear(w: WeightSource, name: str) -> Linear:
    """The matrix `name`, with its bias where the file has one (attention_bias, mlp_bias)."""
    return Linear(w.weight(name), w.tensor(name + ".bias") if w.has(name + ".bias") else None)


def feed_forward(config: ModelConfig, w: WeightSource, prefix: str, activation: str) -> GatedMLP | MoE:
    """The layer's feed-forward: a MoE where the file has a router for it, else dense."""
    limit = config.swiglu_limit
    if not w.has(prefix + "router"):
        return GatedMLP(*(linear(w, prefix + n) for n in FFN), activation=activation, limit=limit)
    names = [prefix + "experts." + n for n in FFN]
    weights = [w.experts(n) for n in names]
    biases = [w.expert_biases(n) or [None] * len(ws) for n, ws in zip(names, weights)]
    experts = [GatedMLP(*(Linear(ws[e], bs[e]) for ws, bs in zip(weights, biases)), activation=activation,
                        limit=limit) for e in range(len(weights[0]))]
    router = prefix + "router"
    return MoE(Linear(w.weight(router), w.tensor(router + ".bias") if w.has(router + ".bias") else None), experts,
               config.num_experts_per_tok, config.moe_routing, config.moe_renormalize)


def build(config: ModelConfig, w: WeightSource) -> CausalLM:
    factors = w.tensor("rope_freqs") if w.has("rope_freqs") else None
    rotary = Rotary(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, factors))
    eps = config.rms_norm_eps
    qwen3 = config.architecture in ("qwen3", "qwen3moe")  # whose every layer norms its queries and keys
    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        qk_norms = [RMSNorm(w.tensor(p + n), eps) if w.has(p + n) or qwen3 else None for n in ("q_norm", "k_norm")]
        attn = Attention(config, i, *(linear(w, p + n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                         rotary=rotary, q_norm=qk_norms[0], k_norm=qk_norms[1])
        layers.append(DecoderLayer(attn, feed_forward(config, w, p, "silu"),
                                   RMSNorm(w.tensor(p + "input_norm"), eps),
                                   RMSNorm(w.tensor(p + "pre_mlp_norm"), eps)))
    embed = w.weight("embed_tokens")
    head = embed if config.tie_word_embeddings else w.weight("lm_head")
    return CausalLM(config, embed, layers, RMSNorm(w.tensor("norm"), eps), Linear(head))
