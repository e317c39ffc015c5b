"""Weight formats: how a linear layer's weight is stored and multiplied.

A `Linear` holds one of these and calls `matmul`; the model code never knows
the format. A `PackedWeight` asks the device's backend (`minerva.kernels.dispatch`) once,
at construction, for the kernel that multiplies its type; without one it dequantizes
once and runs the torch reference.
"""

from __future__ import annotations

import gguf
import torch
import torch.nn.functional as F

from minerva.formats.quant import dequantize
from minerva.kernels import act_quant, dispatch, hugepages, repack

FLOAT_QTYPES = {torch.float32: gguf.GGMLQuantizationType.F32, torch.float16: gguf.GGMLQuantizationType.F16,
                torch.bfloat16: gguf.GGMLQuantizationType.BF16}


ROW_MULTIPLE = 4
MIN_ROWS = 16


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ w^T with a result per row that does not depend on T.

    CPU GEMM kernels pick their blocking by the row count, and a row's result changes in
    the last bits with it: on AVX-512 (Zen 5, this torch build's MKL) for small row counts
    that are not a multiple of 4, and on an AVX-512 Xeon for every count under 16 against
    16 and more. Padding T up to 16, and above that to a multiple of 4, makes every row come
    out the same however many other rows share the batch (the basis of the engine's batch
    invariance) for a few rows of extra work.
    """
    rows = x.shape[0]
    if x.dim() != 2 or (rows >= MIN_ROWS and rows % ROW_MULTIPLE == 0):
        return F.linear(x, w)
    pad = MIN_ROWS - rows if rows < MIN_ROWS else ROW_MULTIPLE - rows % ROW_MULTIPLE
    return F.linear(torch.cat([x, x.new_zeros(pad, x.shape[1])]), w)[:rows]


class DenseWeight:
    """A plain float tensor [out_features, in_features]."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    compute_nbytes = nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.tensor)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tensor[ids]


class PackedWeight:
    """A weight in a GGML layout, kept as its packed bytes (one row of blocks per output):
    a quantized type, or a plain F32/F16/BF16 matrix (see `float_weight`).

    Where the device's backend has a kernel for the type (on CPU: the C++ kernels, float32
    or bfloat16 activations), it multiplies straight from these bytes; rows are gathered
    packed and decoded on their own for embedding lookups. Without one, `materialize`
    makes a dequantized copy once and `matmul` uses it (the reference path).

    With `int8` set (`use_int8_activations`), a quantized weight multiplies 8-bit
    activations (`minerva.kernels.act_quant`): integer dot products in the kernel, the same
    rounding of x on the reference path.
    """

    def __init__(self, packed: torch.Tensor, qtype: gguf.GGMLQuantizationType,
                 shape: tuple[int, int], dtype: torch.dtype):
        self.qtype = qtype
        self.qtype_id = int(qtype)
        self.shape = tuple(shape)
        self.dtype = dtype
        self.kernel = dispatch.matmul_kernel(packed.device, qtype, dtype)  # None: the reference path
        self.packed = packed.contiguous() if self.kernel is not None else packed  # uint8 [rows, row bytes]
        self._dense: torch.Tensor | None = None
        self.int8 = False
        self.regrouped = False  # the bytes are in `repack`'s layout (8 rows' blocks together)

    def use_int8_activations(self, regroup: bool = True) -> None:
        """Multiply 8-bit activations from now on, if this is a quantized type (float
        matrices keep float activations). With `regroup`, a matrix of one of `repack.TYPES`
        on the CPU kernels is regrouped for them (`minerva.kernels.repack`: fewer
        instructions; the same results for the 4- and 5-bit blocks of 32, float rounding
        aside for Q8_0/Q4_K/Q5_K); the loader leaves out a matrix that is also the
        embedding, whose row lookups each step would have to undo it, unless the kernels
        look its rows up in place (`repack.LOOKUP_TYPES`)."""
        self.int8 = act_quant.applies(self.qtype)
        if (self.int8 and regroup and not self.regrouped and self.kernel is not None
                and repack.applies(self.kernel, self.qtype)):  # the C++ kernels
            self.packed = repack.regroup_in_place(self.packed, self.qtype, *self.shape, self.kernel)
            self.qtype_id = int(self.qtype) | repack.REGROUPED
            self.regrouped = True

    def _ggml_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `ids` (all when None) in the GGML layout, undoing the regrouping."""
        if not self.regrouped:
            return self.packed if ids is None else self.packed[ids]
        rows, cols = self.shape
        if ids is not None and self.qtype in repack.LOOKUP_TYPES and hasattr(self.kernel, "regrouped_rows"):
            return self.kernel.regrouped_rows(self.packed, self.qtype_id, ids, cols)
        if ids is None:
            return repack.restore(self.packed, self.qtype, rows, cols)
        g = repack.group_rows(self.qtype)
        groups = self.packed.reshape(-1, g, self.packed.shape[1])[ids // g]
        n = groups.shape[0]
        ggml = repack.restore(groups.reshape(n * g, -1), self.qtype, n * g, cols)
        return ggml.reshape(n, g, -1)[torch.arange(n), ids % g]

    @property
    def nbytes(self) -> int:
        """Bytes as stored in the file (packed; regrouped, up to 7 zero rows more, Q6_K 15)."""
        return self.packed.numel()

    @property
    def compute_nbytes(self) -> int:
        """Bytes held for computing: the packed bytes, or the dequantized copy when one was made."""
        if self._dense is not None:
            return self._dense.numel() * self._dense.element_size()
        return self.nbytes

    def materialize(self, rows_per_chunk: int = 8192) -> None:
        """Ready the weight for matmul: nothing to do with a packed kernel; otherwise
        dequantize once, a slab of rows at a time so temporaries stay small."""
        if self._dense is not None or self.kernel is not None:
            return
        rows, cols = self.shape
        out = torch.empty(rows, cols, dtype=self.dtype, device=self.packed.device)
        packed = self._ggml_rows()
        for r in range(0, rows, rows_per_chunk):
            slab = packed[r:r + rows_per_chunk]
            out[r:r + slab.shape[0]] = dequantize(slab, self.qtype, (slab.shape[0], cols))
        self._dense = out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype == self.dtype:
            rows, cols = self.shape
            mm = self.kernel.qmatmul_q8 if self.int8 else self.kernel.qmatmul
            if x.dim() == 2:
                return mm(x, self.packed, self.qtype_id, rows, cols)
            y = mm(x.reshape(-1, cols), self.packed, self.qtype_id, rows, cols)
            return y.reshape(*x.shape[:-1], rows)
        self.materialize()
        if self.int8:
            x = act_quant.round_trip(x, act_quant.block_for(self.qtype)).to(x.dtype)
        return linear(x, self._dense)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self._dense is not None:
            return self._dense[ids]
        picked = self._ggml_rows(ids.reshape(-1))
        cols = self.shape[1]
        if self.kernel is not None:
            out = self.kernel.dequantize_rows(picked, int(self.qtype), cols).to(self.dtype)
        else:
            out = dequantize(picked, self.qtype, (picked.shape[0], cols)).to(self.dtype)
        return out.reshape(*ids.shape, cols)


Weight = DenseWeight | PackedWeight


def float_weight(t: torch.Tensor, dtype: torch.dtype) -> Weight:
    """A float matrix [out, in] for activations of `dtype`.

    Where the backend multiplies packed F32/F16/BF16 matrices, it is held as one and
    multiplied by them like a quantized weight: the same batch-invariant kernels, and
    several times the speed of a small-row GEMM over a transposed matrix. It keeps the
    checkpoint's precision when widening to `dtype` is exact (bf16 or fp16 weights under
    float32 activations stay 2 bytes each); otherwise it is converted to `dtype`.
    Elsewhere it is a plain tensor in `dtype`.
    """
    store = t.dtype if dtype == torch.float32 else dtype
    usable = (t.dim() == 2 and t.shape[1] % 32 == 0 and t.dtype in FLOAT_QTYPES and store in FLOAT_QTYPES
              and dispatch.matmul_kernel(t.device, FLOAT_QTYPES[store], dtype) is not None)
    if not usable:
        return DenseWeight(t.to(dtype))
    data = t.to(store).contiguous()
    return PackedWeight(data.view(torch.uint8), FLOAT_QTYPES[store], tuple(t.shape), dtype)


def stackable(weights: list[Weight]) -> bool:
    """Whether `fuse` can stack these weights: all dense alike, or all packed alike."""
    if all(isinstance(w, DenseWeight) for w in weights):
        return len({(w.tensor.shape[1], w.tensor.dtype, w.tensor.device) for w in weights}) == 1
    if all(isinstance(w, PackedWeight) for w in weights):
        same = {(w.qtype, w.shape[1], w.dtype, w.packed.device, w.int8) for w in weights}
        return len(same) == 1 and all(w.kernel is not None for w in weights)
    return False


def fuse(weights: list[Weight]) -> Weight | None:
    """One weight whose output rows are those of `weights` in order (QKV, gate/up), so one
    matmul replaces several; None when their formats differ. Stacking rows is exact:
    every output row is still computed from its own weight row alone."""
    if not stackable(weights):
        return None
    first = weights[0]
    if isinstance(first, DenseWeight):
        return DenseWeight(torch.cat([w.tensor for w in weights]))
    packed = torch.cat([w.packed.reshape(w.shape[0], -1) for w in weights])
    fused = PackedWeight(packed, first.qtype, (sum(w.shape[0] for w in weights), first.shape[1]), first.dtype)
    fused.int8 = first.int8
    return fused


def into_hugepages(weights) -> None:
    """Move the bytes of every packed weight a CPU kernel streams into one pool of 2 MiB
    pages (`minerva.kernels.hugepages`: fewer TLB misses, so decode reads them faster). Each
    original is released as soon as its copy is made, while the rest wait. Call it once the
    weights are final (fused, regrouped), before anything else holds their bytes."""
    ws = list({id(w): w for w in weights if isinstance(w, PackedWeight) and w.kernel is not None
               and w.packed.device.type == "cpu"}.values())
    if not ws:
        return
    dst = hugepages.Pool(sum(hugepages.padded(w.packed) for w in ws))
    moved = 0
    for w in ws:
        moved += hugepages.padded(w.packed)
        w.packed = dst.take(w.packed)
        if moved >= hugepages.TRIM_EVERY:  # the originals' memory back to the OS as it goes
            hugepages.give_back_freed()
            moved = 0
    hugepages.give_back_freed()
