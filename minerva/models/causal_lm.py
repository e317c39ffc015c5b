"""The whole model: embedding, decoder layers, final norm, LM head (`CausalLM`), and the one
native call that runs a step of them where the kernels allow."""

from __future__ import annotations

import torch
from torch import nn

from minerva.kernels import repack
from minerva.kernels.weights import PackedWeight, Weight
from minerva.models.config import ModelConfig
from minerva.models.layers import AttentionContext, DecoderLayer, Layer, Linear, RMSNorm, Rotary


class CausalLM(Layer):
    """Embedding -> decoder layers -> final norm -> output projection."""

    def __init__(self, config: ModelConfig, embed: Weight, layers: list[DecoderLayer],
                 norm: RMSNorm, lm_head: Linear, embed_scale: float | None = None):
        super().__init__()
        self.config = config
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.embed_scale = embed_scale
        self.tp = None  # under tensor parallelism (see parallelize): the Comm, and this rank's vocabulary rows
        self.vocab_rows = (0, config.vocab_size)
        self.vocab_width = config.vocab_size
        self.stack = None  # (kernel, native layers, rotaries, each layer's) when every layer has one (see stack_layers)
        self.head = None  # with `stack`, the LM head as the kernel's Packed when it can join the layers' call
        self.step_args = None  # with `head`, forward_step's embedding and rotary arguments when it can take a whole step

    def parallelize(self, comm, vocab_rows: tuple[int, int], vocab_width: int) -> None:
        """Run as one rank of a tensor-parallel group: this model holds rows `vocab_rows` of
        the embedding and LM head (gathered at `vocab_width` a rank) and its share of every
        layer, whose partial outputs `comm` all-reduces."""
        self.tp, self.vocab_rows, self.vocab_width = comm, vocab_rows, vocab_width
        self.stack = self.head = self.step_args = None  # each sublayer's output is all-reduced between the layer's parts
        for layer in self.layers:
            layer.tp = comm

    def stack_layers(self) -> None:
        """When every layer is one native call, run them all as one (the kernel's
        `forward_layers`): a decode step then pays for the Python and argument conversions
        of one call instead of one per layer."""
        fused = [layer.fused for layer in self.layers]
        if not fused or any(f is None for f in fused) or len({layer.fused_dtype for layer in self.layers}) != 1:
            return
        kernel = self.layers[0].kernel
        if getattr(kernel, "forward_layers", None) is None:
            return
        rotaries = list({id(layer.attn.rotary): layer.attn.rotary for layer in self.layers}.values())
        which = [rotaries.index(layer.attn.rotary) for layer in self.layers]  # each layer's rotary
        self.stack = kernel, fused, rotaries, which
        # the final norm and the LM head join that call (forward_logits) where they are the
        # kernels `norm` and `logits` would run: a packed head on this dtype, no bias, no softcap
        w, dtype = self.lm_head.weight, self.layers[0].fused_dtype
        if (getattr(kernel, "forward_logits", None) is not None and isinstance(w, PackedWeight)
                and w.kernel is not None and w.dtype == dtype and self.lm_head.bias is None
                and isinstance(self.norm, RMSNorm) and self.norm.weight.dtype == torch.float32
                and not self.config.final_logit_softcap):
            self.head = kernel.Packed(w.packed, w.qtype_id, *w.shape, w.int8)
        # and the embedding rows and rotary tables too (forward_step) where they are what
        # `_embedded` and Rotary.cos_sin compute: a packed embedding in the GGML layout (or
        # regrouped, of a type whose rows the kernel looks up in place) with a kernel, or a
        # plain matrix, in the layers' dtype
        e = self.embed
        if isinstance(e, PackedWeight) and (e.kernel is None or e.dtype != dtype
                                            or (e.regrouped and e.qtype not in repack.LOOKUP_TYPES)):
            return
        if not isinstance(e, PackedWeight) and (e.tensor.dtype != dtype or e.tensor.dim() != 2):
            return
        if self.head is None or getattr(kernel, "forward_step", None) is None or any(type(r) is not Rotary for r in rotaries):
            return
        embed = (e.packed, e.qtype_id, e.shape[1]) if isinstance(e, PackedWeight) else (e.tensor, -1, e.tensor.shape[1])
        self.step_args = (*embed, self.embed_scale, dtype, [r.inv_freq for r in rotaries],
                          [float(r.attention_factor) for r in rotaries], which)

    def embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed.rows(input_ids)
        lo, hi = self.vocab_rows  # each rank looks up its own rows, zeros elsewhere, and the sum is exact
        local = input_ids - lo
        inside = (local >= 0) & (local < hi - lo)
        h = self.embed.rows(local.clamp(0, hi - lo - 1))
        return self.tp.all_reduce_(h.masked_fill_(~inside[:, None], 0))

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext,
                num_layers: int | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of the new tokens (after the first `num_layers` layers
        and the final norm, when given: an early exit)."""
        return self._layers(self._embedded(input_ids), ctx, len(self.layers) if num_layers is None else num_layers)

    def forward_logits(self, input_ids: torch.Tensor, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` and `logits` of every new token: (hidden states, float32 logits), the
        layers, the final norm and the LM head in one native call where the model allows
        (`head`; the same kernels in the same order, so the same bits)."""
        if self.step_args is not None and self.head is not None:
            args = ctx.backend.stack_args(len(self.layers), self.layers[0].fused_dtype)
            if args:
                hidden, logits = self.stack[0].forward_step(self.stack[1], input_ids, *self.step_args, *args,
                                                            self.norm.weight, self.norm.eps, self.head)
                return hidden, logits
        h = self._embedded(input_ids)
        args = self.head is not None and self._stack_args(h, ctx, len(self.layers))
        if args:
            hidden, logits = self.stack[0].forward_logits(*args, self.norm.weight, self.norm.eps, self.head)
            return hidden, logits
        hidden = self._layers(h, ctx, len(self.layers))
        return hidden, self.logits(hidden)

    def greedy_steps(self, steps: int, tokens: list[int], stop_ids: list[int], block_size: int, interrupt,
                     input_ids: torch.Tensor, ctx: AttentionContext) -> tuple | None:
        """Greedy decode steps after the one `input_ids` and `ctx` (views of the runner's step
        buffer, changed in place) last ran: each row's token fed in one position on, the step
        and its argmax, up to `steps` times (the native forward_steps; see its rules), or
        None where a step does not run as one native call. Returns (each step's tokens, the
        last step's hidden states, its logits)."""
        if self.step_args is None or self.head is None:
            return None
        args = ctx.backend.stack_args(len(self.layers), self.layers[0].fused_dtype)
        if not args:
            return None
        return self.stack[0].forward_steps(steps, tokens, stop_ids, block_size, interrupt, self.stack[1], input_ids,
                                           *self.step_args, *args, self.norm.weight, self.norm.eps, self.head)

    def _layers(self, h: torch.Tensor, ctx: AttentionContext, n: int) -> torch.Tensor:
        """Layers 0 .. n - 1 over the embedded tokens h (in one native call where they can),
        then the final norm."""
        args = self._stack_args(h, ctx, n)
        if args:
            return self.norm(self.stack[0].forward_layers(*args))
        for layer in self.layers[:n]:
            h = layer(h, ctx)
        return self.norm(h)

    def _embedded(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_rows(input_ids)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    def _stack_args(self, h: torch.Tensor, ctx: AttentionContext, n: int) -> tuple | None:
        """The kernel's forward_layers arguments for layers 0 .. n - 1 (every layer native, in
        h's dtype, the backend's attention kernel covering the pool), else None."""
        args = self.stack is not None and h.dtype == self.layers[0].fused_dtype and ctx.backend.stack_args(n, h.dtype)
        if not args:
            return None
        _, fused, rotaries, which = self.stack
        tables = [r.cos_sin(ctx) for r in rotaries]  # the model's one or two rotaries
        cos = [tables[i][0] for i in which[:n]]
        sin = [tables[i][1] for i in which[:n]]
        return fused[:n], h, cos, sin, *args

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [N, vocab] for the selected hidden states (under tensor parallelism
        on rank 0 only, None on the others)."""
        logits = self.lm_head(hidden)
        if self.tp is not None:
            lo, hi = self.vocab_rows
            if hi - lo < self.vocab_width:
                logits = torch.nn.functional.pad(logits, (0, self.vocab_width - (hi - lo)))
            parts = self.tp.gather(logits)
            if parts is None:
                return None
            logits = parts.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, :self.config.vocab_size]
        logits = logits.float()
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
