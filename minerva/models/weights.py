"""The interface model files build from: weights by canonical name.

Canonical names are format-neutral (`layers.3.q_proj`, `embed_tokens`, ...); the
loader translates file names into them, so model files never see GGUF or
SafeTensors naming.
"""

from __future__ import annotations

from typing import Protocol

import torch

from minerva.kernels.weights import Weight


class WeightSource(Protocol):
    def has(self, name: str) -> bool: ...

    def weight(self, name: str) -> Weight:
        """A matrix for a Linear or an embedding, in whatever format it was stored."""

    def experts(self, name: str) -> list[Weight]:
        """One matrix per expert (`layers.3.experts.gate_proj`: expert e's gate projection is
        item e), however the file stores them (one 3-D tensor, or a tensor per expert)."""

    def expert_biases(self, name: str) -> list[torch.Tensor] | None:
        """Each expert's bias for the matrices `experts(name)` gives, or None without biases."""

    def tensor(self, name: str) -> torch.Tensor:
        """A small float tensor (norm weights, rope factors) on the model's device."""
