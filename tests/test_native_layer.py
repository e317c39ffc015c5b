"""The C++ decoder layer (one call per layer) against the Python layer built from the same
kernels: the same bits, on both real models, with float and int8 KV pools, prefill chunks
and decode steps."""

from __future__ import annotations

import random

import pytest

from minerva.engine.perplexity import window_nll
from minerva.kernels import native

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(native.NEEDED_CPU_FLAGS - native.cpu_flags()),
                                 reason="this CPU cannot run the native kernels")]


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("fixture", ["smollm2_llm", "gemma3_llm"])
def test_native_layer_gives_the_python_layers_bits(request, fixture, kv):
    llm = request.getfixturevalue(fixture)
    model = llm.loaded.model
    fused = [layer.fused for layer in model.layers]
    assert all(n is not None for n in fused), "every layer of a packed GGUF model should have a C++ twin"
    rng = random.Random(0)
    ids = [rng.randrange(1000, 20000) for _ in range(600)]  # past Gemma's 512-token window
    # chunk=256: prefill chunks over earlier keys; the sums cover 600 scored positions
    # chunk=256: prefill chunks over earlier keys; chunk=1: decode steps, one token at a time
    runs = [(ids, 256), (ids[:40], 1)]
    with_native = [window_nll(model, x, len(x) - 1, llm.device, llm.dtype, kv, kv, chunk=c) for x, c in runs]
    try:
        for layer in model.layers:
            layer.fused = None
        without = [window_nll(model, x, len(x) - 1, llm.device, llm.dtype, kv, kv, chunk=c) for x, c in runs]
    finally:
        for layer, n in zip(model.layers, fused):
            layer.fused = n
    assert with_native == without
