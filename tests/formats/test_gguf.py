"""GGUF parsing against the `gguf` package's stock reader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile


def stock_metadata(path) -> dict:
    reader = gguf.GGUFReader(path, "r")
    return {k: f.contents() for k, f in reader.fields.items()}


def write_varied(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("test.ints", [1, -2, 3, 2**31 - 1])
    w.add_array("test.floats", [0.5, -1.25, 3.0e8])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.strings", ["", "a", "héllo wörld", "🤗 emoji", "x" * 1000])
    w.add_string("test.string", "plain")
    w.add_uint32("test.u32", 7)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.flag", True)
    w.add_tensor("t.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_equals_stock_reader_on_varied_fields(tmp_path):
    path = write_varied(tmp_path / "varied.gguf")
    ours = GGUFFile(path)
    assert ours.metadata == stock_metadata(path)
    assert ours.metadata["test.strings"][2] == "héllo wörld"
    t = ours.tensors["t.weight"]
    assert t.shape == (3, 4) and t.qtype == gguf.GGMLQuantizationType.F32
    assert t.read().view(torch.float32).flatten().tolist() == list(range(12))  # what the loader reads


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2_gguf", "gemma3_gguf"])
def test_metadata_and_tensors_equal_stock_reader_on_real_files(request, model):
    path = request.getfixturevalue(model)
    ours = GGUFFile(path)
    stock = gguf.GGUFReader(path, "r")
    assert ours.metadata == {k: f.contents() for k, f in stock.fields.items()}
    assert len(ours.tensors) == len(stock.tensors)
    for t in stock.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype == t.tensor_type
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert np.array_equal(mine.data.reshape(-1), t.data.view(np.uint8).reshape(-1))


def test_missing_and_garbage_files(tmp_path):
    with pytest.raises(MinervaError, match="does not exist"):
        GGUFFile(tmp_path / "none.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(MinervaError, match="bad.gguf"):
        GGUFFile(bad)
