"""Models from the Hugging Face Hub: the real `huggingface_hub` client against a hub the tests
start on 127.0.0.1 (`HF_ENDPOINT`), serving repos made from the pulled models."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import subprocess
import sys
import time

import gguf
import httpx
import numpy as np
import pytest
import torch

from minerva import LLM, SamplingParams, hub
from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile
from minerva.store import list_models, model_names, pull, resolve
from tests.helpers import tiny_hf
from tests.helpers.cli import assert_clean_error, run
from tests.helpers.hf import hf_greedy
from tests.helpers.hubserver import Hub
from tests.helpers.server import free_port, is_up, wait_for

SMOL = "SmolLM2-135M-Instruct-Q4_1.gguf"


def split_copy(src, out_dir, max_tensors: int) -> list:
    """The GGUF file `src` written again as a split model (llama.cpp's `-0000N-of-0000M` parts,
    by the gguf package's writer), tensor bytes unchanged."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out_dir / "smol-Q4_1.gguf", r.fields["general.architecture"].contents(),
                        split_max_tensors=max_tensors)
    for key, field in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[1] if len(field.types) > 1
                            else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(out_dir.glob("smol-Q4_1-*-of-*.gguf"))


@pytest.fixture(scope="module")
def hub_server(tmp_path_factory, tiny):
    smol = pull("smollm2-135m", progress=False)
    parts = split_copy(smol, tmp_path_factory.mktemp("split"), max_tensors=100)
    hf_dir = tiny_hf.save(tmp_path_factory.mktemp("hf"), "llama-tied")
    with Hub() as server:
        server.add("test/SmolLM2-GGUF", {SMOL: smol, "smol-Q8_0.gguf": b"not fetched", "README.md": b"# SmolLM2",
                                         "mmproj-smol-F16.gguf": b"vision projector"})
        server.add("test/smol-split-GGUF", {p.name: p for p in parts})
        server.add("test/tiny-llama", {**{p.name: p for p in hf_dir.iterdir()},
                                       "pytorch_model.bin": b"a pickle", "onnx/model.onnx": b"onnx"})
        server.add("test/tiny-GGUF", {"tiny-Q8_0.gguf": tiny})
        server.add("test/gated-GGUF", {"tiny-Q8_0.gguf": tiny}, gated_token="hf_secret")
        server.add("test/corrupt-GGUF", {"tiny-Q8_0.gguf": tiny}, corrupt={"tiny-Q8_0.gguf"})
        server.add("test/pickles", {"config.json": b"{}", "pytorch_model.bin": b"a pickle"})
        server.hf_dir = hf_dir
        yield server


@pytest.fixture
def hf_env(hub_server, tmp_path, monkeypatch):
    """A fresh Hugging Face cache, the test hub as the endpoint, no token, online."""
    return hub_server.use(monkeypatch, tmp_path / "hf-cache")


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ names and files


@pytest.mark.parametrize("arg, want", [
    ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", ("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")),
    ("huggingface.co/Qwen/Qwen3-8B-GGUF", ("Qwen/Qwen3-8B-GGUF", None)),
    ("https://huggingface.co/google/gemma-3-270m", ("google/gemma-3-270m", None)),
    ("unsloth/gpt-oss-20b-GGUF:mxfp4", ("unsloth/gpt-oss-20b-GGUF", "mxfp4")),
    ("HF.CO/a/b", ("a/b", None)),
    ("smollm2-135m", None), ("model.gguf", None), ("dir/model.gguf", None), ("a/b/c", None), ("../x", None),
    ("/models/llama", None), ("./models/llama", None), ("~/models/llama", None),
])
def test_parse(arg, want):
    ref = hub.parse(arg)
    assert (ref and (ref.repo_id, ref.quant)) == want


@pytest.mark.parametrize("arg", ["hf.co/", "hf.co/justowner", "hf.co/a/b/c", "hf.co/a/b:bad quant"])
def test_parse_refuses_malformed_hub_names(arg):
    with pytest.raises(MinervaError, match="does not name a Hugging Face repo"):
        hub.parse(arg)


@pytest.mark.parametrize("arg, plain", [("t/m-GGUF@main", "t/m-GGUF"), ("t/m-GGUF:Q4_K_M@v1", "t/m-GGUF:Q4_K_M"),
                                        ("t/m-GGUF@v1:Q4_K_M", "t/m-GGUF:Q4_K_M"), ("hf.co/t/m@abc123", "hf.co/t/m")])
def test_a_revision_is_refused_naming_what_is_fetched(arg, plain):
    with pytest.raises(MinervaError, match=f"names a revision .* downloads a repo's main branch; write {plain} "
                                           r"\(no file or folder of that name exists here either\)$"):
        hub.parse(arg)
    with pytest.raises(MinervaError, match="names a revision"):
        resolve(arg)
    from minerva import cli
    assert cli._looks_like_model(arg)  # `minerva run OWNER/REPO@REV`: a model word (its error said), not a prompt
    assert hub.parse("dir/model@v1.gguf") is None  # a file name with an @ stays a path


def test_a_choice_among_alike_files_is_said(caplog):
    with caplog.at_level("WARNING", logger="minerva"):
        assert hub.pick_gguf(hub.RepoRef("t/dup"), ["bb-Q4_K_M.gguf", "a-Q4_K_M.gguf"]) == ["a-Q4_K_M.gguf"]
        assert hub.pick_gguf(hub.RepoRef("t/notag"), ["other.gguf", "model.gguf"]) == ["model.gguf"]
    assert caplog.messages == ["t/dup: a-Q4_K_M.gguf chosen; bb-Q4_K_M.gguf alike (name one as t/dup:FILENAME)",
                               "t/notag: model.gguf chosen; other.gguf alike (name one as t/notag:FILENAME)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="minerva"):
        hub.pick_gguf(hub.RepoRef("t/ok"), ["m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-F16.gguf"])
        hub.pick_gguf(hub.RepoRef("t/dup", "bb-Q4_K_M.gguf"), ["bb-Q4_K_M.gguf", "a-Q4_K_M.gguf"])  # asked for
    assert caplog.messages == []


def test_a_split_model_missing_a_part_is_named():
    files = ["README.md", "m-Q4_1-00001-of-00003.gguf", "m-Q4_1-00003-of-00003.gguf"]
    for quant in (None, "Q4_1", "q4_1"):
        with pytest.raises(MinervaError, match=r"'o/m' holds m-Q4_1 split in 3 parts and lacks "
                                               r"m-Q4_1-00002-of-00003.gguf; the model cannot load"):
            hub.pick_files(hub.RepoRef("o/m", quant), files)
    assert hub.pick_files(hub.RepoRef("o/m"), files + ["m-Q8_0.gguf"]) == ["m-Q8_0.gguf"]  # a whole one first
    weights = ["config.json", "model.safetensors", "tokenizer.json"]  # and a SafeTensors model before a broken split
    assert sorted(hub.pick_files(hub.RepoRef("o/m"), files + weights)) == weights


@pytest.mark.parametrize("arg", ["OWNER/REPO:", "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:"])
def test_an_empty_quant_tag_is_refused(arg):  # it meant the default file
    with pytest.raises(MinervaError, match="without a quantization"):
        hub.parse(arg)


@pytest.mark.parametrize("name, tag", [
    ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Q4_K_M"), ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
    ("gemma-3-270m-q4_k_m.gguf", "Q4_K_M"), ("gpt-oss-20b-mxfp4.gguf", "MXFP4"), ("model-UD-Q4_K_XL.gguf", "Q4_K_XL"),
    ("Qwen3-8B-IQ4_XS.gguf", "IQ4_XS"), ("Qwen3-8B-BF16-00001-of-00002.gguf", "BF16"),
    ("Q8_0/Qwen3-235B-Q8_0-00001-of-00006.gguf", "Q8_0"), ("Q5_K_M/model-00001-of-00002.gguf", "Q5_K_M"),
    ("Phi-3-mini-4k-instruct-fp16.gguf", "F16"), ("Phi-3-mini-4k-instruct-q4.gguf", "Q4"),
    ("Meta-Llama-3-8B-Instruct-Q4_K_M_imat.gguf", "Q4_K_M"), ("Llama-3.2-3B-Instruct-Q6_K_L.gguf", "Q6_K_L"),
    ("model-Q4_0_4_8.gguf", "Q4_0_4_8"), ("model.gguf", None), ("Qwen2.5-7B.gguf", None),
])
def test_quant_tag(name, tag):
    assert hub.quant_tag(name) == tag


def test_pick_gguf():
    files = ["README.md", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-Q4_0.gguf", "mmproj-m-F16.gguf",
             "m-BF16-00001-of-00002.gguf", "m-BF16-00002-of-00002.gguf", "m-F32-00001-of-00002.gguf"]
    assert hub.pick_gguf(hub.RepoRef("o/m"), files) == ["m-Q4_K_M.gguf"]  # the default
    assert hub.pick_gguf(hub.RepoRef("o/m", "q8_0"), files) == ["m-Q8_0.gguf"]  # any case
    assert hub.pick_gguf(hub.RepoRef("o/m", "BF16"), files) == ["m-BF16-00001-of-00002.gguf",
                                                                "m-BF16-00002-of-00002.gguf"]
    # without Q4_K_M, the next preferred; the vision projector and the incomplete split never
    assert hub.pick_gguf(hub.RepoRef("o/m"), files[:2] + files[3:]) == ["m-Q4_0.gguf"]
    with pytest.raises(MinervaError, match=r"no Q2_K file; its quants: BF16, Q4_0, Q4_K_M, Q8_0; name one as o/m:QUANT"):
        hub.pick_gguf(hub.RepoRef("o/m", "Q2_K"), files)
    with pytest.raises(MinervaError, match=r"holds m-F32 split in 2 parts and lacks m-F32-00002-of-00002.gguf"):
        hub.pick_gguf(hub.RepoRef("o/m", "F32"), files)
    assert hub.pick_gguf(hub.RepoRef("o/m"), ["model.gguf", "README.md"]) == ["model.gguf"]
    phi = ["Phi-3-mini-4k-instruct-fp16.gguf", "Phi-3-mini-4k-instruct-q4.gguf"]
    assert hub.pick_gguf(hub.RepoRef("o/m"), phi) == [phi[1]]  # 4 bits before 16
    assert hub.pick_gguf(hub.RepoRef("o/m", "fp16"), phi) == hub.pick_gguf(hub.RepoRef("o/m", "F16"), phi) == [phi[0]]
    assert hub.pick_gguf(hub.RepoRef("o/m", "model.gguf"), ["sub/model.gguf", "x.gguf"]) == ["sub/model.gguf"]
    upper = ["M-Q8_0-00001-of-00002.GGUF", "M-Q8_0-00002-of-00002.GGUF"]
    assert hub.pick_gguf(hub.RepoRef("o/m"), upper) == upper


def test_pick_safetensors_files():
    files = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "chat_template.jinja", "consolidated.safetensors", "pytorch_model.bin",
             "original/params.json", "README.md"]
    assert sorted(hub.pick_files(hub.RepoRef("o/m"), files)) == sorted(files[:8])
    with pytest.raises(MinervaError, match=r"no GGUF file and no config.json with .safetensors weights .*pickled"):
        hub.pick_files(hub.RepoRef("o/m"), ["config.json", "pytorch_model.bin"])


# ------------------------------------------------------------------ against the hub


def test_gguf_repo_loads_by_name(hf_env, smollm2_gguf):
    path = resolve("hf.co/test/SmolLM2-GGUF")  # no quant: the preferred one there, Q4_1
    assert path.name == SMOL and path.is_relative_to(hub.cache_dir())
    assert sha256(path) == sha256(smollm2_gguf)
    fetched = {p.rsplit("/", 1)[-1] for m, p, _ in hf_env.log if m == "GET" and "/resolve/" in p}
    assert fetched == {SMOL}  # only the chosen file: not the other quant, the projector or the README
    hf_env.log.clear()
    assert resolve("test/SmolLM2-GGUF:q4_1") == path  # cached: one listing, no download
    assert not hf_env.downloads(SMOL)


def test_split_gguf_repo_loads_as_one_model(hf_env, smollm2_gguf):
    path = resolve("test/smol-split-GGUF:Q4_1")
    assert path.name == "smol-Q4_1-00001-of-00003.gguf"
    assert sorted(p.name for p in path.parent.iterdir()) == [f"smol-Q4_1-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    whole, split = GGUFFile(smollm2_gguf), GGUFFile(path)
    assert len(split.paths) == 3 and whole.tensors.keys() == split.tensors.keys()
    for name, t in whole.tensors.items():
        assert split.tensors[name].qtype == t.qtype and np.array_equal(split.tensors[name].read(), t.read())
    params = SamplingParams(max_tokens=8, temperature=0)
    ids = [LLM(str(p), dtype="float32", activations="float").generate(["The capital of France is"], params,
                                                                      use_tqdm=False)[0].outputs[0].token_ids
           for p in (smollm2_gguf, path)]
    assert ids[0] == ids[1]


def test_split_gguf_errors(tmp_path, smollm2_gguf):
    parts = split_copy(smollm2_gguf, tmp_path, max_tensors=100)
    with pytest.raises(MinervaError, match="is part 2 of 3 of a split model; give its first part, 'smol-Q4_1-00001"):
        GGUFFile(parts[1])
    parts[2].unlink()
    with pytest.raises(MinervaError, match="part 3, .* is missing"):
        GGUFFile(parts[0])


def test_safetensors_repo(hf_env):
    path = resolve("test/tiny-llama")
    assert path.is_dir() and path.is_relative_to(hub.cache_dir())
    assert sorted(p.name for p in path.iterdir()) == sorted(
        p.name for p in hf_env.hf_dir.iterdir())  # no pickle, no onnx folder
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(hf_env.hf_dir, dtype=torch.float32).eval()
    prompt = [5, 80, 17, 200, 33]
    got = LLM("test/tiny-llama", dtype="float32", activations="float").generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert list(got[0].outputs[0].token_ids) == hf_greedy(reference, prompt, 6)


def test_offline_loads_from_the_cache(hf_env, monkeypatch):
    path = resolve("test/SmolLM2-GGUF")
    hf_env.log.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve("hf.co/test/SmolLM2-GGUF:Q4_1") == path
    assert hf_env.log == []
    with pytest.raises(MinervaError, match="'test/tiny-llama' is not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        resolve("test/tiny-llama")
    with pytest.raises(MinervaError, match="'test/SmolLM2-GGUF' in the Hugging Face cache has no Q8_0 file; its quants: Q4_1; .* HF_HUB_OFFLINE"):
        resolve("test/SmolLM2-GGUF:Q8_0")


def test_unreachable_hub_falls_back_to_the_cache(hf_env, monkeypatch):
    path = resolve("test/SmolLM2-GGUF")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    assert resolve("test/SmolLM2-GGUF") == path
    with pytest.raises(MinervaError, match=f"not in the Hugging Face cache .* the Hub at {dead} cannot be reached"):
        resolve("test/tiny-llama")


def test_dropped_connection_resumes(hf_env):
    hf_env.cut["test/SmolLM2-GGUF/" + SMOL] = 30_000_000
    path = resolve("test/SmolLM2-GGUF")
    first, again = hf_env.downloads(SMOL)
    assert first is None and 0 < int(again.removeprefix("bytes=").rstrip("-")) <= 30_000_000  # the rest only
    assert sha256(path) == sha256(pull("smollm2-135m", progress=False))


def test_checksum_mismatch_deletes_the_download(hf_env, tiny):
    with pytest.raises(MinervaError, match=r"tiny-Q8_0.gguf has sha256 \w+, but the Hub lists \w+; "
                                           "the file was corrupted and is deleted"):
        resolve("test/corrupt-GGUF")
    assert not list((hub.repo_folder("test/corrupt-GGUF") / "blobs").iterdir())
    hf_env.repos["test/corrupt-GGUF"].corrupt.clear()
    try:
        assert sha256(resolve("test/corrupt-GGUF")) == sha256(tiny)  # the next try downloads it again
    finally:
        hf_env.repos["test/corrupt-GGUF"].corrupt.add("tiny-Q8_0.gguf")


def test_verify_rechecks_cached_files(hf_env, smollm2_gguf, caplog):
    path = resolve("test/SmolLM2-GGUF")
    blob = path.resolve()
    data = bytearray(blob.read_bytes())
    data[1000] ^= 0xFF  # the cached file damaged on disk, its size the same
    blob.write_bytes(bytes(data))
    hf_env.log.clear()
    assert resolve("test/SmolLM2-GGUF") == path  # trusted as cached
    assert hf_env.downloads(SMOL) == []
    with caplog.at_level(logging.WARNING, logger="minerva"):
        assert pull("test/SmolLM2-GGUF", verify=True) == path  # found, said, and downloaded again at once
    assert re.search(r"the cached \S+ has sha256 \w+, but the Hub lists \w+; it was damaged on disk and is "
                     "downloaded again", caplog.text)
    assert hf_env.downloads(SMOL) == [None] and sha256(path) == sha256(smollm2_gguf)


def test_cached_file_cut_short_is_downloaded_again(hf_env, smollm2_gguf, caplog):
    """A cached file of another size than the Hub lists is replaced by a plain pull (no re-hash)."""
    path = resolve("test/SmolLM2-GGUF")
    blob = path.resolve()
    with open(blob, "r+b") as f:
        f.truncate(blob.stat().st_size // 2)
    hf_env.log.clear()
    with caplog.at_level(logging.WARNING, logger="minerva"):
        assert resolve("test/SmolLM2-GGUF") == path
    assert re.search(rf"the cached {re.escape(SMOL)} is \d+ bytes, but the Hub lists \d+; downloading it again",
                     caplog.text)
    assert hf_env.downloads(SMOL) == [None] and sha256(path) == sha256(smollm2_gguf)


def test_damaged_cached_file_that_cannot_be_deleted(hf_env, monkeypatch):
    path = resolve("test/SmolLM2-GGUF")
    with open(path.resolve(), "r+b") as f:
        f.truncate(4096)

    def refuse(_path):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(hub, "_delete", refuse)
    with pytest.raises(MinervaError, match=rf"the cached {re.escape(SMOL)} is damaged and cannot be deleted from the "
                                           r"Hugging Face cache \(.*: Permission denied\); delete it, or set HF_HOME"):
        resolve("test/SmolLM2-GGUF")


def test_damaged_cached_gguf_names_the_pull_that_mends_it(hf_env, monkeypatch):
    path = resolve("test/SmolLM2-GGUF")
    with open(path.resolve(), "r+b") as f:
        f.truncate(4096)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # from the cache as it is
    r = run("generate", "test/SmolLM2-GGUF", "Hello", "-n", "2")
    assert_clean_error(r, f"run `minerva pull test/SmolLM2-GGUF:{SMOL} --verify` to download it again")


def test_plain_git_files_are_checked_by_their_blob_id(hf_env):
    repo = hf_env.repos["test/tiny-llama"]
    repo.plain.add("config.json")
    repo.corrupt.add("config.json")
    try:
        with pytest.raises(MinervaError, match=r"config.json has git blob id \w+, but the Hub lists \w+"):
            resolve("test/tiny-llama")
        repo.corrupt.clear()
        assert (resolve("test/tiny-llama") / "config.json").read_bytes() == (hf_env.hf_dir / "config.json").read_bytes()
    finally:
        repo.plain.clear()
        repo.corrupt.clear()


def test_hub_outage_falls_back_to_the_cache(hf_env):
    path = resolve("test/SmolLM2-GGUF")
    hf_env.status = 503
    try:
        assert resolve("test/SmolLM2-GGUF") == path
        with pytest.raises(MinervaError, match="'test/tiny-llama' is not in the Hugging Face cache .* cannot be reached"):
            resolve("test/tiny-llama")
    finally:
        hf_env.status = None


def test_stalled_hub_times_out_to_the_cache(hf_env, monkeypatch):
    path = resolve("test/SmolLM2-GGUF")
    with socket.socket() as stalled:  # accepts connections (the kernel's backlog) and never answers
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(8)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{stalled.getsockname()[1]}")
        monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
        assert resolve("test/SmolLM2-GGUF") == path


def test_quants_from_several_commits(hf_env, monkeypatch):
    """A quant cached at an older commit still loads offline, is listed and removable."""
    repo = hf_env.repos["test/SmolLM2-GGUF"]
    q4 = resolve("test/SmolLM2-GGUF:Q4_1")
    repo.put("README.md", b"# SmolLM2, edited")
    try:
        q8 = resolve("test/SmolLM2-GGUF:Q8_0")
        assert q8.parent != q4.parent  # another snapshot
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert resolve("test/SmolLM2-GGUF:Q4_1") == q4 and resolve("test/SmolLM2-GGUF:q8_0") == q8
        names = {name for name, _, _ in hub.cached_models()}
        assert {"test/SmolLM2-GGUF:Q4_1", "test/SmolLM2-GGUF:Q8_0"} <= names
        hub.remove(hub.RepoRef("test/SmolLM2-GGUF", "Q4_1"))
        assert not q4.exists() and q8.exists()
        with pytest.raises(MinervaError, match=r"has no Q4_1 file \(cached: Q8_0\)"):
            hub.remove(hub.RepoRef("test/SmolLM2-GGUF", "Q4_1"))
        assert hub.repo_folder("test/SmolLM2-GGUF").is_dir()
        hub.remove(hub.RepoRef("test/SmolLM2-GGUF", "Q8_0"))  # the last quant: the repo's folders go too
        assert not hub.repo_folder("test/SmolLM2-GGUF").exists()
    finally:
        repo.put("README.md", b"# SmolLM2")


def test_remove_odd_cache_states(hf_env):
    folder = hub.repo_folder("test/half-written")
    folder.mkdir(parents=True)  # a repo folder without snapshots
    with pytest.raises(MinervaError, match="the cached 'test/half-written' has no Q4_K_M file"):
        hub.remove(hub.RepoRef("test/half-written", "Q4_K_M"))
    snap = folder / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "m-Q4_K_M.gguf").symlink_to(folder / "blobs" / "gone")  # a dangling link
    assert hub.cached_models() == []  # listed as nothing, not a traceback
    assert hub.remove(hub.RepoRef("test/half-written")) == folder and not folder.exists()


def test_gated_repo_needs_a_token(hf_env, monkeypatch, tiny):
    with pytest.raises(MinervaError, match="'test/gated-GGUF' is a gated repo: accept its conditions at .* set HF_TOKEN"):
        resolve("test/gated-GGUF")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert sha256(resolve("test/gated-GGUF")) == sha256(tiny)


def test_missing_repo_quant_and_pickles(hf_env):
    with pytest.raises(MinervaError, match=r"no model repo 'test/nothing-here' on http://127\.0\.0\.1:\d+"):
        resolve("test/nothing-here")
    with pytest.raises(MinervaError, match="'test/SmolLM2-GGUF' has no Q5_K_M file; its quants: Q4_1, Q8_0"):
        resolve("test/SmolLM2-GGUF:Q5_K_M")
    with pytest.raises(MinervaError, match="holds no GGUF file .*pickled weights are never loaded"):
        resolve("test/pickles")
    with pytest.raises(MinervaError, match="not downloaded here; run `minerva pull test/SmolLM2-GGUF`"):
        resolve("test/SmolLM2-GGUF", auto_pull=False)


# ------------------------------------------------------------------ the commands


def test_commands_on_hub_models(hf_env, tmp_path):
    # the subprocesses inherit hf_env's HF_ENDPOINT and HF_HUB_CACHE
    r = run("pull", "hf.co/test/SmolLM2-GGUF:Q4_1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith(SMOL)
    r = run("pull", "test/tiny-llama")
    assert r.returncode == 0, r.stderr
    r = run("generate", "hf.co/test/SmolLM2-GGUF:Q4_1", "Hello", "-n", "4")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    r = run("list")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[1:]}
    assert rows["test/SmolLM2-GGUF:Q4_1"][1:4] == ["llama", "Q4_1", "instruct"]
    assert rows["test/tiny-llama"][1] == "llama"
    r = run("show", "test/SmolLM2-GGUF:Q4_1")
    assert r.returncode == 0 and "architecture    llama" in r.stdout, r.stderr
    r = run("rm", "test/SmolLM2-GGUF:Q4_1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("removed test/SmolLM2-GGUF:Q4_1 (") and f"{SMOL})" in r.stdout  # the file, not the repo
    assert not (tmp_path / "hf-cache" / "models--test--SmolLM2-GGUF").exists()  # its last file: no empty folders
    r = run("rm", "test/none-here", "test/tiny-llama")  # a name that cannot go does not stop the others
    assert r.returncode == 1 and "'test/none-here' is not in the Hugging Face cache" in r.stderr
    assert "removed test/tiny-llama" in r.stdout and "Traceback" not in r.stderr
    assert not [p.name for p in (tmp_path / "hf-cache").iterdir() if p.name.startswith("models--")]
    r = run("rm", "test/tiny-llama")
    assert_clean_error(r, "'test/tiny-llama' is not in the Hugging Face cache")
    r = run("generate", "hf.co/test/none", "Hello")
    assert_clean_error(r, "no model repo 'test/none'")


def test_list_shows_cached_models(hf_env):
    resolve("test/SmolLM2-GGUF")
    entries = {e.name: e for e in list_models()}
    e = entries["test/SmolLM2-GGUF:Q4_1"]
    assert (e.architecture, e.quantization, e.instruct) == ("llama", "Q4_1", True)
    assert e.size == e.path.stat().st_size


def test_serve_a_hub_model(hf_env):
    """`minerva serve hf.co/...` downloads the model, serves it under the name it was given."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minerva", "serve", "hf.co/test/tiny-GGUF:Q8_0", "--port", str(port),
                             "--kv-cache-memory", "4e6"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: is_up(url), timeout=120, what="minerva serve to start")
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["hf.co/test/tiny-GGUF:Q8_0"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "hf.co/test/tiny-GGUF:Q8_0", "prompt": "ab",
                                                       "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    finally:
        proc.terminate()
        proc.wait(30)
    assert hf_env.downloads("tiny-Q8_0.gguf") == [None]


def test_which_words_are_models(tmp_path, monkeypatch):
    from minerva.cli import _looks_like_model
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "wiki.txt").write_text("text to score")
    assert not _looks_like_model("data/wiki.txt")  # an existing file that is not a model
    assert _looks_like_model("hf.co/a/b") and _looks_like_model("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")
    assert not _looks_like_model("why a/b?") and not _looks_like_model("/models/llama")
    assert not _looks_like_model("meta-llama/Llama-3.1-8B", bare_repos=False)  # a served model name


def test_lora_adapter_repo(hf_env, tmp_path):
    """An adapter repo: only its two files fetched, served on the repo's base model as PEFT's merged model answers."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.lora import greedy, make_adapter
    base = AutoModelForCausalLM.from_pretrained(hf_env.hf_dir, dtype=torch.float32).eval()
    merged = make_adapter(base, tmp_path / "adapter", 5, ["q_proj", "down_proj"])
    hf_env.add("test/tiny-lora", {**{p.name: p for p in (tmp_path / "adapter").iterdir()}, "README.md": b"# lora"})
    prompt = [5, 80, 17, 200, 33]
    llm = LLM("test/tiny-llama", dtype="float32", activations="float", lora={"l": "test/tiny-lora"})
    assert sorted(p.name for p in llm.adapter_paths["l"].iterdir()) == ["adapter_config.json",
                                                                         "adapter_model.safetensors"]
    got = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, adapter="l"),
                       use_tqdm=False)
    assert list(got[0].token_ids) == greedy(merged, prompt, 6) != greedy(base, prompt, 6)
    with pytest.raises(MinervaError, match="the LoRA adapter 'nothing-here' is neither a directory nor"):
        LLM("test/tiny-llama", dtype="float32", lora={"x": "nothing-here"})
    # listed as what it is, and refused as a model with the way to use it
    entry = next(e for e in list_models() if e.name == "test/tiny-lora")
    assert (entry.architecture, entry.quantization) == ("adapter", "LoRA")
    assert "test/tiny-llama" in model_names() and "test/tiny-lora" not in model_names()  # (serve --allow-pull's)
    with pytest.raises(MinervaError, match=r"is a LoRA adapter, not a model: serve it on its base model with --lora"):
        LLM("test/tiny-lora")


def test_a_model_repo_given_as_an_adapter_is_refused_before_downloading(hf_env):
    from minerva.store import adapter_path
    with pytest.raises(MinervaError, match=r"'test/SmolLM2-GGUF' is not a LoRA adapter: it lacks "
                                           r"adapter_config.json and adapter_model.safetensors \(README.md, "):
        adapter_path("test/SmolLM2-GGUF")
    assert hf_env.downloads(SMOL) == []
    hf_env.add("test/pickled-lora", {"adapter_config.json": b"{}", "adapter_model.bin": b"a pickle"})
    with pytest.raises(MinervaError, match=r"holds its LoRA weights as a pickle \(adapter_model.bin\), which is never"):
        adapter_path("test/pickled-lora")
    assert hf_env.downloads("adapter_model.bin") == []


def test_a_cache_that_cannot_be_written_says_so(hf_env, monkeypatch, tmp_path):
    """A cache under a file (or full, or read-only) names the cache and HF_HOME, not 'run again'."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HF_HUB_CACHE", str(blocker / "hub"))
    with pytest.raises(MinervaError) as e:
        resolve("test/tiny-GGUF")
    message = str(e.value)
    assert f"into the Hugging Face cache ({blocker / 'hub'})" in message and "or set HF_HUB_CACHE to a writable" in message
    assert "run the command again" not in message


def test_a_cache_short_of_room_is_said_before_the_download(hf_env, monkeypatch, caplog):
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with caplog.at_level("WARNING", logger="minerva"):
        resolve("test/tiny-GGUF")  # (the file is larger than the 1000 bytes said free: a line, and it still downloads)
    assert any("tiny-Q8_0.gguf takes 0.00 GB and the Hugging Face cache" in m and "0.00 GB free" in m
               for m in caplog.messages)


def test_a_pull_drops_what_interrupted_ones_left(hf_env):
    """Partial files of a blob that earlier, killed downloads left are gone once it is complete."""
    path = resolve("test/tiny-GGUF")  # the blob's name, then a second try of it from scratch
    blob = path.resolve()
    stale = [blob.with_name(blob.name + ".d7c5723c.incomplete"), blob.with_name(blob.name + ".incomplete")]
    for p in stale:
        p.write_bytes(b"partial")
        os.utime(p, (time.time() - 7200, time.time() - 7200))  # untouched for two hours
    lately = blob.with_name(blob.name + ".0b1c2d3e.incomplete")  # perhaps another process's, under way
    lately.write_bytes(b"partial")
    blob.unlink()
    path.unlink()
    assert resolve("test/tiny-GGUF") == path and path.is_file()
    assert not any(p.exists() for p in stale) and lately.exists()
