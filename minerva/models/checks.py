"""What a model file's metadata must agree with in its own tensors, checked before anything is
built: the vocabulary (token_embd's rows, the tokenizer's tokens, the special token ids), the
layer count (the layers the tensors hold) and each tensor's shape (the sizes it comes from)."""

from __future__ import annotations

import logging

from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile
from minerva.formats.tokenizer_gguf import check_token_ids
from minerva.models.architectures import check_shape
from minerva.models.config import ModelConfig

# Config fields that tensor shapes come from, named in a shape mismatch's error.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                "num_experts", "expert_intermediate_size")


def check_vocabulary(f: GGUFFile) -> None:
    """One token per row of token_embd.weight, as `<arch>.vocab_size` says where the file has
    it, and every special token id (BOS, EOS, padding, ...) a token of that vocabulary."""
    rows, tokens = f.tensors["token_embd.weight"].shape[0], f.metadata.get("tokenizer.ggml.tokens")
    stated = f.get("vocab_size")
    if stated is not None and stated != rows:
        raise MinervaError(f"'{f.path}': {f.architecture}.vocab_size = {stated!r} does not match the {rows} rows "
                           f"of token_embd.weight (allowed: {rows}); the file is corrupt")
    if not isinstance(tokens, list):
        return  # no tokenizer, or one of the wrong type: the tokenizer says which
    if len(tokens) != rows:
        raise MinervaError(f"'{f.path}': tokenizer.ggml.tokens has {len(tokens)} tokens but token_embd.weight "
                           f"has {rows} rows (allowed: one token per row); the file is corrupt")
    try:
        check_token_ids(f.metadata, rows)
    except MinervaError as exc:
        raise MinervaError(f"'{f.path}': {exc}") from None


def check_value_length(f: GGUFFile, head_dim: int) -> None:
    """Values of the key size: a file whose `<arch>.attention.value_length` says otherwise holds a
    kind of attention the architectures here do not have."""
    stated = f.get("attention.value_length")
    if stated is not None and stated != head_dim:
        raise MinervaError(f"'{f.path}': {f.architecture}.attention.value_length = {stated!r} differs from the "
                           f"head size {head_dim} (attention.key_length); heads whose values differ in size from "
                           f"their keys are not supported")


def check_layers(names, prefix: str, config: ModelConfig, keys: dict[str, str], source: str) -> None:
    """The layer count against the layers the tensors hold (`<prefix><i>.*`): each of
    0..count-1 present, none past it."""
    held = {int(i) for i in (n[len(prefix):].partition(".")[0] for n in names if n.startswith(prefix))
            if i.isdigit()}
    n, key = config.num_layers, keys.get("num_layers", "num_layers")
    past, missing = sorted(held - set(range(n))), sorted(set(range(n)) - held)
    if past or missing:
        layer, what = (past[-1], "there are tensors") if past else (missing[0], "there are no tensors")
        holds = f"{len(held)} layers, the last {max(held)}" if held else "no layers"
        raise MinervaError(f"{source}: {key} = {n}, but {what} of layer {layer} ({prefix}{layer}.*); "
                           f"{key} must be the count of layers the tensors hold, each of 0..count-1 present "
                           f"(they hold {holds}); the file is corrupt")


def check_shape_of(name: str, file_name: str, shape: tuple[int, ...], config: ModelConfig, keys: dict[str, str],
                 source: str) -> None:
    """`check_shape`, its error naming the metadata the expected shape comes from."""
    try:
        check_shape(name, file_name, shape, config, source)
    except MinervaError as exc:
        given = ", ".join(f"{keys.get(k, k)} = {getattr(config, k)}" for k in SHAPE_FIELDS if getattr(config, k))
        raise MinervaError(f"{exc} (from {given})") from None


def warn_unused(path, unused: list[str], architecture: str) -> None:
    """A warning naming the file's tensors the model did not read: a file of another
    architecture than it says loads, and answers garbage, without a word otherwise."""
    if unused:
        logging.getLogger("minerva").warning(
            "'%s': %d of its tensors are not used by a %s model (%s%s): the file may be of another architecture "
            "than it says, and its answers wrong", path, len(unused), architecture, ", ".join(unused[:3]),
            ", ..." if len(unused) > 3 else "")
