"""Shared building blocks: every architecture is assembled from these.

Tensors are laid out token-major: hidden states are [T, hidden] for the T new
tokens of one forward pass; attention metadata arrives in an
`AttentionContext` that the caller (the engine) builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from minerva.kernels import dispatch, ops
from minerva.kernels.weights import PackedWeight, Weight, fuse, stackable
from minerva.models.config import SLIDING, TOPK_SOFTMAX, ModelConfig, RopeScaling


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store the new k/v [T, Hkv, D] of `layer` and return attention outputs [T, H, D]
        of the queries q [T, H, D] over each sequence's keys (causal, windowed if given;
        `sinks` [H]: a logit per head that joins each softmax's denominator only)."""

    def kernel_args(self, layer: int, dtype: torch.dtype) -> tuple | None:
        """What a fused decoder layer needs to store and attend over this step's K/V of
        `layer` (pools, scales, slots, block tables, lengths, positions), or None when the
        fused layer cannot run over this backend: the layer then runs `forward` piece by piece."""

    def stack_args(self, num_layers: int, dtype: torch.dtype) -> tuple | None:
        """kernel_args for layers 0 .. num_layers - 1 at once, as the kernel's `forward_layers`
        takes them (each layer's pools, scales, slots and block tables as lists, then the
        step's lengths and positions), or None."""


@dataclass
class AttentionContext:
    positions: torch.Tensor  # [T] absolute position of each new token
    backend: AttentionBackend  # where K/V live and how the batch's sequences are laid out
    rope: dict = field(default_factory=dict)  # cos/sin of `positions` per rotary, made once a pass


class Layer(nn.Module):
    """Base of Minerva's modules: calling one runs `forward` directly. Inference uses no
    hooks, and nn.Module's call machinery costs more per call than a decode step's small
    ops (hundreds of calls per token)."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


def freeze(model: nn.Module) -> None:
    """Make submodules and buffers plain instance attributes, so reading `self.attn` skips
    nn.Module.__getattr__. Call after the model is on its device; the registrations stay,
    so `.modules()` still walks the model (a later `.to()` would need freezing again)."""
    for m in model.modules():
        m.__dict__.update(m._modules)
        m.__dict__.update(m._buffers)


class Linear(Layer):
    """y = x W^T (+ b), whatever format W is stored in."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.lora = None  # its LoRA adapters (minerva.models.lora.LoraLinear), if any adapts it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight.matmul(x)
        if self.lora is not None and self.lora.owner.present:
            self.lora.add_(x, y)
        return y if self.bias is None else y.add_(self.bias)


class Projections(Layer):
    """Several linears on the same input (Q/K/V, gate/up): each run of consecutive ones whose
    weights' formats allow stacking them is one fused matmul (a Q4_K_M layer's Q4_K Q and K
    together, its Q6_K V alone), so usually all of them are one."""

    def __init__(self, *linears: Linear):
        super().__init__()
        self.sizes = [lin.weight.shape[0] for lin in linears]
        runs = [[linears[0]]]
        for lin in linears[1:]:
            if stackable([runs[-1][-1].weight, lin.weight]):
                runs[-1].append(lin)
            else:
                runs.append([lin])
        self.run_sizes = [[lin.weight.shape[0] for lin in run] for run in runs]
        self.groups = nn.ModuleList(run[0] if len(run) == 1 else self._fused(run) for run in runs)

    @staticmethod
    def _fused(run: list[Linear]) -> Linear:
        some = next((lin.bias for lin in run if lin.bias is not None), None)
        bias = None if some is None else torch.cat([lin.bias if lin.bias is not None else some.new_zeros(
            lin.weight.shape[0]) for lin in run])
        return Linear(fuse([lin.weight for lin in run]), bias)

    @property
    def fused(self) -> Linear | None:
        """The one matmul that computes every output, when the formats allowed it."""
        return self.groups[0] if len(self.groups) == 1 else None

    def linears(self) -> list[Linear]:
        """The matmuls this runs, in order; their outputs side by side are the parts'."""
        return list(self.groups)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [y for lin, sizes in zip(self.groups, self.run_sizes) for y in lin(x).split(sizes, dim=-1)]


class RMSNorm(Layer):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling,
                  freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:  # GGUF files carry llama3 scaling as precomputed factors
        return inv_freq / freq_factors.float().to(inv_freq.device)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if scaling.kind == "llama3":
        low_wavelen = scaling.original_max_position / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def yarn_attention_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by the factor), those turning more than beta_fast times kept,
    with a linear ramp between."""
    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return (head_dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


class Rotary(Layer):
    """Rotary position embedding, half-split ("neox") layout; cos and sin scaled by
    `attention_factor` (YaRN), which scales q.k by its square."""

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # moves with model.to(device)
        self.attention_factor = attention_factor

    def cos_sin(self, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = ctx.rope.get(id(self))
        if cos_sin is None:  # once per forward pass, shared by every layer using this rotary
            cos, sin = ops.rope_cos_sin(ctx.positions, self.inv_freq)
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            cos_sin = ctx.rope[id(self)] = cos, sin
        return cos_sin

    def forward(self, q: torch.Tensor, k: torch.Tensor, ctx: AttentionContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(ctx)
        return ops.rope(q, cos, sin), ops.rope(k, cos, sin)


class Attention(Layer):
    def __init__(self, config: ModelConfig, layer: int, q: Linear, k: Linear, v: Linear,
                 o: Linear, rotary: Rotary, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None, sinks: torch.Tensor | None = None):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, config.head_dim)
        self.scale = config.softmax_scale
        self.window = config.sliding_window if config.layer_types[layer] == SLIDING else None
        self.qkv_proj, self.o_proj = Projections(q, k, v), o
        self.q_norm, self.k_norm = q_norm, k_norm
        self.rotary = rotary
        self.sinks = sinks

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, ctx)
        out = ctx.backend.attend(self.layer, q, k, v, self.window, self.scale, self.sinks)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class GatedMLP(Layer):
    """down(act(gate(x)) * up(x)): SwiGLU for Llama, GeGLU for Gemma."""

    def __init__(self, gate: Linear, up: Linear, down: Linear, activation: str,
                 limit: tuple[float, float] | None = None):
        super().__init__()
        self.gate_up, self.down = Projections(gate, up), down
        self.activation, self.limit = activation, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up.fused
        gate_up = fused(x) if fused is not None else torch.cat(self.gate_up(x), dim=-1)
        return self.down(ops.act_mul(gate_up, self.activation, limit=self.limit))


class MoE(Layer):
    """Mixture of experts: a router picks `top_k` experts for each token, and the token's
    output is its experts' outputs weighted by the router.

    Tokens are grouped by expert, so each chosen expert runs one matmul per weight over all
    of its tokens (a Python loop over the experts in use, never over tokens). Batch
    invariance holds: an expert's kernels give each row the result it would get alone, and
    a token sums its k outputs in its own rank order, whoever else chose the same experts.
    """

    def __init__(self, router: Linear, experts: list[GatedMLP], top_k: int, routing: str,
                 renormalize: bool):
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.top_k, self.routing, self.renormalize = top_k, routing, renormalize
        self.fused = None  # the expert loop as one kernel call (see make_fused), when possible

    def make_fused(self) -> None:
        """Run the loop over the chosen experts as one call of the backend's kernel (on CPU
        `Experts` in minerva/kernels/csrc/module.cpp) when every expert matmul has a packed
        kernel: the same kernels and ops in the same order as `forward`, so the same bits
        (tests/models/test_moe.py), without tens of Python ops per expert."""
        lins = [lin for e in self.experts for lin in (*e.gate_up.linears(), e.down)]
        ws = [lin.weight for lin in lins]
        first = self.experts[0]
        act = first.activation
        if (not all(isinstance(w, PackedWeight) and w.kernel is not None for w in ws) or len({w.dtype for w in ws}) != 1
                or not ((act == "swiglu_limit" or act in ops.ACT_IDS) and first.down.weight.shape[1] % 16 == 0)):
            return
        kernel = dispatch.layer_kernel(ws[0].packed.device, ws[0].dtype)
        if kernel is None:
            return

        def linear(lin: Linear):
            w = lin.weight
            return kernel.Linear(kernel.Packed(w.packed, w.qtype_id, *w.shape, w.int8), lin.bias)

        limit, alpha = first.limit or (0.0, 0.0)
        self.fused = kernel.Experts([kernel.Expert([linear(lin) for lin in e.gate_up.linears()], linear(e.down))
                                     for e in self.experts], ops.ACT_IDS.get(act, -1), limit, alpha)
        self.fused_dtype = ws[0].dtype

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 weights [T, k] and expert ids [T, k] of each token's chosen experts."""
        logits = self.router(x).float()
        if self.routing == TOPK_SOFTMAX:
            top, ids = logits.topk(self.top_k, dim=-1)
            return top.softmax(dim=-1), ids
        weights, ids = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        weights = weights.to(x.dtype)
        if self.fused is not None and x.dtype == self.fused_dtype:
            return self.fused.forward(x, ids, weights)
        k = self.top_k
        if x.shape[0] == 1:  # decode: the token's experts in rank order, nothing to group
            out = None
            for j, e in enumerate(ids[0].tolist()):
                y = self.experts[e](x).mul_(weights[:, j:j + 1])
                out = y if out is None else out.add_(y)
            return out
        flat = ids.reshape(-1)  # (token, rank) pairs, token-major
        order = torch.argsort(flat, stable=True)  # grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        ys = x.new_empty(flat.shape[0], x.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                pairs = order[start:start + n]
                ys[pairs] = self.experts[e](x[pairs // k])
                start += n
        ys = ys.view(x.shape[0], k, -1)
        out = ys[:, 0].mul(weights[:, :1])
        for j in range(1, k):
            out.add_(ys[:, j].mul(weights[:, j:j + 1]))
        return out


class DecoderLayer(Layer):
    """Pre-norm residual block; optional post-norms (Gemma) wrap each sublayer's output."""

    def __init__(self, attn: Attention, mlp: GatedMLP | MoE, input_norm: RMSNorm, pre_mlp_norm: RMSNorm,
                 post_attn_norm: RMSNorm | None = None, post_mlp_norm: RMSNorm | None = None):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.pre_mlp_norm = input_norm, pre_mlp_norm
        self.post_attn_norm, self.post_mlp_norm = post_attn_norm, post_mlp_norm
        self.fused = None  # the same layer as one kernel call (see make_fused), when possible
        self.tp = None  # under tensor parallelism, the Comm that all-reduces each sublayer's partial output

    def make_fused(self) -> None:
        """Build this layer as one call of the backend's layer kernel (on CPU the C++
        `DecoderLayer` in minerva/kernels/csrc/module.cpp) when every matmul has a packed
        kernel and the norms and head size suit the kernel's ops. It runs the same kernels
        in the same order as `forward`, which tests/kernels/test_native_layer.py checks bit for bit."""
        attn, mlp = self.attn, self.mlp
        if isinstance(mlp, MoE):
            mlp.make_fused()
        if not isinstance(mlp, GatedMLP) or attn.sinks is not None or mlp.activation not in ops.ACT_IDS:
            return  # the layer kernel runs a dense feed-forward of its activations, without sinks
        qkv, gate_up = attn.qkv_proj.linears(), mlp.gate_up.linears()
        linears = [*qkv, attn.o_proj, *gate_up, mlp.down]
        norms = [n for n in (self.input_norm, self.pre_mlp_norm, self.post_attn_norm, self.post_mlp_norm,
                             attn.q_norm, attn.k_norm) if n is not None]
        weights = [lin.weight for lin in linears]
        if (not all(isinstance(w, PackedWeight) and w.kernel is not None for w in weights)
                or any(lin.bias is not None for lin in linears) or len({w.dtype for w in weights}) != 1
                or any(n.weight.dtype != torch.float32 for n in norms) or attn.head_dim % 32
                or len({n.eps for n in norms}) != 1):
            return
        dtype = weights[0].dtype
        kernel = dispatch.layer_kernel(weights[0].packed.device, dtype)
        if kernel is None:
            return

        def packed(lin: Linear):
            w = lin.weight
            return kernel.Packed(w.packed, w.qtype_id, *w.shape, w.int8)

        opt = lambda n: None if n is None else n.weight  # noqa: E731
        self.kernel = kernel
        self.fused = kernel.DecoderLayer(
            [packed(lin) for lin in qkv], packed(attn.o_proj), [packed(lin) for lin in gate_up],
            packed(mlp.down), self.input_norm.weight, self.pre_mlp_norm.weight, opt(self.post_attn_norm),
            opt(self.post_mlp_norm), opt(attn.q_norm), opt(attn.k_norm), self.input_norm.eps, attn.num_heads,
            attn.num_kv_heads, attn.head_dim, attn.window or 0, ops.ACT_IDS[mlp.activation], attn.scale)
        self.fused_dtype = dtype

    def forward(self, h: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Updates the residual stream h in place and returns it."""
        tp = self.tp
        if self.fused is not None and h.dtype == self.fused_dtype:
            args = ctx.backend.kernel_args(self.attn.layer, h.dtype)
            if args is not None:
                cos, sin = self.attn.rotary.cos_sin(ctx)
                if tp is None:
                    return self.fused.forward(h, cos, sin, *args)
                a = tp.all_reduce_(self.fused.attention(h, cos, sin, *args))
                return self.fused.residual(h, tp.all_reduce_(self.fused.feed_forward(h, a)))
        a = self.attn(self.input_norm(h), ctx)
        if tp is not None:
            tp.all_reduce_(a)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        n = self.pre_mlp_norm
        m = self.mlp(ops.add_rms_norm(h, a, n.weight, n.eps))  # h += a
        if tp is not None:
            tp.all_reduce_(m)
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return h.add_(m)
