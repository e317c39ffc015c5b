"""Weight formats: how a linear layer's weight is stored and multiplied.

A `Linear` holds one of these and calls `matmul`; the model code never knows
the format. Packed kernels for quantized formats replace `GGUFWeight.matmul`
per device without touching any model file.
"""

from __future__ import annotations

import gguf
import torch
import torch.nn.functional as F

from minerva.formats.quant import dequantize


ROW_MULTIPLE = 4


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ w^T with a result per row that does not depend on T.

    CPU GEMM kernels pick their blocking by the row count, and for small row counts
    that are not a multiple of 4 a row's result changes in the last bits (measured on
    AVX-512 with this torch build). Padding T up to a multiple of 4 makes every row
    come out the same however many other rows share the batch — the basis of the
    engine's batch invariance — for at most 3 extra rows of work.
    """
    rows = x.shape[0]
    if x.dim() != 2 or rows % ROW_MULTIPLE == 0:
        return F.linear(x, w)
    pad = ROW_MULTIPLE - rows % ROW_MULTIPLE
    return F.linear(torch.cat([x, x.new_zeros(pad, x.shape[1])]), w)[:rows]


class DenseWeight:
    """A plain float tensor [out_features, in_features]."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    compute_nbytes = nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.tensor)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tensor[ids]


class GGUFWeight:
    """A GGML-quantized weight, kept as its packed bytes (one row of blocks per output).

    Rows can be gathered packed and dequantized on their own (embedding lookup).
    `matmul` uses a dequantized copy made once by `materialize`; the packed
    kernels of the CPU and CUDA backends replace that copy.
    """

    def __init__(self, packed: torch.Tensor, qtype: gguf.GGMLQuantizationType,
                 shape: tuple[int, int], dtype: torch.dtype):
        self.packed = packed  # uint8 [rows, bytes_per_row]
        self.qtype = qtype
        self.shape = shape
        self.dtype = dtype
        self._dense: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes as stored in the file (packed)."""
        return self.packed.numel()

    @property
    def compute_nbytes(self) -> int:
        """Bytes held for computing: the dequantized copy, when one was made."""
        return 0 if self._dense is None else self._dense.numel() * self._dense.element_size()

    def materialize(self, rows_per_chunk: int = 8192) -> None:
        """Dequantize once, a slab of rows at a time so temporaries stay small."""
        if self._dense is not None:
            return
        rows, cols = self.shape
        out = torch.empty(rows, cols, dtype=self.dtype, device=self.packed.device)
        for r in range(0, rows, rows_per_chunk):
            slab = self.packed[r:r + rows_per_chunk]
            out[r:r + slab.shape[0]] = dequantize(slab, self.qtype, (slab.shape[0], cols))
        self._dense = out

    def dense(self) -> torch.Tensor:
        self.materialize()
        return self._dense

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.dense())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self._dense is not None:
            return self._dense[ids]
        picked = self.packed[ids.reshape(-1)]
        out = dequantize(picked, self.qtype, (picked.shape[0], self.shape[1])).to(self.dtype)
        return out.reshape(*ids.shape, self.shape[1])


Weight = DenseWeight | GGUFWeight
