"""Load a model from a GGUF file or a Hugging Face SafeTensors directory.

Everything format-specific lives here: the config builders, one table per
format that maps file tensor names to canonical names, and the few tensor
transforms a format needs (llama.cpp's Q/K row permutation, Gemma's +1 norms).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gguf
import torch

from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile, GGUFTensor
from minerva.formats.quant import QUANT_TYPES
from minerva.formats.safetensors import SafeTensorsDir
from minerva.formats.tokenizer import Tokenizer
from minerva.kernels import act_quant
from minerva.kernels.quantize import check_scheme, qtype_for, quantizable, quantize
from minerva.kernels.weights import PackedWeight, Weight, float_weight
from minerva.models import gemma3, llama
from minerva.models.config import FULL, SLIDING, ModelConfig, RopeScaling, check_plausible
from minerva.models.layers import CausalLM, Linear, freeze

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
    expected = SHAPES[shape_key(name)](config)
    if tuple(shape) != expected:
        raise MinervaError(f"{source}: tensor '{file_name}' has shape {tuple(shape)} but the model's "
                           f"config implies {expected}; the file is inconsistent or corrupt")


def canonical(name: str, global_table: dict, layer_table: dict, layer_prefix: str) -> str | None:
    """File tensor name -> canonical name, or None for tensors the model does not use."""
    base = name.removesuffix(".weight")
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

def _gguf_rope_scaling(f: GGUFFile) -> RopeScaling:
    kind = f.get("rope.scaling.type") or "none"
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", float(f.get("rope.scaling.factor", 1.0)))
    raise MinervaError(f"'{f.path}': rope scaling type '{kind}' is not supported (supported: linear, "
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


def _hf_rope(cfg: dict, layer_type: str = "full_attention") -> tuple[float, RopeScaling]:
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
    if kind != "default":
        raise MinervaError(f"rope scaling type '{kind}' in config.json is not supported "
                           "(supported: linear, llama3)")
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
    if not types or "sliding_attention" not in types:
        return {}
    return dict(layer_types=tuple(SLIDING if t == "sliding_attention" else FULL for t in types),
                sliding_window=int(cfg["sliding_window"]))


def _hf_qwen3(cfg: dict) -> dict[str, Any]:
    extra = _hf_layer_types(cfg)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # the latter as transformers 5 saves it
    if experts:  # Qwen3-MoE; layers in `mlp_only_layers` keep a dense MLP (the file has no router there)
        extra.update(num_experts=_whole(experts),
                     num_experts_per_tok=_whole(cfg["num_experts_per_tok"]),
                     expert_intermediate_size=_whole(cfg["moe_intermediate_size"]),
                     moe_renormalize=bool(cfg.get("norm_topk_prob", False)))
    return extra


def _hf_mixtral(cfg: dict) -> dict[str, Any]:
    window, n = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    return dict(num_experts=_whole(cfg["num_local_experts"]), num_experts_per_tok=_whole(cfg["num_experts_per_tok"]),
                **(dict(layer_types=(SLIDING,) * n, sliding_window=int(window)) if window else {}))


def _hf_gemma3(cfg: dict) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
        for i in range(n)]
    return dict(
        layer_types=tuple(SLIDING if t == "sliding_attention" else FULL for t in types),
        sliding_window=int(cfg["sliding_window"]),
        rope_local_theta=float(cfg.get("rope_local_base_freq")
                               or _hf_rope(cfg, "sliding_attention")[0]),
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=cfg.get("final_logit_softcapping"),
    )


@dataclass(frozen=True)
class Architecture:
    build: Callable[[ModelConfig, Any], CausalLM]
    gguf_config: Callable[[GGUFFile], dict[str, Any]]
    hf_config: Callable[[dict], dict[str, Any]]
    hf_layer_names: dict[str, str]
    permute_qk: bool = False  # GGUF llama stores Q/K rows in llama.cpp's interleaved rope order
    norm_offset: float = 0.0  # HF Gemma norms compute (1 + w); GGUF stores w + 1 already


ARCHITECTURES = {
    "llama": Architecture(llama.build, _gguf_llama, _hf_llama, HF_LAYER["llama"], permute_qk=True),
    "mistral": Architecture(llama.build, _gguf_llama, _hf_llama, HF_LAYER["llama"], permute_qk=True),
    # llama.cpp writes Mixtral as `llama` with expert tensors; `mixtral` is its HF model type
    "mixtral": Architecture(llama.build, _gguf_llama, _hf_mixtral, HF_LAYER["mixtral"], permute_qk=True),
    "qwen3": Architecture(llama.build, _gguf_llama, _hf_qwen3, HF_LAYER["qwen3"]),
    "qwen3moe": Architecture(llama.build, _gguf_llama, _hf_qwen3, HF_LAYER["qwen3"]),
    "gemma3": Architecture(gemma3.build, _gguf_gemma3, _hf_gemma3, HF_LAYER["gemma3"],
                           norm_offset=1.0),
}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "gemma3_text": "gemma3", "mixtral": "mixtral",
                  "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}


def _architecture(name: str, source: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise MinervaError(f"{source}: architecture '{name}' is not supported "
                           f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[name]


def unpermute_qk(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rope pairs -> half-split)."""
    r = rows.shape[0]
    return rows.reshape(n_head, r // n_head // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


# -------------------------------------------------------------- weight sources

class GGUFWeights:
    """Tensors of a GGUF file under canonical names; quantized ones stay packed."""

    def __init__(self, f: GGUFFile, arch: Architecture, config: ModelConfig,
                 device: torch.device, dtype: torch.dtype):
        self.f, self.arch, self.config, self.device, self.dtype = f, arch, config, device, dtype
        self.by_name: dict[str, GGUFTensor] = {}
        for t in f.tensors.values():
            name = canonical(t.name, GGUF_GLOBAL, GGUF_LAYER, "blk.")
            if name is not None:
                self.by_name[name] = t

    def has(self, name: str) -> bool:
        return name in self.by_name

    def _get(self, name: str) -> tuple[GGUFTensor, torch.Tensor]:
        if name not in self.by_name:
            raise MinervaError(f"'{self.f.path}' lacks the tensor for '{name}' "
                               f"that a {self.f.architecture} model needs; the file is incomplete")
        t = self.by_name[name]
        if t.qtype not in _FLOAT_TYPES and t.qtype not in QUANT_TYPES:
            raise MinervaError(f"'{self.f.path}': tensor '{t.name}' has type {t.qtype.name}, "
                               "which Minerva cannot read")
        check_shape(name, t.name, t.shape, self.config, f"'{self.f.path}'")
        raw = t.read()
        if self.arch.permute_qk and name.endswith(("q_proj", "k_proj")):
            heads = self.config.num_heads if name.endswith("q_proj") else self.config.num_kv_heads
            raw = unpermute_qk(raw, heads)
        return t, raw

    def weight(self, name: str) -> Weight:
        t, raw = self._get(name)
        return self._weight(raw, t.qtype, t.shape)

    def _weight(self, raw: torch.Tensor, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> Weight:
        if qtype in _FLOAT_TYPES:
            return float_weight(raw.contiguous().view(_FLOAT_TYPES[qtype]).reshape(shape).to(self.device),
                                self.dtype)
        return PackedWeight(raw.to(self.device), qtype, shape, self.dtype)

    def experts(self, name: str) -> list[Weight]:
        """Slices of the layer's 3-D expert tensor: expert e's rows are a contiguous run of
        the packed bytes, so each expert stays packed and nothing is copied."""
        t, raw = self._get(name)
        count, *shape = t.shape
        per_expert = raw.reshape(count, shape[0], -1)
        return [self._weight(per_expert[e], t.qtype, tuple(shape)) for e in range(count)]

    def tensor(self, name: str) -> torch.Tensor:
        t, raw = self._get(name)
        if t.qtype not in _FLOAT_TYPES:
            raise MinervaError(f"'{self.f.path}': tensor '{t.name}' should be a float tensor, "
                               f"found {t.qtype.name}")
        return _float_view(raw, t).float().to(self.device)


_FLOAT_TYPES = {gguf.GGMLQuantizationType.F32: torch.float32,
                gguf.GGMLQuantizationType.F16: torch.float16,
                gguf.GGMLQuantizationType.BF16: torch.bfloat16}


def _float_view(raw: torch.Tensor, t: GGUFTensor) -> torch.Tensor:
    return raw.contiguous().view(_FLOAT_TYPES[t.qtype]).reshape(t.shape)


class SafeTensorsWeights:
    """Tensors of a Hugging Face checkpoint; with `quantize` ("int8" or "int4"), every
    matmul weight whose rows split into groups of 32 is quantized at load into packed
    blocks (minerva.kernels.quantize) and never held in float."""

    def __init__(self, d: SafeTensorsDir, arch: Architecture, config: ModelConfig,
                 device: torch.device, dtype: torch.dtype, quantize: str | None = None):
        self.d, self.arch, self.config, self.device, self.dtype = d, arch, config, device, dtype
        self.quantize = quantize
        self.by_name: dict[str, str] = {}
        for file_name in d.tensor_names():
            name = canonical(file_name, HF_GLOBAL, arch.hf_layer_names, "model.layers.")
            if name is not None:
                self.by_name[name] = file_name

    def has(self, name: str) -> bool:
        return name in self.by_name

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.by_name:
            raise MinervaError(f"'{self.d.path}' lacks the tensor for '{name}'; the checkpoint is incomplete")
        t = self.d.tensor(self.by_name[name])
        check_shape(name, self.by_name[name], t.shape, self.config, f"'{self.d.path}'")
        return t

    def weight(self, name: str) -> Weight:
        t = self._get(name)
        if self.quantize and quantizable(tuple(t.shape)):
            qtype = qtype_for(self.quantize, name)
            packed = quantize(t, qtype, self.by_name[name])
            return PackedWeight(packed.to(self.device), qtype, tuple(t.shape), self.dtype)
        return float_weight(t.to(self.device), self.dtype)

    def experts(self, name: str) -> list[Weight]:
        layer, _, part = name.partition(".experts.")
        return [self.weight(f"{layer}.experts.{e}.{part}") for e in range(self.config.num_experts)]

    def tensor(self, name: str) -> torch.Tensor:
        t = self._get(name).float()
        if name.rsplit(".", 1)[-1] in NORMS:
            t = t + self.arch.norm_offset
        return t.to(self.device)


# ------------------------------------------------------------------- loading

@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    load_seconds: float
    weight_bytes: int  # as stored (packed for quantized GGUF tensors)
    compute_bytes: int  # what the matmuls read: packed bytes, or dequantized copies


# The file's own name for each size field, for errors that name what to look at.
GGUF_SIZE_KEYS = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
                  "num_layers": "block_count", "num_heads": "attention.head_count",
                  "num_kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
                  "max_position": "context_length", "sliding_window": "attention.sliding_window",
                  "num_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
                  "expert_intermediate_size": "expert_feed_forward_length"}
HF_SIZE_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads", "max_position": "max_position_embeddings",
                "num_experts": "num_experts or num_local_experts", "expert_intermediate_size": "moe_intermediate_size"}


def _whole(value: Any) -> Any:
    """int(value), or the value itself when it is no number, for `check_plausible` to name."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return value


def _config_from_gguf(f: GGUFFile, arch: Architecture) -> ModelConfig:
    embed = f.tensors.get("token_embd.weight")
    if embed is None:
        raise MinervaError(f"'{f.path}' has no token_embd.weight tensor")
    keys = {k: f"{f.architecture}.{v}" for k, v in GGUF_SIZE_KEYS.items()}
    keys["vocab_size"] = "the row count of token_embd.weight"
    if f.get("attention.key_length") is None:
        keys["head_dim"] = f"{f.architecture}.rope.dimension_count"
    try:
        heads = _whole(f.require("attention.head_count"))
        hidden = _whole(f.require("embedding_length"))
        sizes = dict(
            vocab_size=embed.shape[0],
            hidden_size=hidden,
            intermediate_size=_whole(f.require("feed_forward_length")),
            num_layers=_whole(f.require("block_count")),
            num_heads=heads,
            num_kv_heads=_whole(f.get("attention.head_count_kv") or heads),
            max_position=_whole(f.get("context_length") or 4096),
            # llama.cpp renormalises the chosen experts' weights for every architecture here
            # (Mixtral, Qwen3-MoE): its converter drops Qwen3-MoE's norm_topk_prob
            num_experts=_whole(f.get("expert_count") or 0),
            num_experts_per_tok=_whole(f.get("expert_used_count") or 0),
            expert_intermediate_size=_whole(f.get("expert_feed_forward_length")),
        )
        check_plausible(sizes, f"'{f.path}'", keys)  # before the layer count sizes anything
        sizes["head_dim"] = _whole(f.get("attention.key_length") or f.get("rope.dimension_count")
                                  or hidden // heads)
        extra = arch.gguf_config(f)
        check_plausible({**sizes, **extra}, f"'{f.path}'", keys)
        return ModelConfig(
            architecture=f.architecture,
            **sizes,
            rms_norm_eps=float(f.require("attention.layer_norm_rms_epsilon")),
            rope_theta=float(f.get("rope.freq_base") or 10000.0),
            rope_scaling=_gguf_rope_scaling(f),
            tie_word_embeddings="output.weight" not in f.tensors,
            **extra,
        )
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as exc:
        raise MinervaError(f"'{f.path}' has invalid model metadata ({exc})") from None


def _config_from_hf(cfg: dict, path: Path) -> tuple[ModelConfig, Architecture]:
    model_type = cfg.get("model_type")
    arch_name = HF_MODEL_TYPES.get(model_type, model_type) if isinstance(model_type, str) else "?"
    source = f"'{path / 'config.json'}'"
    arch = _architecture(arch_name, source)
    try:
        heads = _whole(cfg["num_attention_heads"])
        hidden = _whole(cfg["hidden_size"])
        sizes = dict(
            vocab_size=_whole(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=_whole(cfg["intermediate_size"]),
            num_layers=_whole(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=_whole(cfg.get("num_key_value_heads") or heads),
            max_position=_whole(cfg.get("max_position_embeddings", 4096)),
        )
        check_plausible(sizes, source, HF_SIZE_KEYS)  # before the layer count sizes anything
        sizes["head_dim"] = _whole(cfg.get("head_dim") or hidden // heads)
        theta, scaling = _hf_rope(cfg)
        extra = arch.hf_config(cfg)
        check_plausible({**sizes, **extra}, source, HF_SIZE_KEYS)
        fields = dict(
            architecture=arch_name,
            **sizes,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            **extra,
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError, AttributeError) as exc:
        raise MinervaError(f"{source} lacks or has a bad field ({type(exc).__name__}: {exc})") from None
    return ModelConfig(**fields), arch


def _prepare(model: CausalLM) -> tuple[int, int]:
    """Make every linear weight ready for its kernel; return (stored, compute) bytes of weights."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, Linear)}
    for w in weights.values():
        if isinstance(w, PackedWeight):
            w.materialize()
    weights[id(model.embed)] = model.embed
    return (sum(w.nbytes for w in weights.values()),
            sum(w.compute_nbytes for w in weights.values()))


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, quantize: str | None = None,
               activations: str = "float") -> LoadedModel:
    """Load a model; `quantize` ("int8" | "int4") quantizes a SafeTensors checkpoint's
    matmul weights group-wise at load (GGUF files come quantized already); `activations`
    "int8" has every quantized weight multiply 8-bit activations (`minerva.kernels.act_quant`)."""
    start = time.perf_counter()
    path = Path(path)
    device = torch.device(device)
    check_scheme(quantize)
    act_quant.check_mode(activations)
    if path.is_dir():
        d = SafeTensorsDir(path)
        config, arch = _config_from_hf(d.config, path)
        weights: Any = SafeTensorsWeights(d, arch, config, device, dtype, quantize)
        tokenizer = Tokenizer.from_pretrained_dir(path)
    elif quantize:
        raise MinervaError(f"--quantize applies to SafeTensors checkpoints; '{path.name}' is a GGUF file, "
                           "already quantized: drop --quantize")
    else:
        f = GGUFFile(path)
        arch = _architecture(f.architecture, f"'{path}'")
        config = _config_from_gguf(f, arch)
        weights = GGUFWeights(f, arch, config, device, dtype)
        try:
            tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
        except MinervaError as exc:
            raise MinervaError(f"'{path}': {exc}") from None
    with torch.inference_mode():
        model = arch.build(config, weights)
        stored, compute = _prepare(model)
    model.to(device).eval()  # moves the buffers (rope frequencies); weights are already there
    if activations == "int8":
        embedding = getattr(model, "embed", None)  # a tied LM head keeps the layout its lookups read
        for m in model.modules():
            if isinstance(m, Linear) and isinstance(m.weight, PackedWeight):
                m.weight.use_int8_activations(regroup=m.weight is not embedding)
    for layer in model.layers:
        layer.make_fused()
    freeze(model)
    return LoadedModel(model, config, tokenizer, path, time.perf_counter() - start, stored,
                       compute)
