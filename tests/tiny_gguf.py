"""Write small, complete llama GGUF files for tests that need a model but not a real one."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tokenizers import pre_tokenizers

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 16, 32, 1, 2, 1


def write_tiny_llama(path: Path, *, arch: str = "llama", context: int = 64,
                     odd_tensor_type: gguf.GGMLQuantizationType | None = None,
                     claimed_heads: int = HEADS) -> Path:
    """A 1-layer llama with a byte-level GPT-2 tokenizer (256 bytes + one merge) and random F32 weights.

    `odd_tensor_type` stores ffn_up with that type (raw random bytes) to exercise type checks;
    `claimed_heads` writes a head count into the metadata that the tensors may not match.
    """
    rng = np.random.default_rng(0)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(claimed_heads)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_token_merges(["Ġ t"])  # llama.cpp and Minerva refuse a gpt2 vocabulary without merges
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
