"""`minerva serve A B C` / `--models-dir`: the command line of a server of several models
(`router`): which models, under which names, and its flags."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import minerva.hub as hub
from minerva.engine.engine import FIT
from minerva.errors import MinervaError, not_a_file
from minerva.formats.gguf import GGUFFile, split_parts
from minerva.models.fit import RUNTIME, available_memory, weight_bytes
from minerva.llm import parse_device, resolve_dtype
from minerva.options import engine_options
from minerva.serve.router import Router
from minerva.serve.server import bind, serve_models
from minerva.serve.serving import ServerConfig
from minerva.models.loader import read_config
from minerva.store import DEFAULT_MODEL, KNOWN_MODELS, model_names, pull, resolve, utf8


def serve_several(args, load) -> int:
    """`minerva serve A B ...` (and `--models-dir`): every model behind one server, each loaded on
    its first request by `load(model)`."""
    if args.served_model_name:
        raise MinervaError("--served-model-name names one model; with several, each is served under its "
                           "name as given (a file by its stem)")
    if (getattr(args, "tensor_parallel_size", None) or 1) > 1:
        raise MinervaError("--tensor-parallel-size serves one model; give one MODEL")
    keep_alive = check_flags(args)
    models = list(args.model) + (models_in(args.models_dir) if args.models_dir else [])
    if args.allow_pull:  # the pulled ones too (none given: the default model first), as Ollama serves its store
        models = models or [DEFAULT_MODEL]
        models += [m for m in model_names() if m not in {served_name(m) for m in models}]
    for model in models:
        check_model(model)
    if args.kv_cache_memory is None:  # each model that may be loaded at once fits beside the others
        args.kv_cache_memory = FIT / (args.max_loaded_models if args.allow_pull
                                      else min(args.max_loaded_models, len(models)))
    names = [served_name(m) for m in models]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        same = [str(m) for m, n in zip(models, names) if n == twice[0]]
        if len(set(same)) == 1:
            raise MinervaError(f"the model '{same[0]}' is given twice; give each model once")
        raise MinervaError(f"the models {' and '.join(repr(m) for m in same)} would both be served as "
                           f"'{twice[0]}' (a file by its stem); serve one of them, or rename one")
    if not 0 <= args.port <= 65535:
        raise MinervaError(f"--port must be in [0, 65535], got {args.port}")
    config = ServerConfig(names[0], api_key=args.api_key, max_waiting=args.max_waiting,
                          shutdown_timeout=args.shutdown_timeout, header_timeout=args.header_timeout,
                          body_timeout=args.body_timeout, max_connections=args.max_connections,
                          allowed_origins=args.allowed_origins)
    engine_options(args)  # a bad engine flag fails now, not at the first request
    sock = bind(args.host, args.port)
    device = parse_device(args.device)
    # loaded on a worker thread, which takes the thread count the load sets for the engine's
    router = Router(list(zip(names, models)), lambda m: (load(m), torch.get_num_threads()), config,
                    keep_alive=keep_alive, max_loaded=args.max_loaded_models,
                    available=lambda: available_memory(device), need=lambda m: need(m, args, device),
                    check=lambda m: read_config(resolve(m)), fetch=lambda m: pull(m, progress=False),
                    allow_pull=args.allow_pull)
    serve_models(router, config, sock, log_level=args.log_level)
    return 0


def need(model: str, args, device) -> int:
    """The memory a model will take, as the check before its load reads it (weights and runtime);
    0 for one not here yet or not readable (its load will say why)."""
    try:
        dtype = getattr(torch, resolve_dtype(args.dtype, device))
        return weight_bytes(resolve(model, auto_pull=False), dtype, args.quantize) + RUNTIME
    except Exception:
        return 0


def add_flags(parser) -> None:
    """`minerva serve`'s flags for a server of several models."""
    parser.add_argument("--keep-alive", default="5m", metavar="DURATION",
                        help="with several models: how long a model stays loaded after its last request "
                             "(seconds, or 30s / 5m / 1h; 0 unloads at once, -1 never; default 5m)")
    parser.add_argument("--models-dir", default=None, metavar="DIR",
                        help="serve every model in DIR too (its .gguf files and Hugging Face model folders), each "
                             "by its name without the extension, beside the MODELs given (none given: DIR's alone)")
    parser.add_argument("--allow-pull", action="store_true",
                        help="let clients add models with Ollama's /api/pull (built-in names and Hugging Face "
                             "repos, fetched into the model store or the Hugging Face cache); serves the pulled "
                             "models (`minerva list`) too, as a server of several")
    parser.add_argument("--max-loaded-models", type=int, default=3, metavar="N",
                        help="with several models: how many may be loaded at once; the least recently used idle "
                             "one makes room (default 3)")


def is_several(args) -> bool:
    """Whether `minerva serve` runs a server of several models."""
    return len(args.model) > 1 or bool(args.models_dir) or bool(getattr(args, "allow_pull", False))


def check_flags(args) -> float | None:
    """The several-model flags, checked whatever the number of models; returns --keep-alive's seconds."""
    if not isinstance(args.max_loaded_models, int) or args.max_loaded_models < 1:
        raise MinervaError(f"--max-loaded-models must be an integer >= 1, got {args.max_loaded_models}")
    one = "serve one model with it" + (" (without --allow-pull, which serves several)"
                                       if getattr(args, "allow_pull", False) else "")
    if args.lora and is_several(args):
        raise MinervaError(f"--lora adapts one base model: {one} (several models and adapters in one server are "
                           "not supported yet)")
    if args.chat_template is not None and is_several(args):
        raise MinervaError(f"--chat-template replaces one model's template: {one} (models differ in their "
                           "templates)")
    if args.generation_config not in ("auto", "none") and is_several(args):
        raise MinervaError(f"--generation-config DIR gives one model's sampling defaults: {one}, or give auto or "
                           "none")
    return parse_duration(args.keep_alive, "--keep-alive")


def parse_lora(items: list[str] | None) -> dict[str, str]:
    """--lora NAME=PATH ... -> {NAME: PATH}, a one-line error for a malformed or repeated one."""
    out: dict[str, str] = {}
    for item in items or []:
        name, eq, path = item.partition("=")
        if not eq or not name.strip() or not path.strip():
            raise MinervaError(f"--lora takes NAME=PATH (the adapter's model id, then its folder or Hugging Face "
                               f"repo), got '{item}'")
        if name in out:
            raise MinervaError(f"--lora names '{name}' twice; give each adapter a name of its own")
        out[name.strip()] = path.strip()
    return out


def check_model(model: str) -> None:
    """A model argument that can never load fails at start: neither a file or folder here, a
    built-in name nor a Hugging Face repo."""
    if Path(model).expanduser().exists() or model in KNOWN_MODELS or hub.parse(model) is not None:
        return
    raise MinervaError(f"'{model}' is neither a file or folder here, a built-in model ({', '.join(KNOWN_MODELS)}) "
                       "nor a Hugging Face repo (OWNER/REPO[:QUANT]); check the name")


def models_in(folder: str) -> list[str]:
    """The models in a folder: its GGUF files (a split one by its first part) and its Hugging
    Face model folders (config.json and *.safetensors), by name."""
    root = Path(folder).expanduser().absolute()  # the files' paths are /v1/models' `root` before they load
    if not root.is_dir():
        raise MinervaError(f"--models-dir '{folder}' is not a folder")
    found = [p for p in sorted(root.iterdir()) if (p.suffix.lower() == ".gguf" and p.is_file()
                                                   and (split_parts(p) or [p])[0] == p)
             or (p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors")))]
    for p in sorted(root.iterdir()):  # named .gguf, but no file to read
        if p.suffix.lower() == ".gguf" and not p.is_file() and not (p / "config.json").is_file():
            print(f"minerva: skipping '{p.name}' in --models-dir: it {not_a_file(p)}", file=sys.stderr)
    for p in [p for p in found if not utf8(p.name)]:  # clients could not name it
        print(f"minerva: skipping {os.fsencode(p)!r} in --models-dir: its name is not valid UTF-8; rename it",
              file=sys.stderr)
        found.remove(p)
    for p in [p for p in found if p.is_file()]:  # a file that is no GGUF model is not offered to clients
        try:
            GGUFFile(p)
        except MinervaError as exc:
            print(f"minerva: skipping '{p.name}' in --models-dir: {exc}", file=sys.stderr)
            found.remove(p)
    if not found:
        raise MinervaError(f"--models-dir '{folder}' holds no .gguf file and no Hugging Face model folder")
    return [str(p) for p in found]


def served_name(model: str) -> str:
    """Clients name a model as it was given: a pulled name or a Hugging Face repo as is, a file
    or directory by its stem."""
    if ("/" not in model and not model.endswith(".gguf")) or not Path(model).expanduser().exists():
        return model
    return Path(model).stem


def parse_duration(text: str, flag: str) -> float | None:
    """Seconds from `90`, `30s`, `5m`, `1h`; None (forever) for a negative one."""
    units = {"s": 1, "m": 60, "h": 3600}
    t = str(text).strip().lower()
    try:
        seconds = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise MinervaError(f"{flag} must be seconds or a duration such as 30s, 5m or 1h (-1: never), "
                           f"got {text!r}") from None
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise MinervaError(f"{flag} must be a finite duration, got {text!r}")
    return None if seconds < 0 else seconds
