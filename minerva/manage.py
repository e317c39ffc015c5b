"""Model management, as Ollama's commands do it: `minerva show` (what a model is), `minerva rm`
(remove a pulled model) and `minerva ps` (what a running server is serving, read from its own
`/v1/models` and `/metrics`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

import minerva.hub as hub
from minerva.errors import MinervaError
from minerva.formats.gguf import GGUFFile
from minerva.formats.generation import describe, sampling_defaults
from minerva.formats.safetensors import SafeTensorsDir
from minerva.models.loader import read_config
from minerva.serve.registry import urls
from minerva.store import KNOWN_MODELS, hash_file, list_models, resolve, store_root


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    path: Path
    architecture: str
    parameters: int
    context_length: int
    layers: int
    heads: str  # "9 (3 KV)"
    quantization: str  # what the file calls its mix
    tensor_types: dict[str, tuple[int, float]]  # type -> (tensors, share of the parameters)
    chat_template: str | None
    size: int  # bytes on disk
    sha256: str
    sampling: dict = dataclasses.field(default_factory=dict)  # the model's own sampling defaults

    @property
    def kind(self) -> str:
        return ("instruct (it has a chat template)" if self.chat_template
                else "base (no chat template: `minerva generate --raw` completes text; chat uses a generic template)")


def model_info(model: str) -> ModelInfo:
    """What `minerva show` prints about `model` (a pulled name, a .gguf file or a Hugging Face
    directory); a pulled model is never pulled again here."""
    pulled = {e.name: e.path for e in list_models()}
    path = pulled[model] if model in pulled and not Path(model).exists() else resolve(model, auto_pull=False)
    config = read_config(path)
    if path.is_dir():
        d = SafeTensorsDir(path)
        counts: Counter = Counter()
        numels: Counter = Counter()
        for name in d.tensor_names():
            dtype, shape = d.dtype_and_shape(name)
            counts[dtype] += 1
            numels[dtype] += int(np.prod(shape))
        template = _hf_template(path)
        files = sorted(path.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        digest = "; ".join(f"{f.name} {hash_file(f)}" for f in files)
        quant = max(numels, key=numels.get) if numels else "unknown"
    else:
        f = GGUFFile(path)
        counts, numels = Counter(), Counter()
        for t in f.tensors.values():
            counts[t.qtype.name] += 1
            numels[t.qtype.name] += int(np.prod(t.shape))
        template = f.metadata.get("tokenizer.chat_template")
        size = f.size
        digest = _pulled_sha256(path) or "; ".join(f"{p.name} {hash_file(p)}" if len(f.paths) > 1 else hash_file(p)
                                                   for p in f.paths)
        quant = f.file_type_name
    total = sum(numels.values())
    types = {k: (counts[k], numels[k] / total if total else 0.0) for k in sorted(numels, key=numels.get, reverse=True)}
    return ModelInfo(path, config.architecture, total, config.max_position, config.num_layers,
                     f"{config.num_heads} ({config.num_kv_heads} KV)", quant, types,
                     template if isinstance(template, str) and template else None, size, digest,
                     sampling_defaults(path))


def _hf_template(path: Path) -> str | None:
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) else None


def _pulled_sha256(path: Path) -> str | None:
    """The recorded sha256 of a file pulled into the store (checked against the known models' at pull)."""
    try:
        manifest = json.loads((path.parent / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest.get("sha256") if manifest.get("file") == path.name else None


def show_text(info: ModelInfo, template: bool = False) -> str:
    mix = ", ".join(f"{k} {share:.1%} ({n} tensor{'s' if n > 1 else ''})"
                    for k, (n, share) in info.tensor_types.items())
    lines = [
        f"  architecture    {info.architecture}",
        f"  parameters      {info.parameters / 1e9:.2f}B" if info.parameters >= 1e9
        else f"  parameters      {info.parameters / 1e6:.1f}M",
        f"  kind            {info.kind}",
        f"  context length  {info.context_length}",
        f"  layers          {info.layers}, heads {info.heads}",
        f"  quantization    {info.quantization}: {mix}",
        f"  chat template   {len(info.chat_template)} characters (`--template` prints it)" if info.chat_template
        else "  chat template   none",
        f"  sampling        {describe(info.sampling) or 'no defaults of its own'}",
        f"  file            {info.path} ({info.size / 1e6:.1f} MB)",
        f"  sha256          {info.sha256}",
    ]
    if template and info.chat_template:
        lines += ["", info.chat_template]
    return "\n".join(lines)


def remove(name: str) -> Path:
    """Delete the pulled model `name` from the store, or a Hugging Face repo (`OWNER/REPO`, or
    one quant of it: `OWNER/REPO:QUANT`) from the Hugging Face cache; returns what was removed."""
    ref = hub.parse(name) if name not in KNOWN_MODELS else None
    if ref is not None:
        return hub.remove(ref)
    pulled = {e.name: e for e in list_models()}
    if name not in pulled:
        hint = f"pulled: {', '.join(pulled)}" if pulled else "nothing is pulled"
        what = "a known model that is not pulled" if name in KNOWN_MODELS else "not a pulled model"
        raise MinervaError(f"'{name}' is {what} ({hint}); `minerva list` shows the store")
    directory = pulled[name].path.parent
    if directory.is_symlink() or directory.resolve().parent != store_root().resolve():
        raise MinervaError(f"'{directory}' is not a folder of the model store {store_root()}; not removed")
    try:
        shutil.rmtree(directory)
    except OSError as exc:
        raise MinervaError(f"could not remove '{directory}': {exc.strerror}") from None
    return directory


# ------------------------------------------------------------------ ps


def server_status(url: str, api_key: str | None = None, timeout: float = 5.0) -> list[dict]:
    """What the server at `url` serves: per model name its context, the requests running and
    waiting, and its KV-cache use, from its /v1/models and /metrics."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=timeout)
        metrics = httpx.get(f"{url}/metrics", headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise MinervaError(f"no Minerva server answers at {url} ({exc}); start one with `minerva serve`, "
                           f"or give --host/--port") from None
    if 401 in (models.status_code, metrics.status_code):
        raise MinervaError(f"the server at {url} wants an API key: give --api-key" if not api_key else
                           f"the server at {url} refuses the API key given (--api-key)")
    try:
        cards = models.json()["data"]
        families = {f.name: f for f in text_string_to_metric_families(metrics.text)}
    except (ValueError, KeyError, TypeError):
        raise MinervaError(f"the server at {url} is not a Minerva server (no /v1/models and /metrics)") from None

    def value(name: str, model: str) -> float | None:
        family = families.get(f"minerva:{name}")
        samples = [s.value for s in family.samples if s.labels.get("model_name") == model] if family else []
        return samples[0] if samples else None

    primary = cards[0]["id"] if cards else None  # one model's aliases: its metrics carry the first name
    metrics = (("running", "num_requests_running"), ("waiting", "num_requests_waiting"),
               ("kv_usage", "kv_cache_usage_perc"), ("kv_blocks", "kv_cache_used_blocks"))
    rows = []
    for card in cards:  # a server of several models labels each with its own name
        loaded = card.get("loaded", True)
        name = card["id"] if value("num_requests_running", card["id"]) is not None else primary
        state = {key: value(metric, name) if loaded else None for key, metric in metrics}
        rows.append({"name": card["id"], "root": card.get("root"), "max_model_len": card.get("max_model_len"),
                     "loaded": loaded, **state})
    return rows


def ps_text(rows: list[dict], url: str) -> str:
    if not rows:
        return f"the server at {url} serves no model"

    def num(x, fmt="{:.0f}"):
        return "-" if x is None else fmt.format(x)

    w = max(24, *(len(r["name"]) for r in rows))
    lines = [f"{'NAME':<{w}} {'LOADED':>6} {'CONTEXT':>8} {'RUNNING':>8} {'WAITING':>8} {'KV USED':>9}  MODEL"]
    for r in rows:
        kv = "-" if r["kv_usage"] is None else f"{r['kv_usage']:.1%}"
        lines.append(f"{r['name']:<{w}} {'yes' if r.get('loaded', True) else 'no':>6} {num(r['max_model_len']):>8} "
                     f"{num(r['running']):>8} {num(r['waiting']):>8} {kv:>9}  {r['root'] or '-'}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the commands


def cmd_show(args) -> int:
    print(show_text(model_info(args.name), template=args.template))
    return 0


def cmd_rm(args) -> int:
    """Remove each name given; one that cannot be is said (on stderr) and the rest still go."""
    failed = 0
    for name in args.names:
        try:
            print(f"removed {name} ({remove(name)})")
        except MinervaError as exc:
            print(f"minerva: error: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def cmd_ps(args) -> int:
    """Every server running here (as each recorded itself), or the one at --host/--port."""
    if args.port is not None and not 0 < args.port <= 65535:
        raise MinervaError(f"--port must be in [1, 65535], got {args.port}")
    found = urls(args.host, args.port)
    for i, url in enumerate(found):
        if len(found) > 1:
            print(("\n" if i else "") + url)
        print(ps_text(server_status(url, args.api_key), url))
    return 0


def add_parsers(sub) -> None:
    """`show`, `rm` and `ps` on the `minerva` command's subparsers."""
    p = sub.add_parser("show", help="what a model is: architecture, parameters, quantization mix, context, "
                                    "chat template, file and sha256")
    p.add_argument("name", metavar="MODEL", help="a pulled name, a .gguf file, a Hugging Face directory or a "
                                                 "repo in the Hugging Face cache (OWNER/REPO[:QUANT])")
    p.add_argument("--template", action="store_true", help="also print the whole chat template")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("rm", help="remove pulled models from the model store, or repos (OWNER/REPO[:QUANT]) "
                                  "from the Hugging Face cache")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("ps", help="what a running `minerva serve` is serving: requests and KV-cache use")
    p.add_argument("--host", default=None,
                   help="the server's address (default: every server running here, else 127.0.0.1)")
    p.add_argument("--port", type=int, default=None,
                   help="the server's port (default: every server running here, else 8000)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.set_defaults(func=cmd_ps)
