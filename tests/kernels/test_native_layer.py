"""The C++ decoder layers (all of them in one call, with or without the embedding and rotary
tables before them and the final norm and LM head after, or one call per layer) against the
Python layer built from the same kernels: the same bits in every logit, on both real models,
with float and int8 KV pools, prefill chunks and decode steps."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from minerva.kernels import native
from tests.helpers.paged import paged_logits

@contextlib.contextmanager
def restored(model):
    """Puts back what a test takes away of the model's C++ path: the layer stack, the head and
    step arguments that join it, each layer's C++ twin."""
    saved = model.stack, model.head, model.step_args
    fused = [layer.fused for layer in model.layers]
    try:
        yield
    finally:
        model.stack, model.head, model.step_args = saved
        for layer, n in zip(model.layers, fused):
            layer.fused = n


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not native.capable(),
                                 reason="this CPU cannot run the native kernels")]


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("fixture", ["smollm2_llm", "gemma3_llm"])
def test_native_layer_gives_the_python_layers_bits(request, fixture, kv):
    llm = request.getfixturevalue(fixture)
    model = llm.loaded.model
    fused = [layer.fused for layer in model.layers]
    assert all(n is not None for n in fused), "every layer of a packed GGUF model should have a C++ twin"
    # float activations: every step on the tensor path (the row path is the 8-bit one, below)
    assert not any(n.row_path for n in fused)
    rng = random.Random(0)
    ids = [rng.randrange(1000, 20000) for _ in range(600)]  # past Gemma's 512-token window
    # chunk=256: prefill chunks over earlier keys; chunk=1: decode steps, one token at a time;
    # chunk=5: steps of 5 tokens and a last of 3, the sizes a batched decode step has (the C++
    # layers keep those outputs between calls and must take each new size)
    runs = [(ids, 256), (ids[:40], 1), (ids[:23], 5)]

    pools = []  # the thread pool's counts over each configuration's runs, for a failure's message

    def logits():
        before = native.pool_stats() or {}
        out = [paged_logits(model, x, chunk=c, k_format=kv, v_format=kv, dtype=llm.dtype, device=llm.device)
               for x, c in runs]
        pools.append({k: v - before.get(k, 0) for k, v in (native.pool_stats() or {}).items()})
        return out

    def same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
        for run, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), (f"{what}, {('prefill', 'decode', 'steps of 5')[run]}: max difference "
                                       f"{(x - y).abs().max().item():.3g}; thread pool per configuration: {pools}")

    assert model.stack is not None, "a model whose layers all have C++ twins runs them in one call"
    assert model.head is not None and model.step_args is not None, "its packed LM head and embedding join that call"
    with_stack = logits()
    with restored(model):
        model.step_args = None  # the embedding and rotary tables from Python
        same(logits(), with_stack, "embedding and rotary tables from Python")
        model.head = None  # and the final norm and the head
        same(logits(), with_stack, "final norm and head from Python")
        model.stack = None
        per_layer = logits()
        for layer in model.layers:
            layer.fused = None
        without = logits()
    same(per_layer, with_stack, "one call a layer against the stack")
    same(without, per_layer, "the Python layers against the native ones")


@pytest.fixture(scope="module")
def small_k_files(tmp_path_factory, smollm2_gguf):
    """TinyLlama's shape shrunk 4 times, two layers, in llama.cpp's Q4_K_M, Q3_K_M and Q2_K
    mixes: Q/K/V and gate/up of different types side by side (regrouped K-quants, Q6_K in the
    GGUF layout), the matrices SmolLM2's Q4_1 file does not have."""
    from benchmarks import synthetic as syn

    shape = syn.adjust(syn.SHAPES["tinyllama-1.1b"], layers=2, shrink=4)
    out = {}
    for kind in ("Q4_K_M", "Q3_K_M", "Q2_K"):
        path = tmp_path_factory.mktemp("synthetic") / f"tinyllama-small-{kind}.gguf"
        syn.write(path, shape, kind, seed=5)
        out[kind] = path
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("model_file", ["smollm2", "gemma3", "Q4_K_M", "Q3_K_M", "Q2_K"])
def test_row_path_gives_the_python_layers_bits(request, model_file, kv, dtype):
    """With 8-bit activations a decode step's one token goes through each C++ layer on raw
    memory (DecoderLayer.forward_row: no tensors between the matmuls; Gemma 3's with its Q/K
    and post norms, and past its 512-token sliding window); its logits against the Python
    layers over the same kernels, bit for bit, with prefill chunks (the tensor path) before
    the decode steps."""
    from minerva.models.loader import load_model

    path = (request.getfixturevalue(f"{model_file}_gguf") if model_file in ("smollm2", "gemma3")
            else request.getfixturevalue("small_k_files")[model_file])
    model = load_model(path, device="cpu", dtype=dtype, activations="int8").model
    fused = [layer.fused for layer in model.layers]
    assert all(n is not None and n.row_path for n in fused), "every layer should take the row path"
    rng = random.Random(1)
    ids = [rng.randrange(1000, 20000) for _ in range(530)]
    # prefill chunks, then one token a step (Gemma 3: from 512 prefilled, across its window's edge)
    runs = [(ids[:40], 16), (ids[:24], 1)] if model_file != "gemma3" else [(ids[:40], 16), (ids, [512, 1])]

    def logits():
        return [paged_logits(model, x, chunk=c, k_format=kv, v_format=kv, dtype=dtype) for x, c in runs]

    with_rows = logits()
    with restored(model):
        model.stack = model.head = model.step_args = None  # (they hold the C++ layers too)
        for layer in model.layers:
            layer.fused = None
        without = logits()
    for run, (x, y) in enumerate(zip(with_rows, without)):
        assert torch.equal(x, y), f"{('prefill', 'decode')[run]}: max difference {(x - y).abs().max().item():.3g}"
