"""A whole model on the Triton backend (minerva/kernels/cuda/backend.py), here on the CPU under
Triton's interpreter: the backend runs by name (`kernels="triton"`) on the CPU, a tiny Llama checkpoint is
quantized at load (Q8_0 / Q4_1 blocks, which stay packed for the Triton matmul), and its
logits, computed through the paged KV cache in two chunks, match the plain-torch reference
path on the same weights."""

from __future__ import annotations

import pytest
import torch

from minerva import LLM
from minerva.kernels import dispatch
from minerva.kernels.weights import PackedWeight
from tests.helpers import tiny_hf
from tests.helpers.paged import paged_logits

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[test]')")
from minerva.kernels.cuda.backend import TritonBackend, TritonKernels  # noqa: E402

IDS = [0, 5, 17, 200, 33, 9, 140, 77, 3, 250, 11, 64, 128, 19, 42, 7, 99, 180, 2, 55]


def run(monkeypatch, kernels, path, quantize, k_format="auto"):
    """The model on backend `kernels` by name, on the CPU (the Triton kernels under the interpreter)."""
    monkeypatch.setattr(TritonBackend, "devices", ("cuda", "cpu"))
    monkeypatch.setattr(dispatch, "_chosen", {})
    monkeypatch.setattr(dispatch, "_loaded", {})
    llm = LLM(str(path), device="cpu", kernels=kernels, dtype="float32", quantize=quantize, activations="float")
    assert type(dispatch.backend("cpu")) is dispatch.backend_class(kernels)
    model = llm.engine.model
    packed = [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), PackedWeight)]
    logits = paged_logits(model, IDS, chunk=12, block_size=4, k_format=k_format, v_format=k_format)
    return logits, packed


@pytest.mark.parametrize("name, quantize, k_format", [("llama-untied", "int8", "auto"),
                                                      ("mistral-sliding", "int4", "int8")])  # a window of 8
def test_model_logits_on_the_triton_kernels_match_the_reference(tmp_path, monkeypatch, name, quantize, k_format):
    path = tiny_hf.save(tmp_path, name)
    ours, packed = run(monkeypatch, "triton", path, quantize, k_format)
    assert packed and all(isinstance(w.kernel, TritonKernels) and w._dense is None for w in packed)
    ref, ref_packed = run(monkeypatch, "reference", path, quantize, k_format)
    assert all(w.kernel is None for w in ref_packed)  # the reference: dequantized, torch matmuls
    scale = ref.abs().max()
    assert ((ours - ref).abs() <= 1e-4 * scale).all(), (ours - ref).abs().max() / scale
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
