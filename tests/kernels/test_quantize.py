"""`--quantize int8|int4`: group-wise quantization of SafeTensors weights at load.

The quantizer is checked byte for byte against the gguf package's port of the reference
quantizer, and a quantized model's logits against transformers running the same
checkpoint with every weight replaced by the gguf package's dequantization of it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize as gguf_quantize

from minerva.errors import MinervaError
from minerva.kernels.quantize import quantize
from minerva.kernels.weights import PackedWeight
from minerva.models.layers import Linear
from minerva.models.loader import load_model
from tests.helpers.hf import load_hf_quantized_reference
from tests.helpers.paged import paged_logits
from tests.helpers.tiny_gguf import write_tiny_llama
from tests.helpers.tiny_hf import VOCAB, save


def awkward_rows(cols: int) -> np.ndarray:
    """Rows that stress the rounding: zeros, constants, one sign only, exact halves, tiny values."""
    rng = np.random.default_rng(1)
    rows = [np.zeros(cols), np.full(cols, 0.25), -np.abs(rng.standard_normal(cols)),
            np.abs(rng.standard_normal(cols)) * 1e-6,
            np.tile(np.arange(-16, 16) / 2.0, cols // 32),  # many values land exactly on .5 steps
            np.tile(np.arange(32) / 15.0, cols // 32)]
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_equal_the_reference_quantizer(qtype, source):
    rng = np.random.default_rng(int(qtype))
    cols = 256
    w = np.concatenate([rng.standard_normal((37, cols)).astype(np.float32) * 0.05, awkward_rows(cols)])
    t = torch.from_numpy(w).to(source)
    ours = quantize(t, qtype).numpy()
    ref = gguf_quantize(t.float().numpy(), qtype)
    np.testing.assert_array_equal(ours, ref)


def test_slabs_give_the_same_bytes(monkeypatch):
    w = torch.randn(100, 64)
    whole = quantize(w, QT.Q4_1)
    monkeypatch.setattr("minerva.kernels.quantize.ROWS_PER_SLAB", 7)
    assert torch.equal(quantize(w, QT.Q4_1), whole)


def test_bad_tensors_are_refused():
    with pytest.raises(MinervaError, match="not a multiple of 32"):
        quantize(torch.randn(4, 48), QT.Q8_0, "blk.0.w")
    with pytest.raises(MinervaError, match="too large for fp16"):
        quantize(torch.full((2, 32), 1e7), QT.Q8_0, "blk.0.w")


def reference_logits(path, ids, scheme):
    with torch.inference_mode():
        return load_hf_quantized_reference(path, scheme)(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama-untied", "llama-tied", "gemma3"])
def test_quantized_model_matches_transformers_on_dequantized_weights(tmp_path, name, scheme):
    path = save(tmp_path, name)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    loaded = load_model(path, quantize=scheme)
    m = loaded.model
    weights = [mod.weight for mod in m.modules() if isinstance(mod, Linear)]
    assert weights and all(isinstance(w, PackedWeight) for w in weights)
    mine = paged_logits(m, ids, chunk=8)
    ref = reference_logits(path, ids, scheme)
    assert torch.allclose(mine, ref, atol=2e-4, rtol=1e-4), (mine - ref).abs().max()
    dense = load_model(path)  # packed, and smaller than the float model by the scheme's ratio
    ratio = 3 if scheme == "int8" else 5
    assert loaded.weight_bytes < dense.weight_bytes / ratio
    if all(w.kernel is not None for w in weights):
        assert loaded.compute_bytes < dense.compute_bytes / ratio  # no float copy held for compute
    assert isinstance(m.embed, PackedWeight) and m.embed.qtype == QT.Q8_0
    assert getattr(dense.model.embed, "qtype", QT.F32) in (QT.F32, QT.F16, QT.BF16)  # float unless asked


def test_quantize_refuses_a_gguf_file(tmp_path):
    with pytest.raises(MinervaError, match="already quantized"):
        load_model(write_tiny_llama(tmp_path / "tiny.gguf"), quantize="int8")


def test_unknown_scheme(tmp_path):
    with pytest.raises(MinervaError, match="choose int8 or int4"):
        load_model(save(tmp_path, "llama-tied"), quantize="int3")
