"""benchmarks/widened.py: a real model's weights inside a larger llama shape.

References: transformers on the pulled SmolLM2 file (the widened file must give its logits)
and the `gguf` package's reader (the model's blocks, byte for byte, in the larger matrices).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from benchmarks import widened
from minerva import LLM, SamplingParams
from minerva.errors import MinervaError
from tests.helpers import tiny_gguf
from tests.helpers.hf import load_hf_reference

TEXTS = ["The three primary colors are", "def add(a, b):\n    return a + b  # 12345"]
WIDE = {"hidden": 1024, "ffn": 2048, "heads": 16, "kv_heads": 4}  # SmolLM2: 576, 1536, 9, 3


@pytest.fixture(scope="module")
def wide_file(smollm2_gguf, tmp_path_factory):
    path = tmp_path_factory.mktemp("widened") / "wide.gguf"
    widened.widen(smollm2_gguf, path, WIDE)
    return path


def test_widened_file_gives_the_models_logits(wide_file, smollm2_hf, smollm2_llm):
    """transformers on the widened file (hidden 1024, 16 heads in 4 groups of 4, feed-forward
    2048) against transformers on SmolLM2 itself: the same logits up to float rounding."""
    wide = load_hf_reference(wide_file)
    assert (wide.config.hidden_size, wide.config.num_attention_heads, wide.config.num_key_value_heads,
            wide.config.intermediate_size, wide.config.num_hidden_layers) == (1024, 16, 4, 2048, 30)
    for text in TEXTS:
        ids = torch.tensor([smollm2_llm.tokenizer.encode(text)])
        with torch.no_grad():
            want, got = smollm2_hf(ids).logits, wide(ids).logits
        assert (got - want).abs().max() < 1e-4 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_minerva_replies_on_the_widened_file_as_on_the_model(wide_file, smollm2_llm):
    """The engine (float32, float activations) on the widened file: SmolLM2's greedy reply."""
    llm = LLM(str(wide_file), device="cpu", dtype="float32", activations="float", kv_cache_memory=float(64 << 20))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for text in TEXTS:
        want = smollm2_llm.generate([text], params)[0].outputs[0].token_ids
        assert llm.generate([text], params)[0].outputs[0].token_ids == want


def test_the_models_blocks_byte_for_byte(wide_file, smollm2_gguf):
    """Query head h of KV group g at the same place in the wider group g; K/V heads in place;
    the feed-forward and embedding rows at the top left; every other byte zero; norm weights
    scaled by sqrt(576 / 1024) and epsilon by 576 / 1024."""
    small = {t.name: t for t in gguf.GGUFReader(smollm2_gguf).tensors}
    wide = {t.name: t for t in gguf.GGUFReader(wide_file).tensors}
    assert small.keys() == wide.keys()

    def raw(t):  # rows x bytes
        return np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)

    q_small, q_wide = raw(small["blk.3.attn_q.weight"]), raw(wide["blk.3.attn_q.weight"])
    width = q_small.shape[1]
    for h in range(9):
        w = h // 3 * 4 + h % 3  # the first 3 of each group of 4
        assert np.array_equal(q_wide[64 * w:64 * w + 64, :width], q_small[64 * h:64 * h + 64])
    assert not q_wide[64 * 3:64 * 4].any() and not q_wide[64 * 15:].any() and not q_wide[:, width:].any()
    o_small, o_wide = raw(small["blk.3.attn_output.weight"]), raw(wide["blk.3.attn_output.weight"])
    per_head = o_small.shape[1] // 9  # a head's 64 columns, in bytes
    for h in range(9):
        w = h // 3 * 4 + h % 3
        assert np.array_equal(o_wide[:576, per_head * w:per_head * (w + 1)], o_small[:, per_head * h:per_head * (h + 1)])
    assert not o_wide[576:].any() and not o_wide[:, per_head * 3:per_head * 4].any()
    down_small, down_wide = raw(small["blk.7.ffn_down.weight"]), raw(wide["blk.7.ffn_down.weight"])
    assert np.array_equal(down_wide[:576, :down_small.shape[1]], down_small)
    assert not down_wide[576:].any() and not down_wide[:, down_small.shape[1]:].any()
    norm_small, norm_wide = small["blk.0.attn_norm.weight"].data, wide["blk.0.attn_norm.weight"].data
    np.testing.assert_allclose(norm_wide[:576], norm_small * np.sqrt(576 / 1024), rtol=1e-6)
    assert not norm_wide[576:].any()
    eps = gguf.GGUFReader(wide_file).fields["llama.attention.layer_norm_rms_epsilon"].parts[-1][0]
    assert eps == pytest.approx(1e-5 * 576 / 1024)


@pytest.mark.parametrize("sizes,message", [
    ({"hidden": 512}, "hidden size (512) is smaller than the model's (576)"),
    ({"heads": 8, "kv_heads": 4}, "heads per KV head (2) is smaller than the model's (3)"),
    ({"heads": 10, "kv_heads": 4}, "10 heads do not split into 4 KV groups"),
    ({"hidden": 600}, "rows of 600 values do not split into Q8_0 blocks of 32; give sizes that are multiples of 32"),
])
def test_a_narrower_shape_is_refused(smollm2_gguf, tmp_path, sizes, message):
    with pytest.raises(MinervaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        widened.widen(smollm2_gguf, tmp_path / "w.gguf", sizes)
    assert not list(tmp_path.iterdir())


def test_command_line_errors(smollm2_gguf, gemma3_gguf, tmp_path, capsys):
    assert widened.main([str(gemma3_gguf), "-o", str(tmp_path / "g.gguf")]) == 1
    assert "is a gemma3 model; widening takes the llama architecture" in capsys.readouterr().err
    assert widened.main([str(smollm2_gguf), "--layers", "31", "-o", str(tmp_path / "s.gguf")]) == 1
    assert "--layers takes 1 to 30 (the model's layers), got 31" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_float_model_widens_and_a_tensor_it_cannot_place_is_refused(tiny, tmp_path):
    """The tiny F32 llama widens (its float rows copied as bytes) and the engine loads it; a
    file with a tensor widening does not place (a bias) is refused before anything is written."""
    wide = tmp_path / "wide.gguf"
    widened.widen(tiny, wide, {"hidden": 2 * tiny_gguf.HIDDEN, "ffn": 2 * tiny_gguf.FFN})
    llm = LLM(str(wide), device="cpu", dtype="float32", activations="float", kv_cache_memory=float(8 << 20))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    small = LLM(str(tiny), device="cpu", dtype="float32", activations="float", kv_cache_memory=float(8 << 20))
    assert llm.generate(["ab"], params)[0].outputs[0].token_ids == small.generate(["ab"], params)[0].outputs[0].token_ids

    reader = gguf.GGUFReader(tiny)
    biased = tmp_path / "biased.gguf"
    w = gguf.GGUFWriter(biased, "llama")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(field.name, field.contents(), field.types[0],
                            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data))
    w.add_tensor("blk.0.attn_q.bias", np.zeros(tiny_gguf.HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(MinervaError, match="holds tensor blk.0.attn_q.bias, which widening does not place"):
        widened.widen(biased, out / "w.gguf", {"hidden": 2 * tiny_gguf.HIDDEN})
    assert not list(out.iterdir())
