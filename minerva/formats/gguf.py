"""GGUF files, read through the `gguf` package's memory-mapped reader.

Opening a file reads only its header and maps the rest: a tensor's packed bytes are a
uint8 view of the mapping (`GGUFTensor.data`). The model loader takes a private copy of
each tensor read without the mapping (`GGUFTensor.read`), so the process does not hold
the file's pages next to its copy.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from minerva.errors import MinervaError, not_a_file


# Bounds on what a header may claim, far above any released file (a few hundred metadata
# entries, a few thousand tensors, ~450k merges in the largest vocabularies). Every length,
# count and offset is also checked against the bytes the file has, before anything is
# allocated or looped over: a corrupt length must fail in milliseconds, not eat gigabytes.
_MAX_KVS = 1 << 16
_MAX_TENSORS = 1 << 20
_MAX_ARRAY = 1 << 21  # entries of one metadata array
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays (llama.cpp reads none; the stock reader recurses per level)
# The fewest bytes one entry can take: a metadata entry (key length, type, one byte of
# value), a tensor info (name length, dim count, type, offset), a string or array element
# (its length; its item type and length); a number takes its itemsize.
_KV_BYTES, _TENSOR_INFO_BYTES = 13, 24
_ITEM_BYTES = {gguf.GGUFValueType.STRING: 8, gguf.GGUFValueType.ARRAY: 12}


class _Corrupt(ValueError):
    """A header value the file cannot hold; the message says which and why."""


def _value_type(raw: int) -> gguf.GGUFValueType:
    if int(raw) not in gguf.GGUFValueType._value2member_map_:
        raise _Corrupt(f"unknown value type {int(raw)}")
    return gguf.GGUFValueType(int(raw))


def _power_of_two(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


class _Reader(gguf.GGUFReader):
    """The `gguf` package's reader, with array fields parsed in one pass and every size
    the file claims checked against the bytes it has.

    The stock reader recurses once per array element, which costs ~9 s and ~700 MB
    for a 262k-token vocabulary. Here a numeric array becomes one numpy view and a
    string array a list of memoryview slices: the same `ReaderField` structure (the
    tests compare every field with the stock reader), built ~30x faster. The stock
    reader also trusts lengths: a read past the end silently comes back short, and an
    array length of 2**64-1 loops until memory runs out; here both raise `_Corrupt`.
    """

    _depth = 0  # of arrays within arrays being read

    def _get(self, offset, dtype, count=1, override_order=None):
        count, offset, size = int(count), int(offset), len(self.data)
        if count < 0 or offset < 0 or offset + np.dtype(dtype).itemsize * count > size:
            raise _Corrupt(f"{count} x {np.dtype(dtype).name} at byte {offset} would run past "
                           f"the end of the file ({size} bytes)")
        return super()._get(offset, dtype, count, override_order)

    def _count(self, count, what: str, offs: int, least: int, cap: int) -> int:
        n, left = int(count), max(len(self.data) - offs, 0)
        if n > min(cap, left // least):
            raise _Corrupt(f"{n} {what} claimed, but the {left} bytes left in the file "
                           f"hold at most {min(cap, left // least)}")
        return n

    def _build_fields(self, offs: int, count: int) -> int:
        for i in range(self._count(count, "metadata entries", offs, _KV_BYTES, _MAX_KVS)):
            orig_offs, where = offs, f"metadata entry {i} (byte {offs})"
            try:
                klen, kdata = self._get_str(offs)
                where = f"metadata key {bytes(kdata)[:80]!r}"
                key = str(bytes(kdata), encoding="utf-8")
                where = f"metadata '{key}'"
                if key in self.fields:
                    raise _Corrupt("appears twice")
                offs += int(klen.nbytes + kdata.nbytes)
                raw_type = self._get(offs, np.uint32)
                offs += int(raw_type.nbytes)
                size, parts, idxs, types = self._get_field_parts(offs, int(_value_type(raw_type[0])))
            except (_Corrupt, UnicodeDecodeError) as exc:
                raise _Corrupt(f"{where}: {exc}") from None
            self._push_field(gguf.ReaderField(orig_offs, key, [klen, kdata, raw_type, *parts],
                                              [j + 3 for j in idxs], types), skip_sum=True)
            offs += size
        align = self.fields.get("general.alignment")  # checked here to name it; the stock reader raises
        if align is not None and (align.types != [gguf.GGUFValueType.UINT32]
                                  or not _power_of_two(align.contents())):
            raise _Corrupt(f"general.alignment = {align.contents()!r} should be a power of two (UINT32)")
        return offs

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        sub = _value_type(itype[0])
        n, offs = int(alen[0]), orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(sub)
        least = _ITEM_BYTES.get(sub) or np.dtype(nptype).itemsize
        self._count(n, f"entries in a {sub.name} array", offs, least, _MAX_ARRAY)
        if sub == gguf.GGUFValueType.ARRAY:
            return self._nested_array(orig_offs, raw_type)
        if self.byte_order != "I":  # rare and small
            return super()._get_field_parts(orig_offs, raw_type)
        types = [gguf.GGUFValueType.ARRAY, sub]
        if nptype is not None:
            values = self._get(offs, nptype, n)
            return 12 + int(values.nbytes), [itype, alen, values], [2], types
        return self._string_array(orig_offs, itype, alen, types)

    def _nested_array(self, orig_offs: int, raw_type: int):
        """Arrays of arrays go through the stock reader, which recurses once per level."""
        self._depth += 1
        try:
            if self._depth > _MAX_NESTING:
                raise _Corrupt(f"arrays nested more than {_MAX_NESTING} deep")
            return super()._get_field_parts(orig_offs, raw_type)
        finally:
            self._depth -= 1

    def _string_array(self, orig_offs: int, itype, alen, types):
        mv, size = memoryview(self.data), len(self.data)
        n, offs = int(alen[0]), orig_offs + 12
        parts: list = [itype, alen]
        idxs = []
        for i in range(n):
            length = int.from_bytes(mv[offs:offs + 8], "little")
            if offs + 8 + length > size:
                raise _Corrupt(f"string {i} of {n} (byte {offs}) claims {length} bytes, past the end "
                               f"of the file ({size} bytes)")
            parts += (mv[offs:offs + 8], mv[offs + 8:offs + 8 + length])
            idxs.append(len(parts) - 1)
            offs += 8 + length
        return offs - orig_offs, parts, idxs, types

    def _build_tensor_info(self, offs: int, count: int):
        fields = []
        for i in range(self._count(count, "tensors", offs, _TENSOR_INFO_BYTES, _MAX_TENSORS)):
            try:
                field = self._get_tensor_info_field(offs)
            except (_Corrupt, UnicodeDecodeError) as exc:
                raise _Corrupt(f"tensor info {i} (byte {offs}): {exc}") from None
            offs += sum(int(part.nbytes) for part in field.parts)
            fields.append(field)
        return offs, fields

    def _build_tensors(self, start_offs: int, fields) -> None:
        size, spans = len(self.data), []
        if fields and start_offs > size:
            raise _Corrupt(f"tensor data would start at byte {start_offs} (alignment {self.alignment}), "
                           f"past the end of the file ({size} bytes)")
        for i, field in enumerate(fields):
            start, end = self._tensor_span(start_offs, field, size)
            spans.append((start, end, field.name, i))
        spans.sort()
        for (_, end, a, _), (start, _, b, _) in zip(spans, spans[1:]):
            if start < end:
                raise _Corrupt(f"the data of tensors '{a}' and '{b}' overlap")
        self._check_tiling(start_offs, spans, fields, size)
        super()._build_tensors(start_offs, fields)

    def _check_tiling(self, start_offs: int, spans: list, fields, size: int) -> None:
        """The tensors' data fill the data section, each padded to the alignment, as llama.cpp
        writes and requires them: more bytes before the next tensor (or the end of the file)
        mean a tensor's type and dims claim fewer bytes than the file holds for it, as when an
        F32 norm is relabelled F16 and would be read as half its bytes, all garbage."""
        if spans and spans[0][0] != start_offs:
            raise _Corrupt(f"the tensor data starts at byte {start_offs}, but its first tensor "
                           f"'{spans[0][2]}' at byte {spans[0][0]}")
        for (start, end, name, i), following in zip(spans, [s[0] for s in spans[1:]] + [size]):
            if following > end + -(end - start_offs) % self.alignment:
                _, _, _, dims, raw_type, _ = fields[i].parts
                qtype = gguf.GGMLQuantizationType(int(raw_type[0])).name
                last = "; or bytes were added after the tensor data" if following == size else ""
                raise _Corrupt(f"tensor '{name}' of type {qtype} and dims {[int(d) for d in dims]} takes "
                               f"{end - start} bytes, but the file holds {following - start} for it (allowed: "
                               f"what its type and dims take, padded to the alignment of {self.alignment}); "
                               f"its type or dims are wrong{last}")

    def _tensor_span(self, start_offs: int, field, size: int) -> tuple[int, int]:
        """Where a tensor's bytes lie, once its dims, type and offset are known to be sane."""
        _, _, n_dims, dims, raw_type, rel = field.parts
        dims, rel, name = [int(d) for d in dims], int(rel[0]), f"tensor '{field.name}'"
        if not 1 <= int(n_dims[0]) <= _MAX_DIMS or min(dims) < 1:
            raise _Corrupt(f"{name} has dims {dims}; a tensor has 1 to {_MAX_DIMS} dims, each at least 1")
        if int(raw_type[0]) not in gguf.GGMLQuantizationType._value2member_map_:
            raise _Corrupt(f"{name} has unknown type {int(raw_type[0])}")
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
        if dims[0] % block:
            raise _Corrupt(f"{name} has rows of {dims[0]} values, not a multiple of its block of {block}")
        nbytes = math.prod(dims) // block * type_size
        start = start_offs + rel
        if rel % self.alignment or start + nbytes > size:
            raise _Corrupt(f"{name} claims bytes {start}..{start + nbytes} of a {size}-byte file "
                           f"(alignment {self.alignment})")
        return start, start + nbytes


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its type, logical shape and packed bytes."""

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: outermost first, innermost (contiguous) last
    data: np.ndarray  # packed bytes, uint8, one row per leading index (a view of the mapped file)
    path: Path
    offset: int  # of the bytes in the file

    def raw(self) -> torch.Tensor:
        """The packed bytes as a uint8 tensor that shares memory with the file."""
        return torch.from_numpy(self.data)

    def read(self, rows: tuple[int, int] | None = None, byte_cols: tuple[int, int] | None = None) -> torch.Tensor:
        """A private copy of the packed bytes, read from the file without the mapping, so
        loading does not make the file's pages resident in this process next to the copy.
        `rows` and `byte_cols` (ranges of a matrix's rows and of each row's bytes) read only
        that part [rows, byte columns], a few MB of whole rows at a time."""
        if rows is None and byte_cols is None:
            out = np.empty(self.data.shape, dtype=np.uint8)
            self._read_into(out, 0)
            return torch.from_numpy(out)
        n, row_bytes = self.data.shape[0], self.data.nbytes // max(self.data.shape[0], 1)
        (r0, r1), (c0, c1) = rows or (0, n), byte_cols or (0, row_bytes)
        out = np.empty((r1 - r0, c1 - c0), dtype=np.uint8)
        if (c0, c1) == (0, row_bytes):
            self._read_into(out, r0 * row_bytes)
            return torch.from_numpy(out)
        step = max(1, (8 << 20) // row_bytes)
        buf = np.empty((step, row_bytes), dtype=np.uint8)
        for r in range(r0, r1, step):
            k = min(step, r1 - r)
            self._read_into(buf[:k], r * row_bytes)
            out[r - r0:r - r0 + k] = buf[:k, c0:c1]
        return torch.from_numpy(out)

    def _read_into(self, out: np.ndarray, start: int) -> None:
        with open(self.path, "rb") as f:
            f.seek(self.offset + start)
            if f.readinto(memoryview(out).cast("B")) != out.nbytes:
                raise MinervaError(f"'{self.path}': tensor '{self.name}' is cut short; {redownload(self.path)}")


def redownload(path: Path) -> str:
    """What to do about a damaged file: for one in the Hugging Face cache's layout
    (models--OWNER--REPO/snapshots/COMMIT/...), the pull that checks and replaces it."""
    path = Path(path)
    parts = path.parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and part.count("--") >= 2 and parts[i + 1] == "snapshots":
            first = (split_parts(path) or [path])[0]
            repo = part.removeprefix("models--").replace("--", "/", 1)
            return f"run `minerva pull {repo}:{first.name} --verify` to download it again"
    return "re-download the file"


_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})(?P<suffix>\.gguf)$", re.IGNORECASE)


def split_parts(path: Path) -> list[Path] | None:
    """The paths of all parts of a split model (llama.cpp's `PREFIX-00001-of-00003.gguf`
    naming), in order, when `path` is named as one of them; else None."""
    m = _SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) < 1:
        return None
    count = int(m["count"])
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}{m['suffix']}") for i in range(1, count + 1)]


def _check_version(path: Path) -> None:
    """A GGUF file of a version the reader does not know is refused as such (not as corrupt)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != b"GGUF":
        return  # the reader says what is wrong
    version = int.from_bytes(head[4:], "little")
    if version not in (2, 3) and int.from_bytes(head[4:], "big") not in (2, 3):  # (big-endian files: swapped)
        raise MinervaError(f"'{path}' is a GGUF file of version {version}, and Minerva reads versions 2 and 3 "
                           "(those llama.cpp writes); convert the model again with a current llama.cpp")


def _read(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """The metadata and tensors of one GGUF file (one part of a split model)."""
    _check_version(path)
    try:
        # mode "c" (copy-on-write) gives writable arrays without copying the file,
        # so torch can wrap them without warnings.
        reader = _Reader(path, "c")
    except _Corrupt as exc:
        raise MinervaError(f"'{path}' is corrupt: {exc}; {redownload(path)}") from None
    except Exception as exc:  # the reader raises bare ValueError/IndexError/OSError on bad bytes
        raise MinervaError(
            f"'{path}' is not a readable GGUF file ({type(exc).__name__}: {exc}); "
            f"it may be truncated or corrupt; {redownload(path)}"
        ) from None
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = field.contents()
        except Exception:
            raise MinervaError(f"'{path}': metadata field '{key}' is corrupt") from None
    tensors: dict[str, GGUFTensor] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = t.data
        if data.dtype != np.uint8:  # F32/F16/... come back typed; keep bytes uniform
            data = data.view(np.uint8)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        block, type_size = gguf.GGML_QUANT_SIZES.get(t.tensor_type, (1, 0))
        expected = rows * (shape[-1] // block) * type_size
        if data.nbytes != expected:
            raise MinervaError(
                f"'{path}': tensor '{t.name}' has {data.nbytes} bytes, expected {expected}; "
                f"the file is truncated or corrupt; {redownload(path)}")
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type, shape, data.reshape(rows, -1), path, int(t.data_offset))
    return metadata, tensors


class GGUFFile:
    """Metadata and tensors of one GGUF model: one file, or every part of a split model
    (`PREFIX-00001-of-00003.gguf` ..., given by its first part, as llama.cpp loads them)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise MinervaError(f"GGUF file '{self.path}' {not_a_file(self.path)}; give the path of a .gguf file")
        self.metadata, self.tensors = _read(self.path)
        self.paths = [self.path]
        count = self.metadata.get(gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
        if isinstance(count, int) and count > 1:
            self._read_parts(count)

    def _read_parts(self, count: int) -> None:
        """The tensors of parts 2..count of a split model, added to the first part's."""
        no = self.metadata.get(gguf.Keys.Split.LLM_KV_SPLIT_NO)
        parts = split_parts(self.path)
        if no != 0 or parts is None or len(parts) != count:
            which = f"part {no + 1} of {count}" if isinstance(no, int) else f"one of {count} parts"
            name = (f"give its first part, '{parts[0].name}'" if parts and len(parts) == count
                    else f"its parts must be named PREFIX-00001-of-{count:05d}.gguf ... and the first given")
            raise MinervaError(f"'{self.path}' is {which} of a split model; {name}")
        for i, part in enumerate(parts[1:], start=1):
            if not part.is_file():
                raise MinervaError(f"'{self.path}' is the first of {count} parts of a split model, and part "
                                   f"{i + 1}, '{part}', is missing; download every part into one folder")
            metadata, tensors = _read(part)
            if metadata.get(gguf.Keys.Split.LLM_KV_SPLIT_NO) != i:
                raise MinervaError(f"'{part}' says it is part {metadata.get(gguf.Keys.Split.LLM_KV_SPLIT_NO)} "
                                   f"(from 0), its name says {i}; the parts of '{self.path.name}' are mixed up")
            twice = tensors.keys() & self.tensors.keys()
            if twice:
                raise MinervaError(f"'{part}' holds tensor '{min(twice)}' again; the parts of "
                                   f"'{self.path.name}' are from different models")
            self.tensors.update(tensors)
            self.paths.append(part)
        total = self.metadata.get(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
        if isinstance(total, int) and total != len(self.tensors):
            raise MinervaError(f"the {count} parts of '{self.path.name}' hold {len(self.tensors)} tensors, "
                               f"the first part says {total}; a part is from another model or damaged")

    @property
    def size(self) -> int:
        """Bytes on disk, every part together."""
        return sum(p.stat().st_size for p in self.paths)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if arch is None:
            raise MinervaError(f"'{self.path}' has no general.architecture in its metadata")
        if not isinstance(arch, str):
            raise MinervaError(f"'{self.path}': general.architecture = {str(arch)[:60]!r} is no architecture name "
                               "(a string such as 'llama'); the file is corrupt")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        """Architecture-scoped metadata: get("block_count") reads "<arch>.block_count"."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise MinervaError(f"'{self.path}' lacks metadata key '{self.architecture}.{key}'")
        return value

    @property
    def file_type_name(self) -> str:
        """The quantization mix the file calls itself (MOSTLY_Q4_K_M -> Q4_K_M), else the
        tensor type holding the most weights."""
        ftype = self.metadata.get("general.file_type")
        try:
            name = gguf.LlamaFileType(int(ftype) & ~int(gguf.LlamaFileType.GUESSED)).name
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except (ValueError, TypeError, OverflowError):
            counts: dict[str, int] = {}
            for t in self.tensors.values():
                counts[t.qtype.name] = counts.get(t.qtype.name, 0) + int(np.prod(t.shape))
            return max(counts, key=counts.get) if counts else "unknown"
