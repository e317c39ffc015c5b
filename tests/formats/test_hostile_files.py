"""Corrupt and hostile model files: every one must fail with one clean `MinervaError` that names
what is wrong, quickly and without allocating what a corrupt length claims. That includes files
that parse and would load but compute garbage: metadata out of range or at odds with the tensors
(`GARBAGE_CASES`), refused before anything is built, by one line naming the key.

The files are mutations of a tiny valid GGUF (tests/helpers/tiny_gguf.py) and hand-written
config.json files; all of them are loaded by `load_model` in one subprocess whose address space
is capped (tests/helpers/hostile.py), so a loader that trusts a length of 2**64-1 fails the test
with a MemoryError or a timeout instead of taking the machine down.
"""

from __future__ import annotations

import json
import os
import random
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile
from tests.helpers.cli import assert_clean_error, run
from tests.helpers.hostile import INTERESTING, M32, M64, put, retyped, run_worker, sites
from tests.helpers.tiny_gguf import write_tiny_llama

SECONDS_PER_FILE = 2.0
RSS_GROWTH_MB = 300  # per file; the loader may keep a tiny model, never what a length claims

V = gguf.GGUFValueType
TOKENS, MERGES = "kv:tokenizer.ggml.tokens:alen", "kv:tokenizer.ggml.merges:alen"

# (case, site or None for the whole file, value, fragments the error must contain)
GGUF_CASES = [
    *[(f"{what}-len-{value}", site, value, [f"tokenizer.ggml.{what}", "entries", "re-download"])
      for what, site in (("tokens", TOKENS), ("merges", MERGES)) for value in (10**8, 1 << 63, M64)],
    ("block-count-1e9", "kv:llama.block_count:value", 10**9,
     ["llama.block_count = 1000000000 is not a plausible layer count"]),
    ("hidden-2^31", "kv:llama.embedding_length:value", 1 << 31,
     ["llama.embedding_length = 2147483648 is not a plausible hidden size"]),
    ("ffn-2^32-1", "kv:llama.feed_forward_length:value", M32, ["llama.feed_forward_length", "plausible"]),
    ("heads-0", "kv:llama.attention.head_count:value", 0,
     ["llama.attention.head_count = 0 is not a plausible head count"]),
    ("context-2^32-1", "kv:llama.context_length:value", M32, ["llama.context_length", "plausible context"]),
    ("tensor-count-2^64-1", "tensor_count", M64, ["18446744073709551615 tensors claimed"]),
    ("kv-count-2^63", "kv_count", 1 << 63, ["9223372036854775808 metadata entries claimed"]),
    ("arch-string-len-2^64-1", "kv:general.architecture:slen", M64, ["general.architecture", "past the end"]),
    ("key-len-2^64-1", "kv:general.architecture:klen", M64, ["metadata entry 0", "past the end"]),
    ("first-token-len-2^64-1", "kv:tokenizer.ggml.tokens:slen0", M64,
     ["tokenizer.ggml.tokens", "string 0", "past the end"]),
    ("kv-type-99", "kv:llama.block_count:type", 99, ["llama.block_count", "unknown value type 99"]),
    ("array-type-99", "kv:tokenizer.ggml.tokens:itype", 99, ["tokenizer.ggml.tokens", "unknown value type"]),
    ("dim-2^40", "t:token_embd.weight:dim0", 1 << 40, ["token_embd.weight", "claims bytes"]),
    ("dim-0", "t:token_embd.weight:dim0", 0, ["token_embd.weight", "has dims [0, 257]"]),
    ("dim-2^64-1", "t:token_embd.weight:dim0", M64, ["token_embd.weight", "claims bytes"]),
    ("tensor-type-99", "t:token_embd.weight:type", 99, ["token_embd.weight", "unknown type 99"]),
    ("offset-past-end", "t:blk.0.ffn_up.weight:offset", "size", ["blk.0.ffn_up.weight", "claims bytes"]),
    ("offset-2^64-1", "t:blk.0.ffn_up.weight:offset", M64, ["blk.0.ffn_up.weight", "claims bytes"]),
    ("offset-misaligned", "t:blk.0.ffn_up.weight:offset", "+1", ["blk.0.ffn_up.weight", "alignment 32"]),
    ("offsets-overlap", "t:blk.0.ffn_up.weight:offset", 0, ["overlap", "blk.0.ffn_up.weight"]),
    ("truncated-header", None, "cut:40", ["re-download"]),
    ("truncated-data", None, "cut:-4", ["re-download"]),
    ("trailing-bytes", None, "append:5", ["takes", "or bytes were added after the tensor data"]),
    ("version-4", "version", 4, ["a GGUF file of version 4", "reads versions 2 and 3"]),
    ("version-2^31", "version", 1 << 31, ["a GGUF file of version 2147483648"]),
]


def _mutated(base: bytes, where: dict, site: str | None, value) -> bytes:
    if site is None:
        how, n = value.split(":")
        return base[:int(n)] if how == "cut" else base + bytes(int(n))
    s = where[site]
    if value == "size":
        value = len(base)
    elif value == "+1":
        value = s.value(base) + 1
    return put(base, s, value)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("base") / "tiny.gguf")
    return path, path.read_bytes(), sites(path)


def f32(x: float) -> int:
    """The bits of `x` as a FLOAT32, to write over a 4-byte metadata value."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


F16, BF16 = int(gguf.GGMLQuantizationType.F16), int(gguf.GGMLQuantizationType.BF16)
EPS, ROPE = "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"

# (case, site, value, fragments): a value of the tiny file (1 layer, vocabulary 257, hidden 16,
# feed-forward 32, 2 heads, 1 KV head) mutated into one that parses and would load but compute
# garbage; the error must name the key (the first fragment). "two:" sites are in the two-layer file.
GARBAGE_CASES = [
    ("block-count-2", "kv:llama.block_count:value", 2, ["llama.block_count = 2", "no tensors of layer 1"]),
    ("block-count-1-of-2", "two:kv:llama.block_count:value", 1, ["llama.block_count = 1", "tensors of layer 1"]),
    ("block-count-3-of-2", "two:kv:llama.block_count:value", 3, ["llama.block_count = 3", "no tensors of layer 2"]),
    *[(f"{what}-id-{value}", f"kv:tokenizer.ggml.{what}_token_id:value", value,
       [f"tokenizer.ggml.{what}_token_id = {value}", "0 to 256"])
      for what in ("bos", "eos") for value in (257, 10**6, M32)],
    ("context-0", "kv:llama.context_length:value", 0, ["llama.context_length = 0", "plausible context"]),
    *[(f"eps-{x}", f"kv:{EPS}:value", f32(x), [EPS, "> 0 and < 1"])
      for x in (float("inf"), float("nan"), 0.0, -1e-5, 2.0)],
    *[(f"rope-base-{x}", f"kv:{ROPE}:value", f32(x), [ROPE, "rope base"])
      for x in (0.0, float("inf"), float("nan"), -1e4)],
    ("kv-heads-0", "kv:llama.attention.head_count_kv:value", 0, ["llama.attention.head_count_kv = 0"]),
    ("kv-heads-3", "kv:llama.attention.head_count_kv:value", 3,
     ["llama.attention.head_count_kv = 3", "a divisor of llama.attention.head_count = 2"]),
    ("heads-4", "kv:llama.attention.head_count:value", 4, ["llama.attention.head_count = 4", "blk.0.attn_k.weight"]),
    ("hidden-0", "kv:llama.embedding_length:value", 0, ["llama.embedding_length = 0"]),
    ("hidden-32", "kv:llama.embedding_length:value", 32, ["llama.embedding_length = 32", "token_embd.weight"]),
    ("ffn-0", "kv:llama.feed_forward_length:value", 0, ["llama.feed_forward_length = 0"]),
    ("ffn-64", "kv:llama.feed_forward_length:value", 64, ["llama.feed_forward_length = 64", "blk.0.ffn_gate.weight"]),
    *[(f"{name}-f32-as-{label}", f"t:{name}:type", qtype, [f"tensor '{name}' of type {label}", "holds"])
      for name in ("output_norm.weight", "blk.0.attn_norm.weight", "token_embd.weight", "blk.0.ffn_up.weight")
      for qtype, label in ((F16, "F16"), (BF16, "BF16"))],
]

# (case, metadata entries (key, value, type) added to the tiny file or replacing its own, fragments)
GARBAGE_KEYS = [
    *[(f"vocab-size-{v}", [("llama.vocab_size", v, V.UINT32)], [f"llama.vocab_size = {v}", "allowed: 257"])
      for v in (0, 256, 258, M32)],
    *[(f"{what}-id-{v}", [(f"tokenizer.ggml.{what}_token_id", v, vtype)], [f"tokenizer.ggml.{what}_token_id = {v}"])
      for what in ("padding", "unknown", "eot", "eom", "sep") for v, vtype in ((257, V.UINT32), (10**6, V.UINT32),
                                                                          (M32, V.UINT32), (-2, V.INT32))],
    ("key-length-0", [("llama.attention.key_length", 0, V.UINT32)], ["llama.attention.key_length = 0"]),
    ("value-length-4", [("llama.attention.value_length", 4, V.UINT32)],
     ["llama.attention.value_length = 4", "head size 8", "not supported"]),
    ("rope-dims-7", [("llama.rope.dimension_count", 7, V.UINT32)], ["llama.rope.dimension_count = 7", "even"]),
    *[(f"rope-linear-factor-{x}", [("llama.rope.scaling.type", "linear", V.STRING),
                                   ("llama.rope.scaling.factor", x, V.FLOAT32)], ["llama.rope.scaling.factor"])
      for x in (0.0, float("inf"), -2.0)],
    ("yarn-original-context-0", [("llama.rope.scaling.type", "yarn", V.STRING),
                                 ("llama.rope.scaling.factor", 4.0, V.FLOAT32),
                                 ("llama.rope.scaling.original_context_length", 0, V.UINT32)],
     ["llama.rope.scaling.original_context_length = 0"]),
]

# (case, metadata entries as in GARBAGE_KEYS): legitimate variations that must still load
LEGIT_KEYS = [
    ("vocab-size-257", [("llama.vocab_size", 257, V.UINT32)]),
    ("padding-none", [("tokenizer.ggml.padding_token_id", -1, V.INT32)]),
    ("special-ids-in-vocab", [("tokenizer.ggml.padding_token_id", 256, V.UINT32),
                              ("tokenizer.ggml.unknown_token_id", 0, V.UINT32),
                              ("tokenizer.ggml.eot_token_id", 1, V.UINT32)]),
    ("rope-dims-8", [("llama.rope.dimension_count", 8, V.UINT32)]),
    ("value-length-8", [("llama.attention.value_length", 8, V.UINT32)]),
    ("rope-linear-2", [("llama.rope.scaling.type", "linear", V.STRING), ("llama.rope.scaling.factor", 2.0, V.FLOAT32)]),
    ("block-count-float-1", [("llama.block_count", 1.0, V.FLOAT32)]),  # a whole number, if a float
]


def _with_keys(src: Path, dst: Path, entries) -> Path:
    """A copy of the GGUF file `src` with each (key, value, type) of `entries` set."""
    for key, value, vtype in entries:
        retyped(src, dst.with_suffix(".tmp"), key, value, vtype)
        src = dst.with_suffix(".tmp").replace(dst)
    return dst


def _two_layers(src: Path, dst: Path) -> Path:
    """The tiny file with a second layer, a copy of its first, and block_count 2."""
    reader = gguf.GGUFReader(src, "r")
    w = gguf.GGUFWriter(str(dst), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "llama.block_count"):
            continue
        sub = field.types[-1] if field.types[0] == V.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    w.add_block_count(2)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
    for t in reader.tensors:
        if t.name.startswith("blk.0."):
            w.add_tensor("blk.1." + t.name.removeprefix("blk.0."), t.data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _nested_arrays(path, depth: int):
    """A header-only GGUF file whose one metadata entry is an array nested `depth` deep."""
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<I", V.ARRAY)
    path.write_bytes(data + struct.pack("<IQ", V.ARRAY, 1) * depth + struct.pack("<IQ", V.UINT32, 0))
    return path


def _aligned_gguf(path, alignment: int):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_tensor("t.weight", np.ones((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    site = sites(path)["kv:general.alignment:value"]
    path.write_bytes(put(path.read_bytes(), site, alignment))
    return path


# (case, key, value, type, item type, fragments): a well-formed file with one value of the wrong type
RETYPED = [
    ("tokens-uint32", "tokenizer.ggml.tokens", 5, V.UINT32, None, ["tokenizer.ggml.tokens", "list of str"]),
    ("tokens-string", "tokenizer.ggml.tokens", "abc", V.STRING, None, ["tokens", "list of str"]),
    ("merges-ints", "tokenizer.ggml.merges", [1, 2], V.ARRAY, V.UINT32, ["merges", "list of str"]),
    ("types-strings", "tokenizer.ggml.token_type", ["a"] * 257, V.ARRAY, V.STRING,
     ["tokenizer.ggml.token_type", "list of int"]),
    ("bos-nan", "tokenizer.ggml.bos_token_id", float("nan"), V.FLOAT32, None, ["bos_token_id", "type int"]),
    ("bos-list", "tokenizer.ggml.bos_token_id", [1], V.ARRAY, V.UINT32, ["bos_token_id", "type int"]),
    ("pre-list", "tokenizer.ggml.pre", ["a"], V.ARRAY, V.STRING, ["tokenizer.ggml.pre", "type str"]),
    ("template-int", "tokenizer.chat_template", 1, V.UINT32, None, ["tokenizer.chat_template", "type str"]),
    ("layers-float-inf", "llama.block_count", float("inf"), V.FLOAT32, None,
     ["llama.block_count = inf is not a plausible layer count"]),
    ("heads-string", "llama.attention.head_count", "many", V.STRING, None,
     ["llama.attention.head_count = 'many' is not a plausible head count"]),
    # a count that is not a whole number is not rounded into one
    ("heads-2.5", "llama.attention.head_count", 2.5, V.FLOAT32, None, ["head_count = 2.5", "a whole number"]),
    ("heads-string-2", "llama.attention.head_count", "2", V.STRING, None, ["head_count = '2'", "a whole number"]),
    ("heads-true", "llama.attention.head_count", True, V.BOOL, None, ["head_count = True", "a whole number"]),
    # one type and one score a token (llama.cpp reads them by token id, past the end of a short list)
    ("types-short", "tokenizer.ggml.token_type", [1] * 10, V.ARRAY, V.INT32,
     ["tokenizer.ggml.token_type has 10 entries and tokenizer.ggml.tokens 257"]),
    ("scores-short", "tokenizer.ggml.scores", [0.0] * 10, V.ARRAY, V.FLOAT32,
     ["tokenizer.ggml.scores has 10 entries"]),
    ("arch-uint32", "general.architecture", 5, V.UINT32, None, ["general.architecture = '5' is no architecture"]),
    ("arch-newline", "general.architecture", "llama\nx", V.STRING, None, ["architecture 'llama\\nx' is not"]),
]

HF_CONFIG = dict(model_type="llama", vocab_size=257, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256)
HF_CASES = [  # (case, fields merged into a valid config, or raw JSON text appended to one; fragments)
    ("layers-1e9", {"num_hidden_layers": 10**9},
     ["num_hidden_layers = 1000000000 is not a plausible layer count"]),
    ("mistral-layers-1e9", {"model_type": "mistral", "sliding_window": 8, "num_hidden_layers": 10**9},
     ["num_hidden_layers = 1000000000", "plausible"]),
    ("gemma3-layers-1e9", {"model_type": "gemma3_text", "sliding_window": 8, "num_hidden_layers": 10**9},
     ["num_hidden_layers = 1000000000", "plausible"]),
    ("hidden-2^31", {"hidden_size": 1 << 31}, ["hidden_size = 2147483648 is not a plausible hidden size"]),
    ("vocab-2^40", {"vocab_size": 1 << 40}, ["vocab_size = 1099511627776", "plausible vocabulary"]),
    ("heads-0", {"num_attention_heads": 0}, ["num_attention_heads = 0", "plausible head count"]),
    ("context-1e12", {"max_position_embeddings": 10**12}, ["max_position_embeddings", "plausible context"]),
    ("head-dim-2^31", {"head_dim": 1 << 31}, ["head_dim = 2147483648", "plausible head size"]),
    ("window-2^40", {"model_type": "mistral", "sliding_window": 1 << 40}, ["sliding_window", "plausible"]),
    ("layers-inf", '"num_hidden_layers": 1e400', ["num_hidden_layers"]),
    ("nested-100000", '"a": ' + "[" * 100_000 + "]" * 100_000, ["nested too deeply"]),
    ("int-5000-digits", '"hidden_size": ' + "9" * 5000, ["cannot read"]),
    ("rope-list", {"rope_scaling": [1, 2]}, ["bad field"]),
    ("yarn-without-factor", {"rope_scaling": {"rope_type": "yarn"}}, ["lacks the field 'factor'", "incomplete"]),
    ("gemma3-query-scalar-negative", {"model_type": "gemma3_text", "sliding_window": 8, "query_pre_attn_scalar": -16},
     ["query_pre_attn_scalar = -16, where a number > 0 belongs"]),
    ("experts-1e9", {"model_type": "mixtral", "num_local_experts": 10**9, "num_experts_per_tok": 2},
     ["num_local_experts = 1000000000", "plausible expert count"]),
    ("experts-per-token-past-experts", {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 9,
                                        "moe_intermediate_size": 32},
     ["num_experts_per_tok = 9", "1 to num_experts or num_local_experts = 4"]),
    *[(f"eps-{x}", {"rms_norm_eps": x}, ["rms_norm_eps", "> 0 and < 1"]) for x in (0, float("inf"), float("nan"), 1)],
    *[(f"rope-theta-{x}", {"rope_theta": x}, [f"rope_theta = {float(x)}", "rope base"]) for x in (0, float("inf"), -1)],
    ("gemma3-local-rope-0", {"model_type": "gemma3_text", "sliding_window": 8, "rope_local_base_freq": 0},
     ["rope_local_base_freq = 0.0", "local rope base"]),
    ("rope-linear-factor-0", {"rope_scaling": {"rope_type": "linear", "factor": 0}}, ["rope_scaling.factor = 0.0"]),
    ("llama3-freq-factors-equal", {"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                                                    "high_freq_factor": 4, "original_max_position_embeddings": 64}},
     ["rope_scaling.high_freq_factor = 4.0", "above rope_scaling.low_freq_factor = 4.0"]),
    ("kv-heads-0", {"num_key_value_heads": 0}, ["num_key_value_heads = 0"]),
    ("kv-heads-3", {"num_key_value_heads": 3}, ["num_key_value_heads = 3", "a divisor of num_attention_heads = 4"]),
    ("head-dim-0", {"head_dim": 0}, ["head_dim = 0"]),
    ("context-0", {"max_position_embeddings": 0}, ["max_position_embeddings = 0"]),
    ("heads-string-4", {"num_attention_heads": "4"}, ["num_attention_heads = '4'", "a whole number"]),
    ("layers-2.5", {"num_hidden_layers": 2.5}, ["num_hidden_layers = 2.5", "a whole number"]),
    ("vocab-0", {"vocab_size": 0}, ["vocab_size = 0"]),
    ("tie-string", {"tie_word_embeddings": "false"}, ["tie_word_embeddings must be true or false, got 'false'"]),
    ("act-gelu", {"hidden_act": "gelu"}, ["hidden_act is 'gelu'", "llama model's MLP with silu"]),
    ("gemma3-act-silu", {"model_type": "gemma3_text", "sliding_window": 8, "hidden_activation": "silu"},
     ["hidden_activation is 'silu'", "with gelu_pytorch_tanh"]),
    ("gemma3-layer-type-bogus", {"model_type": "gemma3_text", "sliding_window": 8, "layer_types": ["bogus"] * 2},
     ["layer_types holds 'bogus'"]),
    ("qwen3-layer-types-string", {"model_type": "qwen3", "layer_types": "sliding_attention"},
     ["layer_types must be a list"]),
    ("layers-without-tensors", {}, ["num_hidden_layers = 3", "no tensors of layer 0"]),
    ("model-type-list", {"model_type": ["llama"]}, ["not supported"]),
    ("quantized-gptq", {"quantization_config": {"quant_method": "gptq", "bits": 4}},
     ["quantized with 'gptq'", "float checkpoint"]),
]


def _hf_dir(root, name: str, config: dict | str) -> str:
    """A model directory: config.json (with the odd fields) and a one-tensor model.safetensors."""
    path = root / name
    path.mkdir()
    if isinstance(config, dict):
        text = json.dumps({**HF_CONFIG, **config})
    else:  # a later duplicate key wins in json.loads
        text = json.dumps(HF_CONFIG)[:-1] + ", " + config + "}"
    (path / "config.json").write_text(text)
    save_file({"model.norm.weight": np.ones(64, dtype=np.float32)}, str(path / "model.safetensors"))
    return str(path)


def _safetensors(header: dict | None = None, length: int | None = None) -> bytes:
    """A one-tensor safetensors file, with its JSON header or the header's length replaced."""
    header = header or {"model.norm.weight": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}}
    text = json.dumps(header)
    text += " " * (-len(text) % 8)
    return (len(text) if length is None else length).to_bytes(8, "little") + text.encode() + bytes(256)


ST_CASES = [  # (case, model.safetensors bytes): already refused by the safetensors library; kept as guards
    ("header-len-2^64-1", _safetensors(length=M64)),
    ("header-len-past-end", _safetensors(length=4096)),
    ("shape-overflow", _safetensors({"model.norm.weight": {"dtype": "F32", "shape": [1 << 32, 1 << 32, 4],
                                                           "data_offsets": [0, 256]}})),
    ("offset-past-end", _safetensors({"model.norm.weight": {"dtype": "F32", "shape": [64],
                                                            "data_offsets": [0, 1 << 40]}})),
]


@pytest.fixture(scope="module")
def results(base, tmp_path_factory):
    """Every hostile file of this module, loaded once in the capped worker."""
    root = tmp_path_factory.mktemp("hostile")
    _, data, where = base
    paths = {}
    for case, site, value, _ in GGUF_CASES:
        paths[f"gguf:{case}"] = root / f"{case}.gguf"
        paths[f"gguf:{case}"].write_bytes(_mutated(data, where, site, value))
    two = paths["two-layers"] = _two_layers(base[0], root / "two-layers.gguf")
    two_data, two_where = two.read_bytes(), sites(two)
    for case, site, value, _ in GARBAGE_CASES:
        paths[f"garbage:{case}"] = root / f"garbage-{case}.gguf"
        blob = (_mutated(two_data, two_where, site.removeprefix("two:"), value) if site.startswith("two:")
                else _mutated(data, where, site, value))
        paths[f"garbage:{case}"].write_bytes(blob)
    for case, entries, *_ in GARBAGE_KEYS + LEGIT_KEYS:
        paths[f"keys:{case}"] = _with_keys(base[0], root / f"keys-{case}.gguf", entries)
    for case, key, value, vtype, sub, _ in RETYPED:
        paths[f"retyped:{case}"] = retyped(base[0], root / f"{case}.gguf", key, value, vtype, sub)
    paths["nested-arrays"] = _nested_arrays(root / "nested.gguf", 100_000)
    for value in (0, 3, 1 << 31, M32):
        paths[f"align:{value}"] = _aligned_gguf(root / f"align-{value}.gguf", value)
    for case, config, _ in HF_CASES:
        paths[f"hf:{case}"] = _hf_dir(root, case, config)
    for case, blob in ST_CASES:
        paths[f"st:{case}"] = Path(_hf_dir(root, f"st-{case}", {}))
        (paths[f"st:{case}"] / "model.safetensors").write_bytes(blob)
    out = run_worker([str(p) for p in paths.values()], root)
    return {key: out[str(p)] for key, p in paths.items()}


def _assert_clean(result: dict, fragments: list[str]):
    assert result["outcome"] == "MinervaError", result
    assert "\n" not in result["message"], result  # the CLI prints it as one line
    assert result["seconds"] < SECONDS_PER_FILE, result
    assert result["rss_growth_mb"] < RSS_GROWTH_MB, result
    assert "MemoryError" not in result["message"] and "RecursionError" not in result["message"], result
    for f in fragments:
        assert f in result["message"], result


@pytest.mark.parametrize("case,site,value,fragments", GGUF_CASES, ids=[c[0] for c in GGUF_CASES])
def test_corrupt_gguf_is_one_clean_error(results, case, site, value, fragments):
    _assert_clean(results[f"gguf:{case}"], fragments)


@pytest.mark.parametrize("case,site,value,fragments", GARBAGE_CASES, ids=[c[0] for c in GARBAGE_CASES])
def test_metadata_that_would_compute_garbage_is_one_clean_error(results, case, site, value, fragments):
    _assert_clean(results[f"garbage:{case}"], fragments)


@pytest.mark.parametrize("case,entries,fragments", GARBAGE_KEYS, ids=[c[0] for c in GARBAGE_KEYS])
def test_added_metadata_that_would_compute_garbage_is_one_clean_error(results, case, entries, fragments):
    _assert_clean(results[f"keys:{case}"], fragments)


@pytest.mark.parametrize("case", ["two-layers", *[f"keys:{c[0]}" for c in LEGIT_KEYS]])
def test_legitimate_metadata_variations_load(results, case):
    """The checks refuse only what is wrong: a stated vocab_size equal to the tokens, -1 for no
    padding token, special ids inside the vocabulary, a rope dimension count, linear scaling."""
    assert results[case]["outcome"] == "ok", results[case]


@pytest.mark.parametrize("case,key,value,vtype,sub,fragments", RETYPED, ids=[c[0] for c in RETYPED])
def test_value_of_the_wrong_type_is_one_clean_error(results, case, key, value, vtype, sub, fragments):
    _assert_clean(results[f"retyped:{case}"], fragments)


def test_deeply_nested_gguf_arrays_are_one_clean_error(results):
    _assert_clean(results["nested-arrays"], ["metadata 'a'", "nested more than"])


@pytest.mark.parametrize("alignment", [0, 3, 1 << 31, M32])
def test_bad_alignment_is_one_clean_error(results, alignment):
    expected = "alignment 2147483648" if alignment == 1 << 31 else f"general.alignment = {alignment}"
    _assert_clean(results[f"align:{alignment}"], [expected])


@pytest.mark.parametrize("case,config,fragments", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_absurd_config_json_is_one_clean_error(results, case, config, fragments):
    _assert_clean(results[f"hf:{case}"], ["config.json", *fragments])


@pytest.mark.parametrize("case", [c[0] for c in ST_CASES])
def test_corrupt_safetensors_is_one_clean_error(results, case):
    _assert_clean(results[f"st:{case}"], ["model.safetensors", "not a readable safetensors file"])


def test_a_tensor_in_two_files_or_a_shard_outside_the_folder_is_refused(tmp_path):
    """Two files holding one tensor (which would be the model's?) and an index naming a shard
    outside the model directory are errors, not the last file alphabetically winning."""
    from minerva.errors import MinervaError
    from minerva.formats.safetensors import SafeTensorsDir
    two = Path(_hf_dir(tmp_path, "two", {}))
    save_file({"model.norm.weight": np.zeros(64, dtype=np.float32)}, str(two / "stray.safetensors"))
    with pytest.raises(MinervaError, match="tensor 'model.norm.weight' is in both 'model.safetensors' and "
                                           "'stray.safetensors'"):
        SafeTensorsDir(two)
    outside = Path(_hf_dir(tmp_path, "outside", {}))
    (outside / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "../two/model.safetensors"}}))
    with pytest.raises(MinervaError, match="names the shard '../two/model.safetensors' outside the model directory"):
        SafeTensorsDir(outside)


def test_cli_reports_a_corrupt_array_length_on_one_line(base, tmp_path):
    _, data, where = base
    bad = tmp_path / "huge-vocab.gguf"
    bad.write_bytes(put(data, where[TOKENS], M64))
    start = time.perf_counter()
    proc = run("generate", str(bad), "hi", timeout=120)
    assert_clean_error(proc, "huge-vocab.gguf", "tokenizer.ggml.tokens", "re-download")
    assert time.perf_counter() - start < 60  # the command's start-up included; the old loader never ended


def test_cli_reports_a_relabelled_norm_tensor_on_one_line(base, tmp_path):
    _, data, where = base
    bad = tmp_path / "relabelled.gguf"
    bad.write_bytes(put(data, where["t:output_norm.weight:type"], F16))
    assert_clean_error(run("generate", str(bad), "hi", timeout=120), "relabelled.gguf",
                       "tensor 'output_norm.weight' of type F16", "takes 32 bytes")


def test_cli_reports_a_deeply_nested_config_on_one_line(tmp_path):
    path = _hf_dir(tmp_path, "deep", '"a": ' + "[" * 100_000 + "]" * 100_000)
    assert_clean_error(run("generate", path, "hi", timeout=120), "config.json", "nested too deeply")


# ------------------------------------------------------------------ fuzz

FUZZ_SEED, FUZZ_SITES, FUZZ_BYTES, FUZZ_CUTS = 20240612, 320, 80, 40


def fuzz_cases(data: bytes, where: dict, seed: int) -> list[tuple[str, bytes]]:
    """Deterministic mutations of a valid file: an interesting value written over a length,
    count, type or offset; a few random bytes in the header, metadata and tensor infos; a cut."""
    rng = random.Random(seed)
    size, names = len(data), sorted(where)
    infos_end = max(s.offset + s.width for s in where.values())
    cases = []
    for _ in range(FUZZ_SITES):
        site = where[rng.choice(names)]
        old = site.value(data)
        value = rng.choice(INTERESTING + [size - 1, size, size + 1, size - infos_end, size - infos_end + 32,
                                          old - 1, old + 1, 2 * old, old + rng.randint(2, 64)])
        cases.append((f"{site.name}={value}", put(data, site, value)))
    for i in range(FUZZ_BYTES):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(infos_end)] = rng.randrange(256)
        cases.append((f"bytes-{i}", bytes(b)))
    for _ in range(FUZZ_CUTS):
        n = rng.randrange(size)
        cases.append((f"cut-{n}", data[:n]))
    return cases


def test_mutation_fuzz_loads_or_fails_cleanly(base, tmp_path):
    """Each mutated file loads or raises MinervaError (never another exception), each within
    SECONDS_PER_FILE and without growing the peak RSS by more than RSS_GROWTH_MB."""
    _, data, where = base
    cases = [("unmutated", data), *fuzz_cases(data, where, FUZZ_SEED)]
    paths = {}
    for i, (name, blob) in enumerate(cases):
        paths[name] = tmp_path / f"case{i}.gguf"
        paths[name].write_bytes(blob)
    start = time.perf_counter()
    results = run_worker([str(p) for p in paths.values()], tmp_path)
    wall = time.perf_counter() - start
    by_case = {name: results[str(p)] for name, p in paths.items()}
    assert by_case["unmutated"]["outcome"] == "ok", by_case["unmutated"]
    bad = {name: r for name, r in by_case.items()
           if r["outcome"] not in ("ok", "MinervaError") or r["seconds"] > SECONDS_PER_FILE
           or r["rss_growth_mb"] > RSS_GROWTH_MB
           or "MemoryError" in r["message"] or "RecursionError" in r["message"]}
    assert not bad, {name: (r["outcome"], r["message"][-300:]) for name, r in list(bad.items())[:10]}
    errors = sum(r["outcome"] == "MinervaError" for r in by_case.values())
    assert errors > len(cases) // 2, f"only {errors} of {len(cases)} mutations were refused"
    print(f"{len(cases)} cases, {errors} refused, {wall:.1f} s")


def test_a_model_path_that_is_no_regular_file_says_what_it_is(tmp_path):
    """A named pipe, a device, a looping or dangling link: said as such (not 'does not exist'),
    by the CLI and by GGUFFile, and nothing blocks reading a pipe."""
    fifo, loop, dangling = tmp_path / "pipe.gguf", tmp_path / "loop.gguf", tmp_path / "dangling.gguf"
    os.mkfifo(fifo)
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "gone.gguf")
    for path, words in ((fifo, "is a named pipe, not a file"), (loop, "is a symbolic link that leads back to itself"),
                        (dangling, "is a symbolic link to nothing"), (Path("/dev/zero"), "is a character device")):
        with pytest.raises(MinervaError, match=words):
            GGUFFile(path)
        assert_clean_error(run("generate", str(path), "hi", timeout=60), f"'{path}' {words}")


def test_tensors_the_model_does_not_use_are_a_warning(base, tmp_path, caplog):
    """A tensor the architecture does not read (a Mamba layer's in a file that says llama): the
    file may not be what it says, and its answers would be wrong without a word: a warning."""
    from minerva.models.loader import load_model

    reader = gguf.GGUFReader(base[0], "r")
    w = gguf.GGUFWriter(str(tmp_path / "extra.gguf"), "llama")
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            w.add_key_value(name, field.contents(), field.types[0],
                            sub_type=field.types[-1] if field.types[0] == V.ARRAY else None)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
    w.add_tensor("blk.0.ssm_conv1d.weight", np.ones((16, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with caplog.at_level("WARNING", logger="minerva"):
        load_model(base[0])
    assert "not used" not in caplog.text
    with caplog.at_level("WARNING", logger="minerva"):
        load_model(tmp_path / "extra.gguf")
    assert "1 of its tensors are not used by a llama model (blk.0.ssm_conv1d.weight)" in caplog.text
