"""A tokenizer from a Hugging Face model directory: `tokenizer.json` runs as it is in the
`tokenizers` library; the configs around it say which ids are BOS/EOS, whether to add
them, and the chat template."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import tokenizers

from minerva.errors import MinervaError

log = logging.getLogger("minerva")


def hf_tokenizer_args(path: str | Path) -> dict[str, Any]:
    """The `Tokenizer` arguments (backend included) of a Hugging Face model directory:
    tokenizer.json, with tokenizer_config.json, generation_config.json and config.json
    for the special tokens and the chat template."""
    path = Path(path)
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise MinervaError(f"{path}: no tokenizer.json in the model directory")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tj))
    except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
        raise MinervaError(f"{tj}: cannot load tokenizer: {str(e).splitlines()[0] if str(e) else e}") from None
    # a truncation or padding block saved in the file is a training-time setting (transformers
    # turns both off too): a prompt is neither cut nor padded
    backend.no_truncation()
    backend.no_padding()

    config = _read_json(path / "tokenizer_config.json")
    gen = _read_json(path / "generation_config.json")
    model_config = _read_json(path / "config.json")

    def token_of(value: Any) -> int | None:
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return backend.token_to_id(value)
        return None

    vocab = backend.get_vocab_size(with_added_tokens=True)
    files = {"generation_config.json": gen, "config.json": model_config}
    bos = token_of(config.get("bos_token"))
    eos = token_of(config.get("eos_token"))
    for name, source in files.items():
        if bos is None:
            bos = next(iter(_token_ids(path / name, source, "bos_token_id", vocab)), None)
    extra_eos: list[int] = []
    for name, source in files.items():
        extra_eos += _token_ids(path / name, source, "eos_token_id", vocab)
    if eos is None and extra_eos:
        eos = extra_eos[0]

    template = _chat_template_from_config(path, config)

    # Does the post-processor already add BOS/EOS?
    probe = backend.encode("a", add_special_tokens=True).ids
    plain = backend.encode("a", add_special_tokens=False).ids
    adds_bos = bos is not None and len(probe) > len(plain) and probe[0] == bos
    adds_eos = eos is not None and len(probe) > len(plain) and probe[-1] == eos
    want_bos = config.get("add_bos_token")
    want_eos = config.get("add_eos_token")
    add_bos = bool(want_bos) and not adds_bos
    add_eos = bool(want_eos) and not adds_eos

    architecture = model_config.get("model_type")
    pieces = _byte_fallback_pieces(backend)
    return dict(
        backend=backend,
        bos_token_id=bos,
        eos_token_id=eos,
        extra_eos_ids=extra_eos,
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=template,
        architecture=architecture,
        backend_adds_special=True,
        unk_token_id=token_of(config.get("unk_token")),
        pad_token_id=token_of(config.get("pad_token")),
        **(pieces or {}),
    )


def _token_ids(path: Path, source: dict, key: str, vocab: int) -> list[int]:
    """The ids a JSON file gives under `key` (one, or a list); one that is no token of the
    vocabulary (not an integer, or outside it) is a warning and left out."""
    value = source.get(key)
    ids = []
    for v in value if isinstance(value, list) else [] if value is None else [value]:
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab:
            ids.append(v)
        else:
            log.warning("%s: %s %s is no token id of this vocabulary (0 to %d); left out", path, key,
                        json.dumps(v)[:40], vocab - 1)
    return ids


def _byte_fallback_pieces(backend: tokenizers.Tokenizer) -> dict | None:
    """For a tokenizer.json whose decoder is SentencePiece-style byte fallback
    (Replace U+2581 -> " ", ByteFallback, Fuse, optionally Strip one leading
    space), the byte table `Tokenizer` decodes with; None for any other decoder,
    which then decodes through `tokenizers` as it is."""
    try:
        decoder = json.loads(backend.decoder.__getstate__())
    except Exception:  # noqa: BLE001 - no decoder, or one that does not serialize
        return None
    steps = decoder.get("decoders") if decoder.get("type") == "Sequence" else None
    if not steps:
        return None
    kinds = [d.get("type") for d in steps]
    strip = kinds[-1] == "Strip"
    if strip:
        last = steps[-1]
        if (last.get("content"), last.get("start"), last.get("stop")) != (" ", 1, 0):
            return None
        kinds = kinds[:-1]
    if kinds != ["Replace", "ByteFallback", "Fuse"]:
        return None
    replace = steps[0]
    if replace.get("pattern") != {"String": "\u2581"} or replace.get("content") != " ":
        return None
    n = backend.get_vocab_size(with_added_tokens=True)
    special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    pieces: list[bytes] = []
    for i in range(n):
        tok = backend.id_to_token(i)
        if tok is None:
            pieces.append(b"")
        elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">") and i not in special_ids:
            try:
                pieces.append(bytes([int(tok[3:5], 16)]))
            except ValueError:
                pieces.append(tok.replace("\u2581", " ").encode("utf-8"))
        else:
            pieces.append(tok.replace("\u2581", " ").encode("utf-8"))
    return {
        "pieces": pieces,
        "special": [i in special_ids for i in range(n)],
        "strip_leading_space": strip,
        "vocab_size": n,
    }


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise MinervaError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _chat_template_from_config(path: Path, config: dict) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise MinervaError(f"{jinja}: cannot read the chat template ({e})") from None
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        value = named.get("default") or next(iter(named.values()), None)
        return value if isinstance(value, str) else None
    return None
