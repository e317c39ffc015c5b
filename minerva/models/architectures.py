"""What Minerva knows of each architecture and file format: the tables that map a file's
tensor names to canonical ones, the shape each canonical tensor must have, and the
config rules each architecture adds (from GGUF metadata or config.json)."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile
from minerva.models import gemma3, gpt_oss, llama
from minerva.models.config import FULL, SLIDING, TOPK_SOFTMAX, ModelConfig, RopeScaling
from minerva.models.causal_lm import CausalLM

# ---------------------------------------------------------------- name tables

GGUF_GLOBAL = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head",
               "rope_freqs": "rope_freqs"}
GGUF_LAYER = {
    "attn_norm": "input_norm", "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
    "attn_output": "o_proj", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
    "post_attention_norm": "post_attn_norm", "ffn_norm": "pre_mlp_norm",
    "post_ffw_norm": "post_mlp_norm", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
    "ffn_down": "down_proj", "ffn_gate_inp": "router", "ffn_gate_exps": "experts.gate_proj",
    "ffn_up_exps": "experts.up_proj", "ffn_down_exps": "experts.down_proj",
}
HF_GLOBAL = {"model.embed_tokens": "embed_tokens", "model.norm": "norm", "lm_head": "lm_head"}
_HF_COMMON = {
    "input_layernorm": "input_norm", "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj", "self_attn.o_proj": "o_proj", "mlp.gate_proj": "gate_proj",
    "mlp.up_proj": "up_proj", "mlp.down_proj": "down_proj",
}
HF_GPT_OSS = {**_HF_COMMON, "post_attention_layernorm": "pre_mlp_norm", "self_attn.sinks": "sinks",
              "mlp.router": "router",
              # experts in one tensor each, input-major, gate and up rows interleaved
              "mlp.experts.gate_up_proj": "experts.gate_up_t", "mlp.experts.gate_up_proj_bias": "experts.gate_up_bias",
              "mlp.experts.down_proj": "experts.down_t", "mlp.experts.down_proj_bias": "experts.down_proj.bias",
              # the published checkpoints' MXFP4 experts: output-major rows of 32-value blocks
              **{f"mlp.experts.{n}_proj_{part}": f"experts.{n}_{part}"
                 for n in ("gate_up", "down") for part in ("blocks", "scales")}}
# llama.cpp's GPT-OSS files name the pre-feed-forward norm `post_attention_norm`
GGUF_GPT_OSS = {**GGUF_LAYER, "post_attention_norm": "pre_mlp_norm", "attn_sinks": "sinks"}
_HF_QK_NORM = {"self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}
# Experts stored one tensor each: `*` stands for the expert index in both names.
_HF_QWEN_MOE = {"mlp.gate": "router", **{f"mlp.experts.*.{n}": f"experts.*.{n}"
                                         for n in ("gate_proj", "up_proj", "down_proj")}}
HF_LAYER = {
    "llama": {**_HF_COMMON, "post_attention_layernorm": "pre_mlp_norm"},
    "qwen3": {**_HF_COMMON, **_HF_QK_NORM, **_HF_QWEN_MOE, "post_attention_layernorm": "pre_mlp_norm"},
    "mixtral": {**_HF_COMMON, "post_attention_layernorm": "pre_mlp_norm", "block_sparse_moe.gate": "router",
                "block_sparse_moe.experts.*.w1": "experts.*.gate_proj",
                "block_sparse_moe.experts.*.w3": "experts.*.up_proj",
                "block_sparse_moe.experts.*.w2": "experts.*.down_proj"},
    "gemma3": {**_HF_COMMON, "post_attention_layernorm": "post_attn_norm",
               "pre_feedforward_layernorm": "pre_mlp_norm",
               "post_feedforward_layernorm": "post_mlp_norm", **_HF_QK_NORM},
}
NORMS = {"norm", "input_norm", "pre_mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm"}

# Shape each canonical tensor must have, from the config (torch order: out, in), by the
# name's last part (`shape_key`): "experts.*" are 3-D, all experts of a layer in one tensor;
# "expert.*" one expert's matrix.
SHAPES: dict[str, Callable[[ModelConfig], tuple[int, ...]]] = {
    "embed_tokens": lambda c: (c.vocab_size, c.hidden_size),
    "lm_head": lambda c: (c.vocab_size, c.hidden_size),
    "norm": lambda c: (c.hidden_size,),
    "rope_freqs": lambda c: (c.head_dim // 2,),
    "q_proj": lambda c: (c.num_heads * c.head_dim, c.hidden_size),
    "k_proj": lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    "v_proj": lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    "o_proj": lambda c: (c.hidden_size, c.num_heads * c.head_dim),
    "gate_proj": lambda c: (c.intermediate_size, c.hidden_size),
    "up_proj": lambda c: (c.intermediate_size, c.hidden_size),
    "down_proj": lambda c: (c.hidden_size, c.intermediate_size),
    **dict.fromkeys(["input_norm", "pre_mlp_norm", "post_attn_norm", "post_mlp_norm"],
                    lambda c: (c.hidden_size,)),
    **dict.fromkeys(["q_norm", "k_norm"], lambda c: (c.head_dim,)),
    "router": lambda c: (c.num_experts, c.hidden_size),
    "sinks": lambda c: (c.num_heads,),
    "experts.gate_up_t": lambda c: (c.num_experts, c.hidden_size, 2 * c.expert_ffn_size),
    "experts.gate_up_bias": lambda c: (c.num_experts, 2 * c.expert_ffn_size),
    "experts.down_t": lambda c: (c.num_experts, c.expert_ffn_size, c.hidden_size),
    "experts.gate_up_blocks": lambda c: (c.num_experts, 2 * c.expert_ffn_size, c.hidden_size // 32, 16),
    "experts.gate_up_scales": lambda c: (c.num_experts, 2 * c.expert_ffn_size, c.hidden_size // 32),
    "experts.down_blocks": lambda c: (c.num_experts, c.hidden_size, c.expert_ffn_size // 32, 16),
    "experts.down_scales": lambda c: (c.num_experts, c.hidden_size, c.expert_ffn_size // 32),
    "expert.gate_proj": lambda c: (c.expert_ffn_size, c.hidden_size),
    "expert.up_proj": lambda c: (c.expert_ffn_size, c.hidden_size),
    "expert.down_proj": lambda c: (c.hidden_size, c.expert_ffn_size),
}
SHAPES.update({f"experts.{n}": (lambda f: lambda c: (c.num_experts, *f(c)))(SHAPES[f"expert.{n}"])
               for n in ("gate_proj", "up_proj", "down_proj")})
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def shape_key(name: str) -> str:
    """`layers.3.experts.5.up_proj` -> `expert.up_proj`; `layers.3.experts.up_proj` ->
    `experts.up_proj`; `layers.3.q_proj` -> `q_proj`."""
    name = _EXPERT_INDEX.sub(".expert.", name)
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-2:-1] in (["expert"], ["experts"]) else parts[-1]


def check_shape(name: str, file_name: str, shape: tuple[int, ...], config: ModelConfig, source: str) -> None:
    if name.endswith(".bias"):  # a matrix's bias: one value per output row
        expected = SHAPES[shape_key(name.removesuffix(".bias"))](config)[:-1]
    else:
        expected = SHAPES[shape_key(name)](config)
    if tuple(shape) != expected:
        raise MinervaError(f"{source}: tensor '{file_name}' has shape {tuple(shape)} but the model's "
                           f"config implies {expected}; the file is inconsistent or corrupt")


def canonical(name: str, global_table: dict, layer_table: dict, layer_prefix: str) -> str | None:
    """File tensor name -> canonical name, or None for tensors the model does not use."""
    base = name.removesuffix(".weight")
    if base.endswith(".bias"):
        ours = canonical(base.removesuffix(".bias"), global_table, layer_table, layer_prefix)
        return None if ours is None else ours + ".bias"
    if base in global_table:
        return global_table[base]
    if base.startswith(layer_prefix):
        index, _, rest = base[len(layer_prefix):].partition(".")
        expert = _EXPERT_INDEX.search("." + rest + ".")
        if expert:  # one expert's tensor: the table names it with `*` for the index
            rest = _EXPERT_INDEX.sub(".experts.*.", "." + rest, count=1)[1:]
        if index.isdigit() and rest in layer_table:
            ours = layer_table[rest]
            return f"layers.{index}.{ours.replace('*', expert.group(1)) if expert else ours}"
    return None


# ------------------------------------------------------------- architectures

def gguf_rope_scaling(f: GGUFFile) -> RopeScaling:
    kind = f.get("rope.scaling.type") or "none"
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", float(f.get("rope.scaling.factor", 1.0)))
    if kind == "yarn":
        return RopeScaling("yarn", float(f.require("rope.scaling.factor")),
                           original_max_position=int(f.require("rope.scaling.original_context_length")),
                           beta_fast=float(f.get("rope.scaling.yarn_beta_fast") or 32.0),
                           beta_slow=float(f.get("rope.scaling.yarn_beta_slow") or 1.0))
    raise MinervaError(f"'{f.path}': rope scaling type '{kind}' is not supported (supported: linear, yarn, "
                       "and llama3 through the rope_freqs tensor)")


def _gguf_llama(f: GGUFFile) -> dict[str, Any]:
    return {}


def _gguf_gemma3(f: GGUFFile) -> dict[str, Any]:
    n = int(f.require("block_count"))
    hidden, heads = int(f.require("embedding_length")), int(f.require("attention.head_count"))
    head_dim = int(f.require("attention.key_length"))
    # llama.cpp's rule: the 27B model (62 layers) scales queries by hidden / heads, the rest by head_dim
    query_scalar = hidden / heads if n == 62 else head_dim
    return dict(
        layer_types=tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)),
        sliding_window=int(f.require("attention.sliding_window")),
        rope_local_theta=10000.0,  # llama.cpp's fixed base for Gemma 3 local layers
        attn_scale=float(f.get("attention.scale") or query_scalar**-0.5),
        final_logit_softcap=f.get("final_logit_softcapping"),
    )


def _gguf_gpt_oss(f: GGUFFile) -> dict[str, Any]:
    n = int(f.require("block_count"))
    scaling = gguf_rope_scaling(f)
    return dict(
        layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(n)),  # llama.cpp's pattern
        sliding_window=int(f.require("attention.sliding_window")),
        moe_routing=TOPK_SOFTMAX,
        swiglu_limit=(7.0, 1.702),  # fixed in llama.cpp's GPT-OSS graph
        # the published model's YaRN ramp is unrounded (its config.json: "truncate": false)
        rope_scaling=RopeScaling(**{**vars(scaling), "truncate": False}) if scaling.kind == "yarn" else scaling,
    )


def hf_rope(cfg: dict, layer_type: str = "full_attention") -> tuple[float, RopeScaling]:
    params = cfg.get("rope_parameters") or {}
    params = params.get(layer_type, params)  # per-layer-type parameters (Gemma 3)
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rs = cfg.get("rope_scaling") or params
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "linear":
        return theta, RopeScaling("linear", float(rs["factor"]))
    if kind == "llama3":
        return theta, RopeScaling("llama3", float(rs["factor"]), float(rs["low_freq_factor"]),
                                  float(rs["high_freq_factor"]),
                                  int(rs["original_max_position_embeddings"]))
    if kind == "yarn":
        return theta, RopeScaling("yarn", float(rs["factor"]),
                                  original_max_position=int(rs["original_max_position_embeddings"]),
                                  beta_fast=float(rs.get("beta_fast") or 32.0),
                                  beta_slow=float(rs.get("beta_slow") or 1.0), truncate=bool(rs.get("truncate", True)),
                                  attention_factor=rs.get("attention_factor"))
    if kind != "default":
        raise MinervaError(f"rope scaling type '{kind}' in config.json is not supported "
                           "(supported: linear, llama3, yarn)")
    return theta, RopeScaling()


def _hf_llama(cfg: dict) -> dict[str, Any]:
    window = cfg.get("sliding_window")
    n = cfg["num_hidden_layers"]
    extra: dict[str, Any] = {}
    if window and cfg.get("model_type") == "mistral":
        extra = dict(layer_types=(SLIDING,) * n, sliding_window=int(window))
    return extra


def _hf_layer_types(cfg: dict) -> dict[str, Any]:
    """Sliding-window layers as config.json's `layer_types` lists them (Qwen3 when
    `use_sliding_window` is set); none when it lists none."""
    types = cfg.get("layer_types")
    if not types or "sliding_attention" not in _attention_types(types):
        return {}
    return dict(layer_types=tuple(SLIDING if t == "sliding_attention" else FULL for t in types),
                sliding_window=int(cfg["sliding_window"]))


def _attention_types(types) -> list[str]:
    """config.json's layer_types, each full_attention or sliding_attention (another would run as
    the wrong attention)."""
    if not isinstance(types, list):
        raise MinervaError(f"layer_types must be a list of layer types, got {types!r}")
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise MinervaError(f"layer_types holds {t!r}; Minerva runs full_attention and sliding_attention layers")
    return types


def _hf_qwen3(cfg: dict) -> dict[str, Any]:
    extra = _hf_layer_types(cfg)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # the latter as transformers 5 saves it
    if experts:  # Qwen3-MoE; layers in `mlp_only_layers` keep a dense MLP (the file has no router there)
        extra.update(num_experts=whole(experts),
                     num_experts_per_tok=whole(cfg["num_experts_per_tok"]),
                     expert_intermediate_size=whole(cfg["moe_intermediate_size"]),
                     moe_renormalize=bool(cfg.get("norm_topk_prob", False)))
    return extra


def _hf_mixtral(cfg: dict) -> dict[str, Any]:
    window, n = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    return dict(num_experts=whole(cfg["num_local_experts"]), num_experts_per_tok=whole(cfg["num_experts_per_tok"]),
                **(dict(layer_types=(SLIDING,) * n, sliding_window=int(window)) if window else {}))


def _hf_gpt_oss(cfg: dict) -> dict[str, Any]:
    return dict(**_hf_layer_types(cfg), num_experts=whole(cfg["num_local_experts"]),
                num_experts_per_tok=whole(cfg["num_experts_per_tok"]), moe_routing=TOPK_SOFTMAX,
                swiglu_limit=(float(cfg.get("swiglu_limit", 7.0)), float(cfg.get("swiglu_alpha", 1.702))))


def _inverse_sqrt(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{key} = {value!r}, where a number > 0 belongs")
    return float(value) ** -0.5


def _hf_gemma3(cfg: dict) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
        for i in range(n)]
    return dict(
        layer_types=tuple(SLIDING if t == "sliding_attention" else FULL for t in _attention_types(types)),
        sliding_window=int(cfg["sliding_window"]),
        rope_local_theta=float(cfg.get("rope_local_base_freq")
                               or hf_rope(cfg, "sliding_attention")[0]),
        attn_scale=_inverse_sqrt(cfg.get("query_pre_attn_scalar", 256), "query_pre_attn_scalar"),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
    )


@dataclass(frozen=True)
class Architecture:
    build: Callable[[ModelConfig, Any], CausalLM]
    gguf_config: Callable[[GGUFFile], dict[str, Any]]
    hf_config: Callable[[dict], dict[str, Any]]
    hf_layer_names: dict[str, str]
    gguf_layer_names: dict[str, str] = field(default_factory=lambda: GGUF_LAYER)
    permute_qk: bool = False  # GGUF llama stores Q/K rows in llama.cpp's interleaved rope order
    norm_offset: float = 0.0  # HF Gemma norms compute (1 + w); GGUF stores w + 1 already
    activations: tuple[str, ...] = ("silu",)  # config.json's hidden_act values this computes


ARCHITECTURES = {
    "llama": Architecture(llama.build, _gguf_llama, _hf_llama, HF_LAYER["llama"], permute_qk=True),
    "mistral": Architecture(llama.build, _gguf_llama, _hf_llama, HF_LAYER["llama"], permute_qk=True),
    # llama.cpp writes Mixtral as `llama` with expert tensors; `mixtral` is its HF model type
    "mixtral": Architecture(llama.build, _gguf_llama, _hf_mixtral, HF_LAYER["mixtral"], permute_qk=True),
    "qwen3": Architecture(llama.build, _gguf_llama, _hf_qwen3, HF_LAYER["qwen3"]),
    "qwen3moe": Architecture(llama.build, _gguf_llama, _hf_qwen3, HF_LAYER["qwen3"]),
    "gpt-oss": Architecture(gpt_oss.build, _gguf_gpt_oss, _hf_gpt_oss, HF_GPT_OSS, gguf_layer_names=GGUF_GPT_OSS),
    "gemma3": Architecture(gemma3.build, _gguf_gemma3, _hf_gemma3, HF_LAYER["gemma3"],
                           norm_offset=1.0, activations=("gelu_pytorch_tanh",)),
}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "gemma3_text": "gemma3", "mixtral": "mixtral",
                  "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}


def find_architecture(name: str | None, source: str) -> Architecture:
    if name is None:
        raise MinervaError(f"{source} names no model_type (such as \"llama\"), so what model it is is unknown; "
                           "give a Hugging Face model's own config.json")
    if name not in ARCHITECTURES:
        raise MinervaError(f"{source}: architecture {name!r} is not supported "
                           f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[name]


def unpermute_qk(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rope pairs -> half-split)."""
    r = rows.shape[0]
    return rows.reshape(n_head, r // n_head // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def whole(value: Any) -> Any:
    """An integer count as an int (a float only where it is whole, as 30.0), else the value
    itself (2.5, "64", true), for `check_plausible` to name."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) \
            and value == int(value):
        return int(value)
    return value
