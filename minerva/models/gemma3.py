"""Gemma 3 (text): interleaved sliding-window and global layers, QK-norm, GeGLU,
sandwich norms, scaled embeddings, separate rope bases for local and global layers."""

from __future__ import annotations

from minerva.models.causal_lm import CausalLM
from minerva.models.config import SLIDING, ModelConfig, RopeScaling
from minerva.models.layers import (Attention, DecoderLayer, GatedMLP, Linear, RMSNorm,
                                   Rotary, rope_inv_freq)
from minerva.models.weights import WeightSource


def build(config: ModelConfig, w: WeightSource) -> CausalLM:
    eps = config.rms_norm_eps
    rotary_global = Rotary(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))
    rotary_local = Rotary(rope_inv_freq(config.head_dim, config.rope_local_theta or config.rope_theta,
                                        RopeScaling()))
    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        norm = lambda n: RMSNorm(w.tensor(p + n), eps)  # noqa: E731
        rotary = rotary_local if config.layer_types[i] == SLIDING else rotary_global
        attn = Attention(config, i, *(Linear(w.weight(p + n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                         rotary=rotary, q_norm=norm("q_norm"), k_norm=norm("k_norm"))
        mlp = GatedMLP(*(Linear(w.weight(p + n)) for n in ("gate_proj", "up_proj", "down_proj")),
                       activation="gelu_tanh")
        layers.append(DecoderLayer(attn, mlp, norm("input_norm"), norm("pre_mlp_norm"),
                                   post_attn_norm=norm("post_attn_norm"),
                                   post_mlp_norm=norm("post_mlp_norm")))
    embed = w.weight("embed_tokens")
    head = embed if config.tie_word_embeddings else w.weight("lm_head")
    return CausalLM(config, embed, layers, RMSNorm(w.tensor("norm"), eps), Linear(head),
                    embed_scale=config.hidden_size**0.5)
