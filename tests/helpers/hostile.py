"""Hostile model files: where a GGUF file keeps its lengths, counts and offsets, byte-level
mutations of them, and a worker that loads many files in one memory-capped subprocess.

The worker runs as `python -m tests.helpers.hostile <manifest.json>`: it caps its address
space (RLIMIT_AS), then calls `load_model` on each path of the manifest and prints one JSON
line per file: the outcome ("ok", "MinervaError" or the other exception's type), the message,
the seconds it took and how much the peak resident memory grew meanwhile.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf

# Address space for the worker: torch, tokenizers and a tiny model need ~0.7 GB of it (measured:
# VmPeak 0.67 GB after the imports); a loader that trusts a corrupt length needs many GB.
ADDRESS_SPACE = 2 << 30
ROOT = Path(__file__).resolve().parents[2]

M32, M64 = (1 << 32) - 1, (1 << 64) - 1
INTERESTING = [0, 1, 2, 3, 7, 8, 255, 1 << 16, (1 << 31) - 1, 1 << 31, M32, 1 << 32,
               (1 << 63) - 1, 1 << 63, M64]


@dataclass(frozen=True)
class Site:
    """One integer the file states: its byte offset, width (4 or 8) and meaning."""

    name: str
    offset: int
    width: int

    def value(self, data: bytes) -> int:
        return int.from_bytes(data[self.offset:self.offset + self.width], "little")


def _part_offsets(field) -> list[int]:
    offs, out = field.offset, []
    for part in field.parts:
        out.append(offs)
        offs += int(part.nbytes)
    return out


def sites(path: Path) -> dict[str, Site]:
    """Every length, count, type and offset of the file's header, metadata and tensor infos,
    found with the `gguf` package's stock reader; keys look like 'kv:<key>:alen'."""
    reader = gguf.GGUFReader(path, "r")
    out = {"version": Site("version", 4, 4), "tensor_count": Site("tensor_count", 8, 8),
           "kv_count": Site("kv_count", 16, 8)}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        offs = _part_offsets(field)
        named = {"klen": (offs[0], 8), "type": (offs[2], 4)}
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            named |= {"itype": (offs[3], 4), "alen": (offs[4], 8)}
            if field.types[-1] == gguf.GGUFValueType.STRING and len(offs) > 5:
                named["slen0"] = (offs[5], 8)
        elif kind == gguf.GGUFValueType.STRING:
            named["slen"] = (offs[3], 8)
        elif field.parts[3].nbytes in (4, 8):
            named["value"] = (offs[3], int(field.parts[3].nbytes))
        for what, (at, width) in named.items():
            out[f"kv:{key}:{what}"] = Site(f"kv:{key}:{what}", at, width)
    for t in reader.tensors:
        offs = _part_offsets(t.field)
        named = {"nlen": (offs[0], 8), "ndims": (offs[2], 4), "dim0": (offs[3], 8),
                 "type": (offs[4], 4), "offset": (offs[5], 8)}
        for what, (at, width) in named.items():
            out[f"t:{t.name}:{what}"] = Site(f"t:{t.name}:{what}", at, width)
    return out


def put(data: bytes, site: Site, value: int) -> bytes:
    """`data` with the integer at `site` replaced by `value` (truncated to the site's width)."""
    value &= (1 << (8 * site.width)) - 1
    return data[:site.offset] + value.to_bytes(site.width, "little") + data[site.offset + site.width:]


def retyped(src: Path, dst: Path, key: str, value, vtype: gguf.GGUFValueType,
            sub_type: gguf.GGUFValueType | None = None) -> Path:
    """A copy of the GGUF file `src` whose metadata `key` holds `value` as `vtype` instead:
    a well-formed file with a value of the wrong type."""
    reader = gguf.GGUFReader(src, "r")
    w = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    if key == "general.architecture":
        w.kv_data[0].pop(key)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", key):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    w.add_key_value(key, value, vtype, sub_type=sub_type)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def run_worker(manifest: list[str], tmp_path: Path, timeout: float = 240) -> dict[str, dict]:
    """Load every path of `manifest` in one capped subprocess; results by path."""
    listing = tmp_path / "manifest.json"
    listing.write_text(json.dumps(manifest))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.hostile", str(listing)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(manifest), proc.stderr[-3000:]
    return {r["path"]: r for r in results}


def _peak_rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _main(listing: str) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    import torch  # noqa: F401  (imported before the first measurement)

    from minerva.errors import MinervaError
    from minerva.models.loader import load_model

    for path in json.loads(Path(listing).read_text()):
        before, start = _peak_rss_kb(), time.perf_counter()
        try:
            load_model(path)
            outcome, message = "ok", ""
        except MinervaError as exc:
            outcome, message = "MinervaError", str(exc)
        except BaseException as exc:  # noqa: BLE001  (reported, and the test fails on it)
            outcome, message = type(exc).__name__, str(exc)[:500]
        print(json.dumps({"path": path, "outcome": outcome, "message": message,
                          "seconds": time.perf_counter() - start,
                          "rss_growth_mb": (_peak_rss_kb() - before) / 1024}), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])
