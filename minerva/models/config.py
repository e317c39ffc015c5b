"""The model configuration: one frozen dataclass built from GGUF metadata or config.json, and
the ranges and agreements every config is checked against (`check_config`) before anything is
built from it."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Mapping

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
    "rope_scaling.original_max_position": (1 << 24, "original context length"),
}

MAY_BE_ZERO = {"num_experts", "num_experts_per_tok"}  # 0: a dense model


def _positive(v: float) -> bool:
    return v > 0


# The real-valued fields (a RopeScaling field as "rope_scaling.<field>"): (holds, what, allowed).
# A value must be a finite number that `holds`; None (where the field allows it) means unset.
# An epsilon of 0 or inf, or a rope base of 0, makes every output NaN or garbage without an error.
REALS: dict[str, tuple[Callable[[float], bool], str, str]] = {
    "rms_norm_eps": (lambda v: 0 < v < 1, "norm epsilon", "finite, > 0 and < 1"),
    "rope_theta": (lambda v: v > 1, "rope base", "finite, > 1"),
    "rope_local_theta": (lambda v: v > 1, "local rope base", "finite, > 1"),
    "attn_scale": (_positive, "attention scale", "finite, > 0"),
    "final_logit_softcap": (lambda v: v >= 0, "logit soft-cap", "finite, >= 0; 0 for none"),
    "rope_scaling.factor": (_positive, "rope scaling factor", "finite, > 0"),
    "rope_scaling.low_freq_factor": (_positive, "rope low-frequency factor", "finite, > 0"),
    "rope_scaling.high_freq_factor": (_positive, "rope high-frequency factor", "finite, > 0"),
    "rope_scaling.beta_fast": (_positive, "YaRN beta_fast", "finite, > 0"),
    "rope_scaling.beta_slow": (_positive, "YaRN beta_slow", "finite, > 0"),
    "rope_scaling.attention_factor": (_positive, "YaRN attention factor", "finite, > 0"),
}
OPTIONAL = {"rope_local_theta", "attn_scale", "final_logit_softcap", "rope_scaling.attention_factor"}

# Fields that must agree with others: (field, holds, allowed). `allowed` is formatted with the
# values and, as `<field>_key`, the file's name for each field ("." in a field's name as "_").
AGREEMENT: list[tuple[str, Callable[[Mapping[str, Any]], bool], str]] = [
    ("num_kv_heads", lambda c: c["num_heads"] % c["num_kv_heads"] == 0,
     "a divisor of {num_heads_key} = {num_heads}"),
    ("head_dim", lambda c: c["head_dim"] % 2 == 0, "an even number (rotary pairs)"),
    ("layer_types", lambda c: len(c["layer_types"]) == c["num_layers"] and set(c["layer_types"]) <= {FULL, SLIDING},
     "{num_layers} entries, each 'full' or 'sliding'"),
    ("sliding_window", lambda c: SLIDING not in c["layer_types"] or (c["sliding_window"] or 0) > 0,
     "at least 1 where layers slide"),
    ("num_experts_per_tok", lambda c: (c["num_experts"] == 0 and c["num_experts_per_tok"] == 0)
     or 0 < c["num_experts_per_tok"] <= c["num_experts"],
     "1 to {num_experts_key} = {num_experts}, or 0 for no experts"),
    ("moe_routing", lambda c: c["moe_routing"] in (SOFTMAX_TOPK, TOPK_SOFTMAX), f"{SOFTMAX_TOPK} or {TOPK_SOFTMAX}"),
    ("rope_scaling.high_freq_factor", lambda c: c["rope_scaling.kind"] != "llama3"
     or c["rope_scaling.high_freq_factor"] > c["rope_scaling.low_freq_factor"],
     "above {rope_scaling_low_freq_factor_key} = {rope_scaling_low_freq_factor}"),
]

_CORRUPT = "the file is corrupt or not a model Minerva can run"


def real(value: Any) -> Any:
    """float(value) for a number, else the value itself, for `check_config` to name."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def check_plausible(values: Mapping[str, Any], source: str, keys: Mapping[str, str]) -> None:
    """Refuse a size no real model comes near; `keys` gives the file's own name for each field."""
    for name, (limit, what) in LIMITS.items():
        value = values.get(name)
        low = 0 if name in MAY_BE_ZERO else 1
        counts = isinstance(value, int) and not isinstance(value, bool)
        if value is not None and not (counts and low <= value <= limit):
            raise MinervaError(f"{source}: {keys.get(name, name)} = {value!r} is not a plausible {what} "
                               f"(a whole number, {low} to {limit}); {_CORRUPT}")


def check_config(values: Mapping[str, Any], source: str, keys: Mapping[str, str]) -> None:
    """Refuse a config no model can have, before anything is built from it: a size out of
    `LIMITS`, a real number out of `REALS` (NaN, inf, a zero epsilon or rope base), fields
    that contradict each other (`AGREEMENT`). `values` are ModelConfig fields (unset ones take
    their defaults); `keys` gives the file's own name for each field. One error, on one line,
    names the first bad field, its value and what it may be."""
    flat = {**_defaults(), **values}
    scaling = flat["rope_scaling"]
    if isinstance(scaling, RopeScaling):
        flat.update({f"rope_scaling.{k}": v for k, v in vars(scaling).items()})
    check_plausible(flat, source, keys)
    if not flat["layer_types"]:
        flat["layer_types"] = (FULL,) * flat["num_layers"]
    for name, (holds, what, allowed) in REALS.items():
        value = flat.get(name)
        if value is None and name in OPTIONAL:
            continue
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and holds(value)):
            raise MinervaError(f"{source}: {keys.get(name, name)} = {value!r} is not a plausible {what} "
                               f"({allowed}); {_CORRUPT}")
    for name, holds, allowed in AGREEMENT:
        if not holds(flat):
            names = {**{k.replace(".", "_"): v for k, v in flat.items()},
                     **{k.replace(".", "_") + "_key": keys.get(k, k) for k in flat}}
            raise MinervaError(f"{source}: {keys.get(name, name)} = {flat[name]!r} should be "
                               f"{allowed.format_map(names)}; {_CORRUPT}")


def _defaults() -> dict[str, Any]:
    out = {}
    for f in fields(ModelConfig):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


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
        check_config(vars(self), "invalid model config", {})
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)

    @property
    def expert_ffn_size(self) -> int:
        return self.expert_intermediate_size or self.intermediate_size

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5
