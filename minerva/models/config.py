"""The model configuration: one frozen dataclass built from GGUF metadata or config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from minerva.errors import MinervaError

FULL, SLIDING = "full", "sliding"
# How a mixture-of-experts router turns its logits into the chosen experts' weights:
# SOFTMAX_TOPK: softmax over all experts, keep the top k (Mixtral, Qwen3-MoE; then
# renormalised to sum to 1 when `moe_renormalize`); TOPK_SOFTMAX: the top k logits, softmax
# over those k (GPT-OSS).
SOFTMAX_TOPK, TOPK_SOFTMAX = "softmax_topk", "topk_softmax"

# Upper bounds far above any released model (Llama 3.1 405B: 126 layers, hidden 16384,
# 128 heads, feed-forward 53248; vocabularies up to ~262k; contexts up to 10M tokens). A
# value past one comes from a corrupt or hostile file and is refused before anything is
# sized from it (a 10^9-layer file would otherwise build a 10^9-entry tuple first).
LIMITS: dict[str, tuple[int, str]] = {
    "num_layers": (1024, "layer count"),
    "hidden_size": (1 << 17, "hidden size"),
    "intermediate_size": (1 << 20, "feed-forward size"),
    "num_heads": (1024, "head count"),
    "num_kv_heads": (1024, "KV head count"),
    "head_dim": (4096, "head size"),
    "vocab_size": (1 << 21, "vocabulary size"),
    "max_position": (1 << 24, "context length"),
    "sliding_window": (1 << 24, "sliding window"),
    "num_experts": (4096, "expert count"),
    "num_experts_per_tok": (4096, "experts-per-token count"),
    "expert_intermediate_size": (1 << 20, "expert feed-forward size"),
}

MAY_BE_ZERO = {"num_experts", "num_experts_per_tok"}  # 0: a dense model


def check_plausible(values: Mapping[str, Any], source: str, keys: Mapping[str, str]) -> None:
    """Refuse a size no real model comes near; `keys` gives the file's own name for each field."""
    for name, (limit, what) in LIMITS.items():
        value = values.get(name)
        low = 0 if name in MAY_BE_ZERO else 1
        if value is not None and not (isinstance(value, int) and low <= value <= limit):
            raise MinervaError(f"{source}: {keys.get(name, name)} = {value!r} is not a plausible {what} "
                               f"({low} to {limit}); the file is corrupt or not a model Minerva can run")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: none, linear (position interpolation), llama3 or yarn."""

    kind: str = "none"  # none | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # yarn: the ramp between beta_fast and beta_slow rotations, unrounded unless `truncate`;
    # cos and sin scaled by attention_factor (None: 0.1 ln(factor) + 1)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # key of minerva.models.ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool = True
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # Sliding-window attention: layer_types[i] is FULL or SLIDING.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # base for sliding layers when it differs (Gemma 3)
    attn_scale: float | None = None  # softmax scale; None means head_dim ** -0.5
    final_logit_softcap: float | None = None
    swiglu_limit: tuple[float, float] | None = None  # GPT-OSS's clamped SwiGLU: (limit, alpha)
    # Mixture of experts (0 experts: every feed-forward is dense). A layer whose file has a
    # router is a MoE layer; the others (Qwen3-MoE's `mlp_only_layers`) stay dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_intermediate_size: int | None = None  # None: intermediate_size
    moe_routing: str = SOFTMAX_TOPK
    moe_renormalize: bool = True

    def __post_init__(self):
        check_plausible(vars(self), "invalid model config", {})
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)
        checks = {
            "num_layers": self.num_layers > 0,
            "hidden_size": self.hidden_size > 0,
            "num_heads": self.num_heads > 0,
            "num_kv_heads": self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
            "head_dim": self.head_dim > 0 and self.head_dim % 2 == 0,
            "vocab_size": self.vocab_size > 0,
            "layer_types": len(self.layer_types) == self.num_layers
            and set(self.layer_types) <= {FULL, SLIDING},
            "sliding_window": SLIDING not in self.layer_types or (self.sliding_window or 0) > 0,
            "num_experts_per_tok": (self.num_experts == 0 and self.num_experts_per_tok == 0)
            or 0 < self.num_experts_per_tok <= self.num_experts,
            "moe_routing": self.moe_routing in (SOFTMAX_TOPK, TOPK_SOFTMAX),
        }
        bad = [f"{k}={getattr(self, k)!r}" for k, ok in checks.items() if not ok]
        if bad:
            raise MinervaError(f"invalid model config: {', '.join(bad)} "
                               f"(heads={self.num_heads}, kv_heads={self.num_kv_heads})")

    @property
    def expert_ffn_size(self) -> int:
        return self.expert_intermediate_size or self.intermediate_size

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5
