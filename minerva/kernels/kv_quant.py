"""KV-cache precisions, as a table: how K and V are stored in the paged pool.

Float formats store the values cast to a float dtype. Scaled formats (int8, fp8)
store `x / scale` with one float32 scale per token per head, `scale = absmax /
qmax`, so a token's values are quantized independently of every other token's:
writing one token never changes another, and a request's cache contents do not
depend on what it was batched with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minerva.errors import MinervaError


@dataclass(frozen=True)
class KVFormat:
    storage: torch.dtype | None  # None: the model's compute dtype ("auto")
    qmax: float | None = None  # largest stored magnitude, for formats with a per-token-per-head scale

    @property
    def scaled(self) -> bool:
        return self.qmax is not None


KV_FORMATS: dict[str, KVFormat] = {
    "auto": KVFormat(None),
    "bfloat16": KVFormat(torch.bfloat16),
    "float16": KVFormat(torch.float16),
    "float32": KVFormat(torch.float32),
    "int8": KVFormat(torch.int8, 127.0),
    "fp8": KVFormat(torch.float8_e4m3fn, 448.0),
}

SCALE_DTYPE = torch.float32


def kv_format(name: str) -> KVFormat:
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise MinervaError(
            f"unknown KV cache format {name!r}; choose one of: {', '.join(KV_FORMATS)}") from None


def storage_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the pool holds for format `name` when the model computes in `dtype`."""
    return kv_format(name).storage or dtype


def resolve_format(name: str, dtype: torch.dtype) -> str:
    """The concrete format name: "auto" becomes the float format of the compute dtype."""
    if name != "auto":
        kv_format(name)
        return name
    for concrete, spec in KV_FORMATS.items():
        if spec.storage == dtype and not spec.scaled:
            return concrete
    raise MinervaError(f"KV cache format 'auto' needs a bfloat16, float16 or float32 compute dtype, "
                       f"not {dtype}; name a format explicitly")


def quantize_kv(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, Hkv, D] float -> (data [N, Hkv, D], scale [N, Hkv] float32, or None for float formats)."""
    spec = kv_format(fmt)
    if not spec.scaled:
        return x.to(spec.storage or x.dtype), None
    x = x.to(SCALE_DTYPE)
    scale = x.abs().amax(dim=-1) / spec.qmax
    # An all-zero row keeps scale 0 (dequantizes to 0) but divides by 1.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    q = x / divisor
    if spec.storage == torch.int8:
        q = torch.round(q)
    # Clamp: float rounding of x / scale can step past qmax, and some devices turn
    # out-of-range fp8 casts into NaN instead of saturating.
    return q.clamp(-spec.qmax, spec.qmax).to(spec.storage), scale


def dequantize_kv(data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_kv`: data [..., D] (+ scale [...]) -> float `dtype`."""
    if scale is None:
        return data.to(dtype)
    return (data.to(SCALE_DTYPE) * scale.unsqueeze(-1)).to(dtype)
