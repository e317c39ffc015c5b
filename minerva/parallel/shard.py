"""Which part of every weight a tensor-parallel rank holds.

Megatron's split of a decoder layer: Q/K/V and gate/up are column-parallel (each rank
computes its own heads and its own slice of the feed-forward), O and down row-parallel
(each rank multiplies its slice of their input and the partial outputs are all-reduced),
the embedding and the LM head split over the vocabulary. Packed GGML weights are cut
along rows, or along columns at block boundaries, as stored: never dequantized to shard.

Heads go to ranks in whole KV groups, so every rank keeps the model's query-to-KV
grouping: with at least as many KV heads as ranks each rank takes a run of KV heads (the
counts may differ by one: 3 KV heads over 2 ranks is 2 + 1), with fewer the KV heads are
replicated and each rank takes an equal share of one KV head's query heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import gguf
import torch

from minerva.errors import MinervaError
from minerva.models.config import ModelConfig

# canonical weight names by how they split (the last part of `layers.N.<name>`)
HEADS_OUT = {"q_proj"}  # output rows: this rank's query heads
KV_OUT = {"k_proj", "v_proj"}  # output rows: its KV heads
FFN_OUT = {"gate_proj", "up_proj"}  # output rows: its feed-forward slice
HEADS_IN = {"o_proj"}  # input columns: its query heads
FFN_IN = {"down_proj"}  # input columns: its feed-forward slice
VOCAB = {"embed_tokens", "lm_head"}  # rows: its part of the vocabulary


def _even(n: int, parts: int, i: int) -> tuple[int, int]:
    return i * n // parts, (i + 1) * n // parts


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    head_dim: int
    heads: tuple[int, int]  # query heads [lo, hi)
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]  # columns of the dense feed-forward
    expert_ffn: tuple[int, int]  # columns of each expert's feed-forward
    vocab: tuple[int, int]  # rows of the embedding and LM head
    vocab_per_rank: int  # the widest rank's rows: logits are gathered at this width

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config this rank's layers are built with: its own head counts."""
        return dataclasses.replace(config, num_heads=self.heads[1] - self.heads[0],
                                   num_kv_heads=self.kv_heads[1] - self.kv_heads[0])

    # ------------------------------------------------------------- slicing

    def rule(self, name: str) -> tuple[str, tuple[int, int]] | None:
        """(axis, range) of the weight `name`: axis "out" (rows), "in" (columns) or "vocab"."""
        last = name.rsplit(".", 1)[-1]
        ffn = self.expert_ffn if ".experts." in name else self.ffn
        hd = self.head_dim
        if last in HEADS_OUT:
            return "out", (self.heads[0] * hd, self.heads[1] * hd)
        if last in KV_OUT:
            return "out", (self.kv_heads[0] * hd, self.kv_heads[1] * hd)
        if last in FFN_OUT:
            return "out", ffn
        if last in HEADS_IN:
            return "in", (self.heads[0] * hd, self.heads[1] * hd)
        if last in FFN_IN:
            return "in", ffn
        if last in VOCAB:
            return "vocab", self.vocab
        return None

    def cut(self, name: str, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]
            ) -> tuple[tuple[int, int], tuple[int, int] | None, tuple[int, int]] | None:
        """Where this rank's part of the GGML matrix `name` [rows, cols] lies in its bytes:
        (rows, byte range of each row or None for whole rows, the part's shape); None when
        the rank holds it whole."""
        rule = self.rule(name)
        if rule is None or len(shape) != 2:
            return None
        axis, (lo, hi) = rule
        rows, cols = shape
        if axis != "in":
            return (lo, hi), None, (hi - lo, cols)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        if lo % block or hi % block:
            raise MinervaError(f"tensor parallelism cannot split '{name}' ({qtype.name}, blocks of {block} columns) "
                               f"at columns {lo}..{hi}; use a smaller --tensor-parallel-size")
        return (0, rows), (lo // block * size, hi // block * size), (rows, hi - lo)

    def packed(self, name: str, raw: torch.Tensor, qtype: gguf.GGMLQuantizationType,
               shape: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """This rank's part of a GGML matrix stored as bytes [rows, row bytes]: (bytes, shape)."""
        cut = self.cut(name, qtype, shape)
        if cut is None:
            return raw, shape
        (r0, r1), byte_cols, part = cut
        raw = raw.reshape(shape[0], -1)[r0:r1]
        return (raw if byte_cols is None else raw[:, byte_cols[0]:byte_cols[1]]), part

    def dense(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a float matrix [out, in]."""
        rule = self.rule(name)
        if rule is None:
            return t
        axis, (lo, hi) = rule
        return t[:, lo:hi] if axis == "in" else t[lo:hi]

    def tensor(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a vector: a bias of a split matrix ([rows] or [experts, rows]),
        or the attention sinks ([heads]). A row-parallel matrix's bias is added once, by rank 0."""
        if name.rsplit(".", 1)[-1] == "sinks":
            return t[..., self.heads[0]:self.heads[1]]
        if not name.endswith(".bias"):
            return t
        rule = self.rule(name[:-len(".bias")])
        if rule is None:
            return t
        axis, (lo, hi) = rule
        if axis == "in":
            return t if self.rank == 0 else torch.zeros_like(t)
        return t[..., lo:hi]


def plan(config: ModelConfig, rank: int, world: int) -> Shard:
    """Rank `rank`'s share of a model split `world` ways, or an error saying why it cannot be."""
    H, KV = config.num_heads, config.num_kv_heads
    group = H // KV
    why = None
    if KV >= world:
        kv = _even(KV, world, rank)
        heads = (kv[0] * group, kv[1] * group)
    elif world % KV == 0 and H % world == 0:
        per = H // world
        heads = (rank * per, (rank + 1) * per)
        kv = (heads[0] // group, heads[0] // group + 1)
    else:
        why = (f"its {H} attention heads ({KV} KV heads) do not split {world} ways "
               f"(fewer KV heads than ranks needs the ranks to be a multiple of the KV heads)")
        heads = kv = (0, 0)

    def columns(n: int, what: str) -> tuple[int, int]:
        nonlocal why
        align = next(a for a in (256, 32, 1) if n % a == 0)
        units = n // align
        if units < world and why is None:
            why = f"its {what} of {n} does not split into {world} parts of whole blocks"
        lo, hi = _even(units, world, rank)
        return lo * align, hi * align

    ffn = columns(config.intermediate_size, "feed-forward size")
    expert_ffn = columns(config.expert_ffn_size, "expert feed-forward size") if config.num_experts else ffn
    if why is not None:
        raise MinervaError(f"--tensor-parallel-size {world} cannot split this model: {why}; "
                           "choose a size that divides them")
    per = -(-config.vocab_size // world)
    vocab = (min(rank * per, config.vocab_size), min((rank + 1) * per, config.vocab_size))
    return Shard(rank, world, config.head_dim, heads, kv, ffn, expert_ffn, vocab, per)
