"""The kernel dispatch point: a backend registered for a device type is what weights, ops and
attention ask, and a backend that covers nothing sends every caller to the torch reference.
Results are compared with the `gguf` package's dequantization and plain torch formulas."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from minerva.kernels import dispatch, ops
from minerva.kernels.attention import PagedKVCache, attention_kernel
from minerva.kernels.base import KernelBackend
from minerva.kernels.weights import PackedWeight

Q8_0 = gguf.GGMLQuantizationType.Q8_0


class Recording(KernelBackend):
    """Multiplies packed weights through the gguf package's dequantization; covers nothing else."""

    name = "recording"

    def __init__(self):
        self.calls = []

    def matmul_kernel(self, qtype, dtype):
        self.calls.append(("matmul", qtype, dtype))
        return self

    def qmatmul(self, x, packed, qtype, rows, cols):
        self.calls.append(("qmatmul", qtype))
        w = gguf.quants.dequantize(packed.numpy(), gguf.GGMLQuantizationType(qtype)).reshape(rows, cols)
        return x @ torch.from_numpy(w).to(x.dtype).T


@pytest.fixture
def recording(monkeypatch):
    """The recording backend in place of the CPU's for this test."""
    monkeypatch.setitem(dispatch.BACKENDS, "cpu", Recording)
    monkeypatch.setattr(dispatch, "_loaded", {})
    return dispatch.backend("cpu")


def q8_weight(rows=8, cols=64, seed=0):
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    packed = gguf.quants.quantize(w, Q8_0)
    return torch.from_numpy(packed), gguf.quants.dequantize(packed, Q8_0).reshape(rows, cols)


def test_a_registered_backend_multiplies_packed_weights(recording):
    packed, reference = q8_weight()
    w = PackedWeight(packed, Q8_0, (8, 64), torch.float32)
    assert w.kernel is recording and recording.calls == [("matmul", Q8_0, torch.float32)]
    x = torch.randn(3, 64, dtype=torch.float32)
    torch.testing.assert_close(w.matmul(x), x @ torch.from_numpy(reference).T)
    assert ("qmatmul", int(Q8_0)) in recording.calls


def test_what_a_backend_does_not_cover_runs_the_torch_reference(recording):
    x, g = torch.randn(5, 64), torch.rand(64)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g  # RMSNorm by its formula
    torch.testing.assert_close(ops.rms_norm(x, g, 1e-6), expected)
    cache = PagedKVCache(1, 2, 4, 2, 32, k_format="auto", v_format="auto", dtype=torch.float32, device="cpu")
    assert attention_kernel(torch.float32, cache) is None


def test_a_device_type_without_a_backend_covers_nothing():
    b = dispatch.backend("meta")
    assert type(b) is KernelBackend
    packed, _ = q8_weight()
    assert b.matmul_kernel(Q8_0, torch.float32) is None and b.layer_kernel(torch.float32) is None
    assert b.op_kernel(torch.empty(2, 64, device="meta")) is None
    assert b.default_dtype(torch.device("meta")) == "float32"
    assert PackedWeight(packed.to("meta"), Q8_0, (8, 64), torch.float32).kernel is None


@pytest.fixture
def fresh(monkeypatch):
    """No backend chosen or loaded yet; both put back afterwards."""
    monkeypatch.setattr(dispatch, "_chosen", {})
    monkeypatch.setattr(dispatch, "_loaded", {})


def test_backends_by_name_and_the_default_on_each_device(fresh, monkeypatch):
    from minerva import llm as llm_module
    assert set(dispatch.BACKENDS) == {"reference", "cpu", "triton"}
    assert dispatch.auto_name("cpu") == "cpu"
    assert dispatch.auto_name("cuda") == "reference"  # the Triton kernels have not run on a GPU yet
    assert dispatch.auto_name("meta") == "reference"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU present ...
    assert not dispatch.gpu_ready() and llm_module.default_device() == "cpu"  # ... is not the default
    if dispatch.available("triton"):  # once the GPU backend has passed on a GPU, it is
        monkeypatch.setattr(dispatch.backend_class("triton"), "checked", ("cuda",))
        assert dispatch.auto_name("cuda") == "triton" and dispatch.gpu_ready()
        assert llm_module.default_device() == "cuda"


def test_a_named_backend_runs_and_auto_puts_the_default_back(fresh):
    assert dispatch.choose("cpu", "reference") == "reference"
    assert type(dispatch.backend("cpu")) is KernelBackend
    packed, _ = q8_weight()
    assert PackedWeight(packed, Q8_0, (8, 64), torch.float32).kernel is None  # the reference multiplies
    assert dispatch.choose("cpu", None) == "cpu" and dispatch.backend("cpu").name == "cpu"
    if dispatch.available("triton"):
        assert dispatch.choose("cuda", "triton") == "triton"  # asked for by name, on the device it runs on
        assert dispatch.backend_class("triton").name == "triton"


@pytest.mark.parametrize("kind, name, message", [
    ("cpu", "triton", "--kernels triton runs on cuda, not on --device cpu"),
    ("cuda", "cpu", "--kernels cpu runs on cpu, not on --device cuda"),
    ("cpu", "fast", "unknown --kernels 'fast'; choose auto, reference, cpu, triton"),
])
def test_a_backend_the_device_cannot_run_is_one_clear_error(fresh, kind, name, message):
    from minerva.errors import MinervaError
    if name == "triton" and not dispatch.available("triton"):
        pytest.skip("Triton is not installed")
    with pytest.raises(MinervaError, match=message.replace("(", r"\(")):
        dispatch.choose(kind, name)
    assert kind not in dispatch._chosen


def test_a_backend_whose_package_is_missing_says_what_to_install(fresh, monkeypatch):
    from minerva.errors import MinervaError
    monkeypatch.setitem(dispatch.NEEDS, "triton", "no_such_package_here")
    with pytest.raises(MinervaError, match="--kernels triton needs the no_such_package_here package: pip install"):
        dispatch.choose("cuda", "triton")
    assert any(line.startswith("triton: not installed") for line in dispatch.describe())


def test_the_gpu_user_is_told_what_runs(fresh, monkeypatch):
    from minerva import cli
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    [note] = cli.device_notes(torch.device("cpu"), "cpu", asked=False)
    assert "a CUDA GPU is present" in note and "--device cuda" in note
    assert cli.device_notes(torch.device("cpu"), "cpu", asked=True) == []
    lines = cli.device_notes(torch.device("cuda"), "reference", asked=True)
    assert lines[0] == "device cuda: kernels reference, the plain-torch reference (dequantized weights, torch matmuls)"
    assert cli.device_notes(torch.device("cuda"), "triton", asked=True)[0].startswith(
        "device cuda: kernels triton, Minerva's Triton kernels, not yet checked on a GPU")
