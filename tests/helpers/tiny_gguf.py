"""Write small, complete llama GGUF files for tests that need a model but not a real one."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
from tokenizers import pre_tokenizers

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 16, 32, 1, 2, 1
TINY_CONTEXT = 256  # the context of the shared `tiny` fixture (conftest.py)


def write_tiny_llama(path: Path, *, arch: str = "llama", context: int = 64,
                     odd_tensor_type: gguf.GGMLQuantizationType | None = None,
                     claimed_heads: int = HEADS, chat_template: str | None = None,
                     special_tokens: tuple[str, ...] = (), eos_token: str | None = None,
                     metadata: dict | None = None) -> Path:
    """A 1-layer llama with a byte-level GPT-2 tokenizer (256 bytes + one merge) and random F32 weights.

    `odd_tensor_type` stores ffn_up with that type (raw random bytes) to exercise type checks;
    `claimed_heads` writes a head count into the metadata that the tensors may not match;
    `chat_template` is stored as the file's `tokenizer.chat_template`; `special_tokens` are
    appended to the vocabulary as control tokens (as a converted model's `<|im_end|>` & co.);
    `eos_token`, one of them, is the EOS (else id 1, a byte: `"`); `metadata` adds keys (a
    float32, int32 or string value each).
    """
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    vocab = _add_tokenizer(w, special_tokens, eos_token)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        {float: w.add_float32, int: w.add_int32, str: w.add_string}[type(value)](key, value)
    w.add_block_count(LAYERS)
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(claimed_heads)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    head_dim = HIDDEN // HEADS
    shapes = {
        "token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,),
        "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_down.weight": (HIDDEN, FFN),
    }
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    if odd_tensor_type is None:
        w.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((FFN, HIDDEN)).astype(np.float32))
    else:
        block, size = gguf.GGML_QUANT_SIZES[odd_tensor_type]
        cols = max(HIDDEN, block)
        raw = rng.integers(0, 256, (FFN, cols // block * size), dtype=np.uint8)
        w.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=raw.shape, raw_dtype=odd_tensor_type)
    _finish(w)
    return path


def _add_tokenizer(w: gguf.GGUFWriter, special_tokens: tuple[str, ...] = (), eos_token: str | None = None) -> int:
    """A byte-level GPT-2 vocabulary: the 256 byte symbols plus one merge, then `special_tokens`
    as control tokens; returns its size."""
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens + list(special_tokens))
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(special_tokens))
    w.add_token_merges(["Ġ t"])  # llama.cpp and Minerva refuse a gpt2 vocabulary without merges
    w.add_bos_token_id(0)
    w.add_eos_token_id(len(tokens) + special_tokens.index(eos_token) if eos_token is not None else 1)
    return len(tokens) + len(special_tokens)


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama3_rope_factors(cfg) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for llama3 rope scaling."""
    rs = cfg.rope_parameters if getattr(cfg, "rope_parameters", None) else cfg.rope_scaling
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    base = rs.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old, lo, hi, factor = (rs["original_max_position_embeddings"], rs["low_freq_factor"],
                           rs["high_freq_factor"], rs["factor"])
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            factors.append(1.0)
        elif wavelen > old / lo:
            factors.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (rope pairs interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# transformers' layer tensor names -> llama.cpp's; `*` is an expert's index
_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
                "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
                "block_sparse_moe.gate": "ffn_gate_inp"}
_EXPERT_NAMES = {"mlp.experts.*.gate_proj": "ffn_gate_exps", "mlp.experts.*.up_proj": "ffn_up_exps",
                 "mlp.experts.*.down_proj": "ffn_down_exps", "block_sparse_moe.experts.*.w1": "ffn_gate_exps",
                 "block_sparse_moe.experts.*.w3": "ffn_up_exps", "block_sparse_moe.experts.*.w2": "ffn_down_exps"}
_GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}


_GPT_OSS_NAMES = {"self_attn.sinks": "attn_sinks", "post_attention_layernorm": "post_attention_norm",
                  "mlp.router": "ffn_gate_inp"}


def _gpt_oss_experts(sd: dict, layers: int) -> dict[str, np.ndarray]:
    """GPT-OSS's experts (one input-major tensor per layer, gate and up interleaved) as
    one matrix per expert under Qwen3-MoE's names, as llama.cpp's converter splits them;
    its `sinks` tensors under the `.weight` name the other tensors have."""
    out = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        gate_up, gate_up_bias = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.gate_up_proj_bias"]
        down, down_bias = sd[p + "mlp.experts.down_proj"], sd[p + "mlp.experts.down_proj_bias"]
        for e in range(gate_up.shape[0]):
            q = f"{p}mlp.experts.{e}."
            out[q + "gate_proj.weight"], out[q + "gate_proj.bias"] = gate_up[e][:, 0::2].T, gate_up_bias[e][0::2]
            out[q + "up_proj.weight"], out[q + "up_proj.bias"] = gate_up[e][:, 1::2].T, gate_up_bias[e][1::2]
            out[q + "down_proj.weight"], out[q + "down_proj.bias"] = down[e].T, down_bias[e]
        out[p + "self_attn.sinks.weight"] = sd[p + "self_attn.sinks"]
    return out


def write_gguf_from_hf(path: Path, hf_dir: Path, expert_type: gguf.GGMLQuantizationType | None = None
                       ) -> dict[str, np.ndarray]:
    """Convert a saved transformers checkpoint (Llama, Mixtral, Qwen3, Qwen3-MoE, GPT-OSS) to a GGUF
    the way llama.cpp's converter does: Q/K rows permuted for the llama architecture,
    llama3 scaling as a rope_freqs tensor, each layer's experts stacked into one 3-D tensor.

    With `expert_type`, expert matrices are stored quantized by the `gguf` package; returns
    their dequantized values under the checkpoint's names, for a reference model to load."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    sd = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        sd.update({k: v.astype(np.float32) for k, v in load_file(f).items()})
    arch = _GGUF_ARCH[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch != "llama":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gpt-oss":
        w.add_sliding_window(cfg.sliding_window)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
        w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
        sd.update(_gpt_oss_experts(sd, cfg.num_hidden_layers))
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    rs = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling or {}
    w.add_rope_freq_base(rs.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    assert _add_tokenizer(w) == cfg.vocab_size
    if rs.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd and not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    dequantized = {}
    layer_names = {**_LAYER_NAMES, **(_GPT_OSS_NAMES if arch == "gpt-oss" else {})}
    for i in range(cfg.num_hidden_layers):
        layer = f"model.layers.{i}."
        for hf, ours in layer_names.items():
            for kind in ("weight", "bias"):
                t = sd.get(f"{layer}{hf}.{kind}")
                if t is None:
                    continue
                if arch == "llama" and ours in ("attn_q", "attn_k"):
                    t = _permute(t, cfg.num_attention_heads if ours == "attn_q" else cfg.num_key_value_heads)
                w.add_tensor(f"blk.{i}.{ours}.{kind}", np.ascontiguousarray(t))
        for hf, ours in _EXPERT_NAMES.items():
            names = [f"{layer}{hf.replace('*', str(e))}.weight" for e in range(experts or 0)]
            if not names or names[0] not in sd:
                continue
            stacked = np.stack([sd[n] for n in names])
            biases = [f"{layer}{hf.replace('*', str(e))}.bias" for e in range(experts)]
            if biases[0] in sd:
                w.add_tensor(f"blk.{i}.{ours}.bias", np.stack([sd[n] for n in biases]))
            if expert_type is None:
                w.add_tensor(f"blk.{i}.{ours}.weight", stacked)
                continue
            packed = gguf.quants.quantize(stacked, expert_type)
            w.add_tensor(f"blk.{i}.{ours}.weight", packed, raw_shape=packed.shape, raw_dtype=expert_type)
            values = gguf.quants.dequantize(packed, expert_type)
            dequantized.update({n: values[e] for e, n in enumerate(names)})
    _finish(w)
    if arch == "gpt-oss" and dequantized:  # back to the checkpoint's own layout
        fused = {}
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts."
            gate, up, down = (np.stack([dequantized[f"{p}{e}.{n}.weight"] for e in range(experts)])
                              for n in ("gate_proj", "up_proj", "down_proj"))
            gate_up = np.empty((experts, gate.shape[2], 2 * gate.shape[1]), dtype=np.float32)
            gate_up[:, :, 0::2], gate_up[:, :, 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
            fused[p + "gate_up_proj"], fused[p + "down_proj"] = gate_up, down.transpose(0, 2, 1).copy()
        return fused
    return dequantized
