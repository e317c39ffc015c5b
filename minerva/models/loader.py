"""Load a model from a GGUF file or a Hugging Face SafeTensors directory: the weight
sources that hand a model file its tensors by canonical name (packed where the file is
quantized), the config from the file's metadata, and the load itself. What differs by
architecture and format (name tables, shapes, config rules) is in `architectures`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import torch

from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile, GGUFTensor
from minerva.formats.quant import QUANT_TYPES, mxfp4_from_blocks
from minerva.formats.safetensors import SafeTensorsDir
from minerva.formats.tokenizer import Tokenizer
from minerva.kernels import act_quant, repack
from minerva.kernels.quantize import check_scheme, qtype_for, quantizable, quantize
from minerva.kernels.weights import PackedWeight, Weight, float_weight, into_hugepages
from minerva.models.architectures import (
    GGUF_GLOBAL, HF_GLOBAL, HF_MODEL_TYPES, NORMS, Architecture, canonical, check_shape, find_architecture,
    gguf_rope_scaling, hf_rope, unpermute_qk, whole)
from minerva.models.checks import check_layers, check_shape_of, check_value_length, check_vocabulary, warn_unused
from minerva.models.config import ModelConfig, check_config, check_plausible, real
from minerva.models.fit import Footprint, check_fits, footprint
from minerva.models.causal_lm import CausalLM
from minerva.models.layers import Linear, freeze
from minerva.parallel.shard import Shard, plan

# -------------------------------------------------------------- weight sources

class GGUFWeights:
    """Tensors of a GGUF file under canonical names; quantized ones stay packed."""

    def __init__(self, f: GGUFFile, arch: Architecture, config: ModelConfig,
                 device: torch.device, dtype: torch.dtype):
        self.f, self.arch, self.config, self.device, self.dtype = f, arch, config, device, dtype
        self.shard: Shard | None = None  # under tensor parallelism, this rank's part of each weight
        self.by_name: dict[str, GGUFTensor] = {}
        self.used: set[str] = set()  # the names the model has read
        for t in f.tensors.values():
            name = canonical(t.name, GGUF_GLOBAL, arch.gguf_layer_names, "blk.")
            if name is not None:
                self.by_name[name] = t

    def has(self, name: str) -> bool:
        return name in self.by_name

    def _get(self, name: str) -> tuple[GGUFTensor, torch.Tensor]:
        t = self._find(name)
        raw = t.read()
        if self._permuted(name):
            raw = unpermute_qk(raw, self._heads(name))
        return t, raw

    def _permuted(self, name: str) -> bool:
        """A Q or K matrix whose rows llama.cpp permuted (its bias, as values: `tensor`)."""
        return self.arch.permute_qk and name.endswith(("q_proj", "k_proj"))

    def _heads(self, name: str) -> int:
        return self.config.num_heads if name.removesuffix(".bias").endswith("q_proj") else self.config.num_kv_heads

    def check(self) -> None:
        """The file's tensors against the config, before any is read: its layers are those
        block_count says, and each tensor the model uses has a type Minerva reads and the shape
        the config implies."""
        keys = gguf_keys(self.f)
        check_layers(self.f.tensors, "blk.", self.config, keys, f"'{self.f.path}'")
        for name in self.by_name:
            t = self._find(name)
            check_shape_of(name, t.name, t.shape, self.config, keys, f"'{self.f.path}'")

    def _find(self, name: str) -> GGUFTensor:
        """The file's tensor for `name`, of a type Minerva reads (its shape: `check`, at the start)."""
        if name not in self.by_name:
            raise MinervaError(f"'{self.f.path}' lacks the tensor for '{name}' "
                               f"that a {self.f.architecture} model needs; the file is incomplete")
        t = self.by_name[name]
        self.used.add(name)
        if t.qtype not in _FLOAT_TYPES and t.qtype not in QUANT_TYPES:
            raise MinervaError(f"'{self.f.path}': tensor '{t.name}' has type {t.qtype.name}, "
                               "which Minerva cannot read")
        return t

    def unused(self) -> list[str]:
        """The file's tensors the model did not read (once it is built), but those it never
        needs (llama.cpp's rope_freqs: Minerva computes them from the metadata)."""
        used = {self.by_name[n].name for n in self.used}
        return [n for n in self.f.tensors if n not in used and n not in _NOT_NEEDED]

    def weight(self, name: str) -> Weight:
        if self.shard is not None and not self._permuted(name):  # read only this rank's part
            t = self._find(name)
            cut = self.shard.cut(name, t.qtype, t.shape)
            if cut is not None:
                rows, byte_cols, shape = cut
                return self._weight(t.read(rows, byte_cols), t.qtype, shape)
        t, raw = self._get(name)
        return self._weight(*self._part(name, raw, t.qtype, t.shape))

    def _part(self, name: str, raw: torch.Tensor, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]):
        if self.shard is None:
            return raw, qtype, shape
        part, shape = self.shard.packed(name, raw, qtype, shape)
        # a copy: a view would keep the whole tensor's bytes alive
        return (raw if part is raw else part.clone(memory_format=torch.contiguous_format)), qtype, shape

    def _weight(self, raw: torch.Tensor, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> Weight:
        if qtype in _FLOAT_TYPES:
            return float_weight(_float_view(raw, qtype, shape).to(self.device), self.dtype)
        return PackedWeight(raw.to(self.device), qtype, shape, self.dtype)

    def experts(self, name: str) -> list[Weight]:
        """Slices of the layer's 3-D expert tensor: expert e's rows are a contiguous run of
        the packed bytes, so each expert stays packed and nothing is copied."""
        t, raw = self._get(name)
        count, *shape = t.shape
        per_expert = raw.reshape(count, shape[0], -1)
        return [self._weight(*self._part(name, per_expert[e], t.qtype, tuple(shape))) for e in range(count)]

    def expert_biases(self, name: str) -> list[torch.Tensor] | None:
        return list(self.tensor(name + ".bias").unbind(0)) if self.has(name + ".bias") else None

    def tensor(self, name: str) -> torch.Tensor:
        t, raw = self._get(name)
        if t.qtype not in _FLOAT_TYPES:
            raise MinervaError(f"'{self.f.path}': tensor '{t.name}' should be a float tensor, "
                               f"found {t.qtype.name}")
        out = _float_view(raw, t.qtype, t.shape).float()
        if self._permuted(name.removesuffix(".bias")) and name.endswith(".bias"):  # rows permuted as the matrix's
            out = unpermute_qk(out, self._heads(name))
        return (out if self.shard is None else self.shard.tensor(name, out).contiguous()).to(self.device)


_NOT_NEEDED = {"rope_freqs.weight"}
_FLOAT_TYPES = {gguf.GGMLQuantizationType.F32: torch.float32,
                gguf.GGMLQuantizationType.F16: torch.float16,
                gguf.GGMLQuantizationType.BF16: torch.bfloat16}


def _float_view(raw: torch.Tensor, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    return raw.contiguous().view(_FLOAT_TYPES[qtype]).reshape(shape)


class SafeTensorsWeights:
    """Tensors of a Hugging Face checkpoint; with `quantize` ("int8" or "int4"), every
    matmul weight whose rows split into groups of 32 is quantized at load into packed
    blocks (minerva.kernels.quantize) and never held in float."""

    def __init__(self, d: SafeTensorsDir, arch: Architecture, config: ModelConfig,
                 device: torch.device, dtype: torch.dtype, quantize: str | None = None):
        self.d, self.arch, self.config, self.device, self.dtype = d, arch, config, device, dtype
        self.quantize = quantize
        self.shard: Shard | None = None  # under tensor parallelism, this rank's part of each weight
        self.by_name: dict[str, str] = {}
        for file_name in d.tensor_names():
            name = canonical(file_name, HF_GLOBAL, arch.hf_layer_names, "model.layers.")
            if name is not None:
                self.by_name[name] = file_name

    def has(self, name: str) -> bool:
        return name in self.by_name

    def check(self) -> None:
        """The checkpoint's tensors against config.json, from the headers alone: its layers are
        those num_hidden_layers says, and each tensor the model uses has the shape the config implies."""
        source = f"'{self.d.path}'"
        check_layers(self.d.tensor_names(), "model.layers.", self.config, HF_KEYS, f"'{self.d.path / 'config.json'}'")
        for name, file_name in self.by_name.items():
            check_shape_of(name, file_name, tuple(self.d.dtype_and_shape(file_name)[1]), self.config, HF_KEYS, source)

    def _get(self, name: str, packed: bool = False) -> torch.Tensor:
        if name not in self.by_name:
            raise MinervaError(f"'{self.d.path}' lacks the tensor for '{name}'; the checkpoint is incomplete")
        t = self.d.tensor(self.by_name[name], packed)
        check_shape(name, self.by_name[name], t.shape, self.config, f"'{self.d.path}'")
        return t

    def weight(self, name: str) -> Weight:
        return self._weight(self._get(name), name)

    def _weight(self, t: torch.Tensor, name: str) -> Weight:
        if self.shard is not None:
            part = self.shard.dense(name, t)  # a copy: a view would keep the whole tensor alive
            t = t if part is t else part.clone(memory_format=torch.contiguous_format)
        if self.quantize and quantizable(tuple(t.shape)):
            qtype = qtype_for(self.quantize, name)
            packed = quantize(t, qtype, self.by_name.get(name, name))
            return PackedWeight(packed.to(self.device), qtype, tuple(t.shape), self.dtype)
        return float_weight(t.to(self.device), self.dtype)

    def experts(self, name: str) -> list[Weight]:
        """A tensor per expert (Mixtral, Qwen3-MoE), or GPT-OSS's one input-major tensor per
        layer with gate and up rows interleaved."""
        layer, _, part = name.partition(".experts.")
        count = self.config.num_experts
        stem = f"{layer}.experts.{'down' if part == 'down_proj' else 'gate_up'}"
        if self.has(stem + "_blocks"):
            return self._mxfp4_experts(stem, part, name)
        fused = stem + "_t"
        if self.has(fused):
            t = self._get(fused)
            if part != "down_proj":
                t = t[:, :, 0::2] if part == "gate_proj" else t[:, :, 1::2]
            return [self._weight(t[e].t().contiguous(), name) for e in range(count)]
        return [self.weight(f"{layer}.experts.{e}.{part}") for e in range(count)]

    def _mxfp4_experts(self, stem: str, part: str, name: str) -> list[Weight]:
        """GPT-OSS's MXFP4 experts (`*_blocks`, `*_scales`; gate and up rows interleaved),
        rewritten into GGML's MXFP4 layout: they stay packed, as from a GGUF file."""
        blocks, scales = self._get(stem + "_blocks", packed=True), self._get(stem + "_scales", packed=True)
        if part != "down_proj":
            rows = slice(0, None, 2) if part == "gate_proj" else slice(1, None, 2)
            blocks, scales = blocks[:, rows], scales[:, rows]
        if self.shard is not None:  # rows, or whole blocks of 32 columns
            axis, (lo, hi) = self.shard.rule(name)
            cut = (slice(None), slice(lo, hi)) if axis == "out" else (slice(None), slice(None), slice(lo // 32, hi // 32))
            blocks, scales = blocks[cut], scales[cut]
        shape = (blocks.shape[1], blocks.shape[2] * 32)
        return [PackedWeight(mxfp4_from_blocks(blocks[e], scales[e]).to(self.device), gguf.GGMLQuantizationType.MXFP4,
                             shape, self.dtype) for e in range(blocks.shape[0])]

    def expert_biases(self, name: str) -> list[torch.Tensor] | None:
        layer, _, part = name.partition(".experts.")
        if part != "down_proj" and self.has(f"{layer}.experts.gate_up_bias"):
            t = self._get(f"{layer}.experts.gate_up_bias")
            t = t[:, 0::2] if part == "gate_proj" else t[:, 1::2]
        elif self.has(name + ".bias"):
            t = self._get(name + ".bias")
        else:
            return None
        t = t.float() if self.shard is None else self.shard.tensor(name + ".bias", t.float())
        return list(t.to(self.device).contiguous().unbind(0))

    def tensor(self, name: str) -> torch.Tensor:
        t = self._get(name).float()
        if name.rsplit(".", 1)[-1] in NORMS:
            t = t + self.arch.norm_offset
        if self.shard is not None:
            t = self.shard.tensor(name, t).contiguous()
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
    shard: Shard | None = None  # under tensor parallelism, the part of the model this rank holds
    footprint: Footprint | None = None  # what its headers say it takes (minerva.models.fit)
    metadata: dict | None = None  # a GGUF file's header (None for a Hugging Face directory)


# The file's own name for each config field, for errors that name what to look at.
GGUF_KEYS = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
             "num_layers": "block_count", "num_heads": "attention.head_count",
             "num_kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
             "max_position": "context_length", "sliding_window": "attention.sliding_window",
             "num_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
             "expert_intermediate_size": "expert_feed_forward_length",
             "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
             "attn_scale": "attention.scale", "final_logit_softcap": "final_logit_softcapping",
             "rope_scaling.factor": "rope.scaling.factor",
             "rope_scaling.original_max_position": "rope.scaling.original_context_length",
             "rope_scaling.beta_fast": "rope.scaling.yarn_beta_fast",
             "rope_scaling.beta_slow": "rope.scaling.yarn_beta_slow"}
HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads", "max_position": "max_position_embeddings",
           "num_experts": "num_experts or num_local_experts", "expert_intermediate_size": "moe_intermediate_size",
           "rope_local_theta": "rope_local_base_freq", "attn_scale": "query_pre_attn_scalar ** -0.5",
           "final_logit_softcap": "final_logit_softcapping",
           "rope_scaling.original_max_position": "rope_scaling.original_max_position_embeddings"}


def gguf_keys(f: GGUFFile) -> dict[str, str]:
    """GGUF_KEYS under the file's architecture, with where its vocabulary and head size come from."""
    keys = {k: f"{f.architecture}.{v}" for k, v in GGUF_KEYS.items()}
    keys["vocab_size"] = "the row count of token_embd.weight"
    if f.get("attention.key_length") is None:
        keys["head_dim"] = (f"{f.architecture}.rope.dimension_count" if f.get("rope.dimension_count") is not None
                            else f"the head size ({keys['hidden_size']} / {keys['num_heads']})")
    return keys


def _given(value: Any, default: Any) -> Any:
    """`value`, or `default` where the file does not state it: a stated 0 stays 0 (and is refused)."""
    return default if value is None else value


def _config_from_gguf(f: GGUFFile, arch: Architecture) -> ModelConfig:
    embed = f.tensors.get("token_embd.weight")
    if embed is None:
        raise MinervaError(f"'{f.path}' has no token_embd.weight tensor")
    keys = gguf_keys(f)
    try:
        heads = whole(f.require("attention.head_count"))
        hidden = whole(f.require("embedding_length"))
        sizes = dict(
            vocab_size=embed.shape[0],
            hidden_size=hidden,
            intermediate_size=whole(f.require("feed_forward_length")),
            num_layers=whole(f.require("block_count")),
            num_heads=heads,
            num_kv_heads=whole(_given(f.get("attention.head_count_kv"), heads)),
            max_position=whole(_given(f.get("context_length"), 4096)),
            # llama.cpp renormalises the chosen experts' weights for every architecture here
            # (Mixtral, Qwen3-MoE): its converter drops Qwen3-MoE's norm_topk_prob
            num_experts=whole(_given(f.get("expert_count"), 0)),
            num_experts_per_tok=whole(_given(f.get("expert_used_count"), 0)),
            expert_intermediate_size=whole(f.get("expert_feed_forward_length")),
        )
        check_plausible(sizes, f"'{f.path}'", keys)  # before the layer count sizes anything
        sizes["head_dim"] = whole(_given(f.get("attention.key_length"),
                                         _given(f.get("rope.dimension_count"), hidden // heads)))
        extra = arch.gguf_config(f)
        config = _named_config(f"'{f.path}'", {
            "architecture": f.architecture,
            **sizes,
            "rms_norm_eps": real(f.require("attention.layer_norm_rms_epsilon")),
            "rope_theta": real(_given(f.get("rope.freq_base"), 10000.0)),
            "rope_scaling": gguf_rope_scaling(f),
            "tie_word_embeddings": "output.weight" not in f.tensors,
            **extra,  # an architecture's own rules win
        }, keys)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as exc:
        raise MinervaError(f"'{f.path}' has invalid model metadata ({exc})") from None
    check_vocabulary(f)
    check_value_length(f, config.head_dim)
    return config


def _config_from_hf(cfg: dict, path: Path) -> tuple[ModelConfig, Architecture]:
    model_type = cfg.get("model_type")
    arch_name = HF_MODEL_TYPES.get(model_type, model_type) if isinstance(model_type, str) else \
        None if model_type is None else repr(model_type)  # (None: no model_type at all)
    source = f"'{path / 'config.json'}'"
    arch = find_architecture(arch_name, source)
    quant = cfg.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in (None, "mxfp4"):
        raise MinervaError(f"{source}: the checkpoint is quantized with {method!r}, which Minerva cannot read; "
                           "use its float checkpoint (--quantize int8/int4 packs it at load) or a GGUF file")
    try:
        heads = whole(cfg["num_attention_heads"])
        hidden = whole(cfg["hidden_size"])
        sizes = dict(
            vocab_size=whole(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=whole(cfg["intermediate_size"]),
            num_layers=whole(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=whole(_given(cfg.get("num_key_value_heads"), heads)),
            max_position=whole(cfg.get("max_position_embeddings", 4096)),
        )
        check_plausible(sizes, source, HF_KEYS)  # before the layer count sizes anything
        sizes["head_dim"] = whole(_given(cfg.get("head_dim"), hidden // heads))
        theta, scaling = hf_rope(cfg)
        for key in ("hidden_act", "hidden_activation"):  # another function would run as this one
            if cfg.get(key) is not None and cfg[key] not in arch.activations:
                raise MinervaError(f"{source}: {key} is {cfg[key]!r}; Minerva computes a {arch_name} model's MLP "
                                   f"with {' or '.join(arch.activations)}")
        try:
            extra = arch.hf_config(cfg)
        except MinervaError as exc:
            raise MinervaError(f"{source}: {exc}") from None
        check_plausible({**sizes, **extra}, source, HF_KEYS)
        fields = dict(
            architecture=arch_name,
            **sizes,
            rms_norm_eps=real(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=flag(cfg, "tie_word_embeddings", source),
            **extra,
        )
        for name, key in _HF_STATED.items():
            if name in fields and cfg.get(key) is not None:
                fields[name] = real(cfg[key])
    except KeyError as exc:
        raise MinervaError(f"{source} lacks the field {exc.args[0]!r}, which a {model_type} model's config.json "
                           "holds; the file is incomplete (download it again) or not a model Minerva can run") from None
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, AttributeError) as exc:
        raise MinervaError(f"{source} has a bad field ({type(exc).__name__}: {exc}); the file is corrupt or not "
                           "a model Minerva can run") from None
    return _named_config(source, fields, HF_KEYS), arch


def flag(cfg: dict, key: str, source: str) -> bool:
    """A true/false field of config.json (false when absent): a string "false" is no flag."""
    value = cfg.get(key, False)
    if not isinstance(value, bool):
        raise MinervaError(f"{source}: {key} must be true or false, got {value!r}")
    return value


# config.json fields read as `value or default` (a rope base of 0 would become the default):
# where the file states one, its value is what `check_config` sees.
_HF_STATED = {"rope_theta": "rope_theta", "rope_local_theta": "rope_local_base_freq"}


def _named_config(source: str, fields: dict[str, Any], keys: dict[str, str]) -> ModelConfig:
    """ModelConfig(**fields) once `check_config` passes them, its errors naming the file and
    the file's own name for each field."""
    check_config(fields, source, keys)
    try:
        return ModelConfig(**fields)
    except MinervaError as exc:
        raise MinervaError(f"{source}: {exc}") from None


def _prepare(model: CausalLM) -> tuple[int, int]:
    """Make every linear weight ready for its kernel; return (stored, compute) bytes of weights."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, Linear)}
    for w in weights.values():
        if isinstance(w, PackedWeight):
            w.materialize()
    weights[id(model.embed)] = model.embed
    return (sum(w.nbytes for w in weights.values()),
            sum(w.compute_nbytes for w in weights.values()))


def read_config(path: str | Path) -> ModelConfig:
    """The config of the model at `path` (GGUF file or Hugging Face directory), without its weights."""
    path = Path(path)
    if path.is_dir():
        return _config_from_hf(SafeTensorsDir(path).config, path)[0]
    f = GGUFFile(path)
    return _config_from_gguf(f, find_architecture(f.architecture, f"'{path}'"))


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, quantize: str | None = None,
               activations: str = "float", parallel: tuple[int, int] | None = None) -> LoadedModel:
    """Load a model; `quantize` ("int8" | "int4") quantizes a SafeTensors checkpoint's
    matmul weights group-wise at load (GGUF files come quantized already); `activations`
    "int8" has every quantized weight multiply 8-bit activations (`minerva.kernels.act_quant`);
    `parallel` (rank, world) loads only that tensor-parallel rank's shard (`minerva.parallel.shard`):
    the model's layers hold its heads, `config` stays the whole model's."""
    start = time.perf_counter()
    path = Path(path)
    device = torch.device(device)
    check_scheme(quantize)
    act_quant.check_mode(activations)
    if path.is_dir():
        d = SafeTensorsDir(path)
        config, arch = _config_from_hf(d.config, path)
        weights: Any = SafeTensorsWeights(d, arch, config, device, dtype, quantize)
        weights.check()  # before anything is read or built
        sizes = footprint(d, dtype, quantize)
        check_fits(path, sizes.weights // (parallel[1] if parallel else 1), device, quantize)
        tokenizer = Tokenizer.from_pretrained_dir(path)
    elif quantize:
        raise MinervaError(f"--quantize applies to SafeTensors checkpoints; '{path.name}' is a GGUF file, "
                           "already quantized: drop --quantize")
    else:
        f = GGUFFile(path)
        arch = find_architecture(f.architecture, f"'{path}'")
        config = _config_from_gguf(f, arch)
        weights = GGUFWeights(f, arch, config, device, dtype)
        weights.check()  # before anything is read or built
        sizes = footprint(f, dtype)
        check_fits(path, sizes.weights // (parallel[1] if parallel else 1), device, None)
        try:
            tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
        except MinervaError as exc:
            raise MinervaError(f"'{path}': {exc}") from None
    shard = None
    if parallel is not None:
        shard = weights.shard = plan(config, *parallel)
    with torch.inference_mode():
        model = arch.build(config if shard is None else shard.local_config(config), weights)
        stored, compute = _prepare(model)
    if isinstance(weights, GGUFWeights):
        warn_unused(path, weights.unused(), config.architecture)
    model.to(device).eval()  # moves the buffers (rope frequencies); weights are already there
    if activations == "int8":
        embedding = getattr(model, "embed", None)  # a tied LM head keeps the layout its lookups read (but LOOKUP_TYPES)
        for m in model.modules():
            if isinstance(m, Linear) and isinstance(m.weight, PackedWeight):
                m.weight.use_int8_activations(
                    regroup=m.weight is not embedding or m.weight.qtype in repack.LOOKUP_TYPES)
    into_hugepages(m.weight for m in model.modules() if isinstance(m, Linear))
    for layer in model.layers:
        layer.make_fused()
    model.stack_layers()
    freeze(model)
    return LoadedModel(model, config, tokenizer, path, time.perf_counter() - start, stored, compute, shard, sizes,
                       weights.f.metadata if isinstance(weights, GGUFWeights) else None)
