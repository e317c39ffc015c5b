"""GPT-OSS: a mixture of experts (top-k logits then softmax, experts with biases and a
clamped SwiGLU), attention with biases and a learned sink logit per head, sliding-window
layers alternating with full ones, YaRN rope."""

from __future__ import annotations

from minerva.models.causal_lm import CausalLM
from minerva.models.config import ModelConfig
from minerva.models.layers import (Attention, DecoderLayer, Linear, RMSNorm, Rotary, rope_inv_freq,
                                   yarn_attention_factor)
from minerva.models.llama import feed_forward
from minerva.models.weights import WeightSource


def build(config: ModelConfig, w: WeightSource) -> CausalLM:
    scaling = config.rope_scaling
    rotary = Rotary(rope_inv_freq(config.head_dim, config.rope_theta, scaling),
                    yarn_attention_factor(scaling) if scaling.kind == "yarn" else 1.0)
    eps = config.rms_norm_eps
    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."

        def linear(n: str) -> Linear:
            return Linear(w.weight(p + n), w.tensor(p + n + ".bias") if w.has(p + n + ".bias") else None)

        attn = Attention(config, i, *(linear(n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                         rotary=rotary, sinks=w.tensor(p + "sinks"))
        layers.append(DecoderLayer(attn, feed_forward(config, w, p, "swiglu_limit"),
                                   RMSNorm(w.tensor(p + "input_norm"), eps), RMSNorm(w.tensor(p + "pre_mlp_norm"), eps)))
    return CausalLM(config, w.weight("embed_tokens"), layers, RMSNorm(w.tensor("norm"), eps),
                    Linear(w.weight("lm_head")))
