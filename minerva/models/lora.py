"""LoRA adapters (PEFT's format) on a loaded base model, several at once, each request on
its own.

A LoRA adapter adds `scale * B (A x)` to a projection's output (A: r x in, B: out x r,
scale = lora_alpha / r, or / sqrt(r) with rsLoRA). The base weights stay packed and shared;
each adapted projection (`Linear`) holds every adapter's A and B for its output columns
(q, k and v are one fused matmul: each has its columns). In a step, `Adapters.select`
gives each row its request's adapter (0: the base model), and each adapted `Linear` adds,
per adapter in the step, the low-rank product of that adapter's rows (S-LoRA's and
Punica's per-row adapter index, as a loop over the adapters present). Steps without an
adapter row run the base model's native paths unchanged; a step with one runs the layers
piece by piece, the base rows through the same kernels, so their results do not change.

Loaded from a directory (or a Hugging Face repo) holding `adapter_config.json` and
`adapter_model.safetensors`, trained on the base model's Hugging Face module names
(`…layers.N.self_attn.q_proj`, `…mlp.down_proj`, ...).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from minerva.errors import MinervaError
from minerva.kernels import native
from minerva.models.layers import Attention, GatedMLP, Linear, Projections

log = logging.getLogger("minerva")

KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
                 r"\.lora_([AB])(?:\.default)?\.weight$")
UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
               "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)"}


@dataclass
class LoraLinear:
    """One projection's adapters: adapter index -> [(first output column, columns, A, B * scale)].
    `pack` lays them out for `add_`: on the CPU for the compiled kernel (`entries`: per
    adapter and part, its index, first column, columns, rank and offsets of A^T and B^T in
    `weights`); elsewhere every A stacked (`a`: [R, in]), each of those R rank columns'
    adapter (`owner_of`) and per part its columns of R with its adapters' B side by side
    (`b`: [(first output column, columns, lo, hi, [columns, hi - lo])])."""
    owner: Adapters
    parts: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    entries: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    a: torch.Tensor | None = None
    owner_of: torch.Tensor | None = None
    b: list[tuple[int, int, int, int, torch.Tensor]] = field(default_factory=list)
    kernels: object = None

    def pack(self, kernels, dtype: torch.dtype) -> None:
        """Lay the adapters out for `add_`: for `kernels` (the compiled module) when there is one,
        its weights in `dtype` (bfloat16 for a bfloat16 model, else float32)."""
        items = sorted((start, n, index, A, B) for index, parts in self.parts.items() for start, n, A, B in parts)
        if kernels is not None:
            rows, flat, off = [], [], 0
            for start, n, index, A, B in items:
                r = A.shape[0]
                rows.append([index, start, n, r, off, off + A.numel()])
                flat += [A.T.reshape(-1), B.T.reshape(-1)]
                off += A.numel() + B.numel()
            self.entries = torch.tensor(rows, dtype=torch.int64)
            self.weights = torch.cat(flat).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
            self.kernels = kernels
            return
        self.kernels, self.b, lo, owner_of = None, [], 0, []
        for (start, n) in sorted({(start, n) for start, n, *_ in items}):
            part = [(index, A, B) for s, m, index, A, B in items if (s, m) == (start, n)]
            hi = lo + sum(A.shape[0] for _, A, _ in part)
            owner_of += [index for index, A, _ in part for _ in range(A.shape[0])]
            self.b.append((start, n, lo, hi, torch.cat([B for _, _, B in part], dim=1).contiguous()))
            lo = hi
        self.a = torch.cat([A for *_, A, _ in items]).contiguous()
        self.owner_of = torch.tensor(owner_of, device=self.a.device)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[each row, columns] += x[row] A^T B^T of the row's adapter, every adapter of the step
        at once. The base model's rows are left as they are."""
        if not any(a in self.parts for a, _ in self.owner.present):
            return
        if self.kernels is not None and x.stride(-1) == 1 and y.stride(-1) == 1:
            self.kernels.lora_add_(x, y, self.owner.order, self.owner.bounds, self.entries, self.weights)
            return
        xa = x.float() @ self.a.T  # every A; a rank column kept only in the rows of its adapter
        xa *= self.owner.rows[:, None] == self.owner_of
        for start, n, lo, hi, B in self.b:
            y[:, start:start + n] += xa[:, lo:hi] @ B.T


class Adapters:
    """The adapters loaded onto one model: `names[i - 1]` is adapter i (0 is the base model),
    and during a step `rows` (each row's adapter) and `present` (each adapter in the step
    with its rows), None / empty when no row has one."""

    def __init__(self, names: list[str]):
        self.names = names
        self.rows: torch.Tensor | None = None
        self.present: list[tuple[int, torch.Tensor]] = []
        # the rows of adapted requests grouped by adapter, and where each adapter's begin
        # (adapter i: order[bounds[i]:bounds[i + 1]]), for the compiled kernel
        self.order: torch.Tensor | None = None
        self.bounds: torch.Tensor | None = None
        self.native = None  # the same for the native layers (the compiled LoraRows), when they run the model

    def index(self, name: str | None) -> int:
        """The adapter index of a request's `adapter` name (None: the base model, 0)."""
        if name is None:
            return 0
        if name not in self.names:
            known = ", ".join(self.names) or "none loaded"
            raise MinervaError(f"no LoRA adapter named '{name}' (adapters: {known})")
        return self.names.index(name) + 1

    def select(self, per_seq: list[int], tokens: list[int], device: torch.device) -> None:
        """Each row's adapter for a step of sequences with these adapters and token counts."""
        if not any(per_seq):
            self.clear()
            return
        self.rows = torch.repeat_interleave(torch.tensor(per_seq), torch.tensor(tokens)).to(device)
        self.present = [(a, (self.rows == a).nonzero().flatten()) for a in sorted(set(per_seq)) if a]
        counts = [0] * (len(self.names) + 1)
        for a, rows in self.present:
            counts[a] = len(rows)
        self.order = torch.cat([rows for _, rows in self.present]).cpu()
        self.bounds = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
        if self.native is not None:
            self.native.set(self.order, self.bounds)

    def clear(self) -> None:
        self.rows, self.present, self.order, self.bounds = None, [], None, None
        if self.native is not None:
            self.native.clear()


def read_adapter(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """An adapter directory's config and tensors, with one-line errors for what is not PEFT LoRA."""
    cfg_path, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise MinervaError(f"'{path}' is not a LoRA adapter: it needs adapter_config.json and "
                           f"adapter_model.safetensors (PEFT's save_pretrained writes both)")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
        with safe_open(str(weights), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, ValueError, RecursionError, SafetensorError) as exc:
        raise MinervaError(f"'{path}': cannot read the adapter ({exc})") from None
    if not isinstance(config, dict):
        raise MinervaError(f"'{cfg_path}' is not an adapter config: expected a JSON object")
    r, alpha = config.get("r", 8), config.get("lora_alpha", config.get("r", 8))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise MinervaError(f"'{cfg_path}': r (the rank) must be an integer >= 1, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise MinervaError(f"'{cfg_path}': lora_alpha must be a finite number, got {alpha!r}")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise MinervaError(f"'{path}' is a {config.get('peft_type')} adapter; only LoRA adapters are served")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise MinervaError(f"'{path}' uses {what}, which Minerva does not apply; use a plain LoRA adapter")
    return config, tensors


SCALE_WARN = 1000.0  # a scale (lora_alpha / r) past this is a mistake, not training


def _check_effect(name: str, path: Path, scale: float, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse an adapter with NaN or infinite values; warn of one that changes nothing."""
    bad = next((k for k, t in tensors.items() if not torch.isfinite(t).all()), None)
    if bad is not None:
        raise MinervaError(f"adapter '{name}' ({path}): {bad} holds NaN or infinite values; the adapter is "
                           "damaged (or its training diverged)")
    if abs(scale) > SCALE_WARN:
        log.warning("adapter '%s' (%s) scales its change by %.3g (lora_alpha / r; trained adapters use a few "
                    "units to tens): its requests may overflow; check lora_alpha", name, path, scale)
    if scale == 0 or all(not t.any() for k, t in tensors.items() if "lora_B" in k):
        why = "its lora_alpha is 0" if scale == 0 else "every lora_B is zero, as PEFT makes them before training"
        log.warning("adapter '%s' (%s) changes nothing: %s; its requests run as the base model", name, path, why)


def _targets(model, layer: int, block: str, name: str) -> tuple[Linear, int, int]:
    """The Linear computing HF module `layers.{layer}.{block}.{name}`, its first output column and columns."""
    if layer >= len(model.layers):
        raise MinervaError(f"it adapts layer {layer}, and the model has {len(model.layers)} layers")
    decoder = model.layers[layer]
    if block == "self_attn":
        attn: Attention = decoder.attn
        if name == "o_proj":
            return attn.o_proj, 0, attn.o_proj.weight.shape[0]
        return _part(attn.qkv_proj, ["q_proj", "k_proj", "v_proj"].index(name))
    mlp = decoder.mlp
    if not isinstance(mlp, GatedMLP):
        raise MinervaError(f"it adapts layer {layer}'s {name} of a mixture of experts; Minerva applies "
                           "LoRA to attention and dense MLP projections only")
    if name == "down_proj":
        return mlp.down, 0, mlp.down.weight.shape[0]
    return _part(mlp.gate_up, ["gate_proj", "up_proj"].index(name))


def _part(proj: Projections, i: int) -> tuple[Linear, int, int]:
    """Part i of fused projections: the Linear holding it, its first column there, its columns."""
    k = 0
    for lin, sizes in zip(proj.groups, proj.run_sizes):
        if i < k + len(sizes):
            j = i - k
            return lin, sum(sizes[:j]), sizes[j]
        k += len(sizes)
    raise IndexError(i)


def attach(model, adapters: dict[str, Path], device: torch.device, dtype: torch.dtype = torch.float32) -> Adapters:
    """Load each adapter (name -> directory) onto `model`'s projections, for a model computing in `dtype`."""
    owner = Adapters(list(adapters))
    for index, (name, path) in enumerate(adapters.items(), start=1):
        config, tensors = read_adapter(path)
        r = config.get("r", 8)
        scale = float(config.get("lora_alpha", r)) / (math.sqrt(r) if config.get("use_rslora") else r)
        pairs: dict[tuple, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            m = KEY.search(key)
            if m is None and ".lora_" in key and key.endswith(".bias"):
                raise MinervaError(f"adapter '{name}' ({path}) has '{key}': LoRA biases (lora_bias) are not "
                                   "applied; use an adapter trained without them")
            if m is None:
                raise MinervaError(f"adapter '{name}' ({path}) has '{key}': Minerva applies LoRA to the attention "
                                   "and MLP projections of decoder layers only")
            pairs.setdefault((int(m[1]), m[2], m[3]), {})[m[4]] = t
        if not pairs:
            raise MinervaError(f"adapter '{name}' ({path}) holds no LoRA tensors: it would change nothing; give "
                               "the folder of a trained adapter")
        _check_effect(name, path, scale, tensors)
        for (layer, block, proj), ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                have = next(iter(ab))
                raise MinervaError(f"adapter '{name}' ({path}): layer {layer} {proj} has lora_{have} without "
                                   f"lora_{'B' if have == 'A' else 'A'}")
            try:
                lin, start, n = _targets(model, layer, block, proj)
            except MinervaError as exc:
                raise MinervaError(f"adapter '{name}' ({path}): {exc}") from None
            A, B = ab["A"].float(), ab["B"].float()
            if A.dim() != 2 or B.dim() != 2 or A.shape[1] != lin.weight.shape[1] or B.shape[0] != n \
                    or A.shape[0] != B.shape[1]:
                raise MinervaError(f"adapter '{name}' ({path}) does not fit this model: layer {layer} {proj} is "
                                   f"{n} x {lin.weight.shape[1]}, the adapter's A {tuple(A.shape)} and B "
                                   f"{tuple(B.shape)}; was it trained on another base model?")
            if A.shape[0] != r:  # its scale is lora_alpha / r: a rank the config does not say is wrong
                raise MinervaError(f"adapter '{name}' ({path}): layer {layer} {proj} has rank {A.shape[0]}, and "
                                   f"adapter_config.json says r = {r}")
            if lin.lora is None:
                lin.lora = LoraLinear(owner)
            lin.lora.parts.setdefault(index, []).append((start, n, A.to(device), (B * scale).to(device)))
    kernels = native.load() if torch.device(device).type == "cpu" else None
    for lin in model.modules():
        if isinstance(lin, Linear) and lin.lora is not None:
            lin.lora.pack(kernels, dtype)
    if kernels is not None:
        owner.native = kernels.LoraRows()
        for decoder in model.layers:
            if decoder.fused is not None:
                decoder.fused.adapt(owner.native, _native_parts(decoder, owner, kernels, dtype))
    return owner


def _native_parts(decoder, owner: Adapters, kernels, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """A native layer's adapters: entries and weights of its q/k/v, o, gate/up and down
    (None where no adapter adapts them), the parts of each Linear of fused projections
    placed at that Linear's columns of the layer's output (one Linear's own, shared)."""
    attn, mlp = decoder.attn, decoder.mlp
    out: list[torch.Tensor | None] = []
    for lins in (attn.qkv_proj.linears(), [attn.o_proj], mlp.gate_up.linears(), [mlp.down]):
        if len(lins) == 1 and lins[0].lora is not None:
            out += [lins[0].lora.entries, lins[0].lora.weights]
            continue
        joined, first = LoraLinear(owner), 0
        for lin in lins:
            for index, parts in (lin.lora.parts if lin.lora is not None else {}).items():
                joined.parts.setdefault(index, []).extend((first + start, n, A, B) for start, n, A, B in parts)
            first += lin.weight.shape[0]
        if joined.parts:
            joined.pack(kernels, dtype)
            out += [joined.entries, joined.weights]
        else:
            out += [None, None]
    return out
