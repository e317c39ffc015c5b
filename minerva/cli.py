"""The `minerva` command: pull, list, show, rm, ps, generate, chat, serve, perplexity, bench, roofline, tune."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import time
from pathlib import Path

import torch

from minerva import __version__, bench, chat, manage
import minerva.hub as hub
from minerva.bench import roofline, tune
from minerva.engine.perplexity import perplexity
from minerva.errors import MinervaError
from minerva.formats.tokenizer import check_unicode
from minerva.chat import ReplyWriter
from minerva.parsers.reasoning import ReasoningParser
from minerva.kernels import dispatch
from minerva.kernels.kv_quant import resolve_format
from minerva.llm import LLM
from minerva.machine import peak_rss_mb
from minerva.options import (
    add_chat_template,
    add_model_options,
    add_reasoning_effort,
    add_sampling_options,
    check_speculative,
    engine_options,
    kv_formats,
    sampling,
)
from minerva.parallel import launch
from minerva.serve.app import ServerConfig
from minerva.serve.async_engine import on_own_thread
from minerva.serve import lenient, several
from minerva.serve.server import bind, serve
from minerva.store import DEFAULT_MODEL, KNOWN_MODELS, list_models, pull

def _looks_like_model(arg: str, bare_repos: bool = True) -> bool:
    """Whether a word is a model argument: a known name, a .gguf file, a folder, hf.co/..., and
    with `bare_repos` OWNER/REPO[:QUANT] (a served model name may well look like that)."""
    if arg in KNOWN_MODELS or arg.endswith(".gguf") or Path(arg).is_dir() or arg.lower().startswith(hub.PREFIXES):
        return True
    if Path(arg).expanduser().exists():  # a file that is not a model: a prompt file, a text to score
        return False
    try:
        return bare_repos and not any(c.isspace() for c in arg) and hub.parse(arg) is not None
    except MinervaError:  # a Hub name written wrong (a revision, an empty quant): its error is the answer
        return bare_repos and not any(c.isspace() for c in arg)


def _model_and_rest(args: list[str], what: str, rest_required: bool) -> tuple[str | None, str | None]:
    """`[MODEL] X`: one positional is X (default model), two are MODEL and X."""
    if len(args) == 2:
        return args[0], args[1]
    if len(args) == 1:
        if _looks_like_model(args[0]):
            raise MinervaError(f"'{args[0]}' looks like a model; give {what} after it")
        return None, args[0]
    if not args and not rest_required:
        return None, None
    raise MinervaError(f"expected [MODEL] {what}, got {len(args)} arguments")


def _origins(text: str) -> tuple[str, ...]:
    try:
        return lenient.parse_origins(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _load(model: str | None, args, engine: bool = True):
    options = engine_options(args) if engine else {"kv_cache_memory": 1 << 20}
    llm = LLM(model, device=args.device, kernels=args.kernels, dtype=args.dtype, threads=args.threads,
              quantize=args.quantize, activations=args.activations,
              tensor_parallel_size=getattr(args, "tensor_parallel_size", None), lora=getattr(args, "lora", None),
              chat_template=getattr(args, "chat_template", None),
              generation_config=getattr(args, "generation_config", "auto"), **options)
    c = llm.config
    stored = (f"{llm.loaded.weight_bytes / 1e6:.0f} MB of weights quantized to {args.quantize} at load"
              if args.quantize else f"{llm.loaded.weight_bytes / 1e6:.0f} MB of weights in the file")
    act = ", int8 activations" if llm.activations == "int8" else ""
    print(f"loaded {llm.path.name} ({c.architecture}, {c.num_layers} layers, {stored}, {llm.dtype_name}{act}, "
          f"{llm.loaded.compute_bytes / 1e6:.0f} MB held for compute) on {llm.device} in "
          f"{llm.loaded.load_seconds:.2f} s; peak RSS {peak_rss_mb():.0f} MB", file=sys.stderr)
    if engine:
        cached = llm.engine.blocks.cache_bytes(llm.engine.cache.nbytes)
        print(f"memory: {llm.memory.describe()} (KV pool {llm.engine.max_model_len} tokens a request at most; "
              f"pages touched as blocks are first used, finished prompts cached up to {cached / 1e6:,.0f} MB)",
              file=sys.stderr)
    if llm.group is not None:
        g = llm.group
        print(f"tensor parallel: {g.world} ranks exchanging over {g.comm.name}, "
              f"{torch.get_num_threads()} threads each; weights held per rank: "
              f"{', '.join(f'{b / 1e6:.0f} MB' for b in g.weight_bytes)}", file=sys.stderr)
    missing = dispatch.backend(llm.device).unavailable_reason
    if missing:  # say so: the reference path is several times slower
        print(f"note: Minerva's compiled kernels are unavailable ({missing}); running the plain-torch "
              f"reference path", file=sys.stderr)
    for line in device_notes(llm.device, llm.kernels, asked=args.device is not None):
        print(line, file=sys.stderr)
    return llm


class Version(argparse.Action):
    """--version: the version, then a line per kernel backend (where it runs, where it is the
    default), worked out only when asked."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"minerva {__version__}")
        for line in dispatch.describe():
            print(f"  kernels {line}")
        parser.exit()


def device_notes(device, kernels: str, asked: bool) -> list[str]:
    """What a GPU user is told at start-up: which kernels run on the GPU, or why the CPU was
    chosen though a GPU is present."""
    if device.type == "cuda":
        what = {"reference": "the plain-torch reference (dequantized weights, torch matmuls)",
                "triton": "Minerva's Triton kernels, not yet checked on a GPU"}.get(kernels, kernels)
        notes = [f"device {device}: kernels {kernels}, {what}"]
        if kernels == "reference" and dispatch.available("triton"):
            notes.append("note: --kernels triton runs Minerva's Triton kernels instead (not yet checked on a GPU)")
        return notes
    if not asked and torch.cuda.is_available():
        return ["note: a CUDA GPU is present, but no GPU backend has passed its GPU tests yet, so Minerva runs "
                "on the CPU; --device cuda runs the plain-torch reference on it (--kernels triton: the Triton "
                "kernels)"]
    return []


def _stream_one(llm, prompt, params, parser: ReasoningParser | None = None) -> None:
    start = time.perf_counter()
    first = None
    n = n_first = 0  # tokens in all, and in the first delta (a decode burst may bring several)
    finish = None
    writer = ReplyWriter(parser)
    ids, params = chat.to_the_context(llm, prompt, params)  # (`run` without -n: no cap but the context's)
    for delta in llm.stream(ids, params):
        if first is None:
            first, n_first = time.perf_counter(), len(delta.token_ids)
        n += len(delta.token_ids)
        finish = delta.finish_reason or finish
        writer.write(delta.text, end=delta.finish_reason is not None)
    end = time.perf_counter()
    sys.stdout.write("\n")
    # the tokens after the first delta, over the time since it: those that came with it took none of it
    decode = f", {(n - n_first) / (end - first):.1f} tokens/s decode" if first and n > n_first and end > first else ""
    spec = llm.engine.speculator
    if spec is not None and spec.stats.num_draft_tokens:
        decode += (f", speculative: {100 * spec.stats.acceptance_rate:.0f}% of {spec.stats.num_draft_tokens} "
                   f"guesses accepted, {spec.stats.mean_accepted_length:.2f} tokens/step")
    print(f"[{n} tokens, finish={finish}, first token {((first or end) - start) * 1e3:.0f} ms{decode}]",
          file=sys.stderr)


def cmd_pull(args) -> int:
    path = pull(args.name, verify=args.verify)
    print(path)
    return 0


def cmd_list(args) -> int:
    entries = list_models()
    if not entries:
        print(f"no models pulled yet; try `minerva pull {next(iter(KNOWN_MODELS))}` "
              f"(known: {', '.join(KNOWN_MODELS)})")
        return 0
    w = max(16, *(len(e.name) for e in entries))
    print(f"{'NAME':<{w}} {'ARCH':<8} {'QUANT':<8} {'KIND':<9} {'SIZE':>9}  PATH")
    for e in entries:
        kind = {True: "instruct", False: "base", None: "?"}[e.instruct]
        size = f"{e.size / 1e9:>7.2f}GB" if e.size >= 1e9 else f"{e.size / 1e6:>7.1f}MB"
        print(f"{e.name:<{w}} {e.architecture:<8} {e.quantization:<8} {kind:<9} {size}  {e.path}")
    return 0


def _one_model(args, positional: list[str], what: str) -> str | None:
    """The MODEL argument or --model (one of them at most)."""
    if len(positional) > 1:
        raise MinervaError(f"{what} takes at most one MODEL argument")
    if args.model_flag is not None and positional:
        raise MinervaError(f"give the model once: as the MODEL argument ('{positional[0]}') or --model "
                           f"('{args.model_flag}')")
    return args.model_flag if args.model_flag is not None else (positional[0] if positional else None)


def _with_model_flag(args, rest: str) -> list[str]:
    """`[MODEL] REST` positionals, with --model (if given) as the MODEL."""
    if args.model_flag is None:
        return list(args.args)
    if len(args.args) > 1:
        raise MinervaError(f"with --model, give only {rest} (got {len(args.args)} arguments)")
    return [args.model_flag] + list(args.args)


def cmd_generate(args) -> int:
    words = _with_model_flag(args, '"PROMPT"')
    flagged = args.model_flag is not None
    for flag, what in (("system", "is a message for the chat template"), ("chat_template", "renders chats")):
        if args.raw and getattr(args, flag, None) is not None:
            raise MinervaError(f"--{flag.replace('_', '-')} {what}, and --raw leaves the chat template out; drop "
                               "one of them")
    if not sys.stdin.isatty() and (not words or (len(words) == 1 and (flagged or _looks_like_model(words[0])))):
        model, prompt = (words or [None])[0], sys.stdin.read()  # the prompt piped in
    elif flagged and len(words) == 1:
        raise MinervaError('the prompt is empty; give one: minerva generate --model MODEL "PROMPT", or pipe it in')
    else:
        model, prompt = _model_and_rest(words, '"PROMPT"', rest_required=True)
    if not prompt.strip():
        raise MinervaError('the prompt is empty; give one: minerva generate [MODEL] "PROMPT", or pipe it in')
    check_unicode(prompt)  # before the load, and counting in the prompt given rather than the templated one
    sampling(args)  # checked before the model loads
    llm = _load(model, args)
    if not args.raw:
        _cap_a_base_model(llm, args)
    params = sampling(args, llm.sampling_defaults)
    if args.raw:
        _stream_one(llm, prompt, params)
        return 0
    messages = [{"role": "system", "content": args.system}] if args.system else []
    prompt = llm.apply_chat_template(messages + [{"role": "user", "content": prompt}],
                                     **_template_variables(args))
    _stream_one(llm, prompt, llm.chat_params(params), llm.reasoning.parser(prompt) if llm.reasoning else None)
    return 0


def _cap_a_base_model(llm: LLM, args) -> None:
    """A model with no chat template of its own (a base model, chatting in the built-in one)
    seldom ends a reply: without -n (or the model's max_new_tokens), its replies stop at 256
    tokens, not at the context, and a line says so."""
    if llm.built_in_template and args.max_tokens is None and "max_tokens" not in llm.sampling_defaults:
        args.max_tokens_fallback = min(getattr(args, "max_tokens_fallback", 256), 256)
        print(f"minerva: {llm.path.name} has no chat template of its own (a base model, not tuned to chat), so its "
              f"replies may not end: each stops at {args.max_tokens_fallback} tokens (give -n for more, or --raw to "
              "complete text)", file=sys.stderr)


def _template_variables(args) -> dict:
    return {"reasoning_effort": args.reasoning_effort} if args.reasoning_effort else {}


def cmd_chat(args) -> int:
    model = _one_model(args, args.model, "chat")
    sampling(args)  # checked before the model loads
    llm = _load(model, args)
    _cap_a_base_model(llm, args)
    params = sampling(args, llm.sampling_defaults)
    return chat.chat(llm, llm.chat_params(params), args.system, _template_variables(args))


def cmd_run(args) -> int:
    """Ollama's `run`: MODEL alone (or nothing) on a terminal chats; with a PROMPT (or one
    piped in) it answers that and ends."""
    words = list(args.args)
    chats = sys.stdin.isatty() and (not words or (len(words) == 1 and args.model_flag is None
                                                 and _looks_like_model(words[0])))
    if chats:
        args.model = words
        return cmd_chat(args)
    return cmd_generate(args)


def cmd_serve(args) -> int:
    check_speculative(args)  # now, not when a model first loads (several models load on their first request)
    several.check_flags(args)
    if several.is_several(args):
        return several.serve_several(args, lambda m: _load(m, args))
    args.lora = several.parse_lora(args.lora)
    model = _one_model(args, args.model, "serve")
    for name in (args.served_model_name or []) if model is None else []:
        if _looks_like_model(name, bare_repos=False) or Path(name).is_file():
            raise MinervaError(f"'{name}' after --served-model-name looks like the model; put MODEL before "
                               f"--served-model-name (its names take every word after it)")
    if not 0 <= args.port <= 65535:
        raise MinervaError(f"--port must be in [0, 65535], got {args.port}")
    # Checked before the model loads, so a bad flag fails at once.
    names = args.served_model_name or []
    config = ServerConfig(names[0] if names else "?", aliases=tuple(names[1:]), api_key=args.api_key,
                          max_waiting=args.max_waiting, shutdown_timeout=args.shutdown_timeout,
                          header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                          max_connections=args.max_connections, allowed_origins=args.allowed_origins)
    ranked = launch.torchrun_rank()  # under torchrun only rank 0 serves; the other ranks never return from _load
    sock = bind(args.host, args.port) if ranked is None or ranked[0] == 0 else None  # a port in use fails now
    name = config.served_model_name if names else (DEFAULT_MODEL if model is None else several.served_name(model))
    for clash in sorted(set(args.lora) & {name, *config.aliases}):
        raise MinervaError(f"--lora names an adapter '{clash}', as the model is served; give the adapter a name "
                           f"of its own (requests pick it by that name)")
    # Loaded on a thread of its own, so OpenMP stays off the main thread (see on_own_thread).
    llm, threads = on_own_thread(lambda: (_load(model, args), torch.get_num_threads()))
    serve(llm, dataclasses.replace(config, served_model_name=name), sock, threads=threads, log_level=args.log_level)
    return 0


def cmd_perplexity(args) -> int:
    model, file = _model_and_rest(_with_model_flag(args, "FILE"), "FILE", rest_required=True)
    for flag in ("context", "stride"):
        value = getattr(args, flag)
        if value is not None and value < (2 if flag == "context" else 1):
            raise MinervaError(f"--{flag} must be at least {2 if flag == 'context' else 1}, got {value}")
    try:
        if not Path(file).is_file() and Path(file).exists():  # a device, a FIFO: no end to read to
            raise MinervaError(f"'{file}' is not a regular file; give a text file")
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MinervaError(f"cannot read text file '{file}': {exc}") from None
    llm = _load(model, args, engine=False)
    k_format, v_format = kv_formats(args)
    ids = llm.tokenizer.encode(text)
    context = args.context if args.context is not None else min(llm.config.max_position, 1024)
    start = time.perf_counter()
    r = perplexity(llm.loaded.model, ids, context=context, stride=args.stride, device=llm.device,
                   dtype=llm.dtype, k_format=k_format, v_format=v_format,
                   progress=lambda done, total: print(f"\r{done}/{total} tokens", end="", file=sys.stderr))
    seconds = time.perf_counter() - start
    print(file=sys.stderr)
    print(f"perplexity {r.perplexity:.4f}  (nll {r.nll:.4f} nats/token over {r.tokens} tokens, "
          f"{r.windows} windows, context {context}, stride {args.stride or context}, "
          f"KV cache k={resolve_format(k_format, llm.dtype)} v={resolve_format(v_format, llm.dtype)}, "
          f"{r.tokens / seconds:.0f} tokens/s)")
    return 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in --help, unless its help already says it (or it has none)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """The `minerva` parser and, through `add_subparsers`, every subcommand's."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _subcommand_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser that `argv` ends up in: `minerva bench serve ...` -> bench serve's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for i, word in enumerate(argv):
                if word in action.choices:
                    return _subcommand_parser(action.choices[word], argv[i + 1:])
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments; an unknown option is refused by its subcommand (its usage, and the
    option it was likely meant to be)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        target = _subcommand_parser(parser, argv)
        known = [o for a in target._actions for o in a.option_strings]
        hints = [m for x in extras if x.startswith("-")
                 for m in difflib.get_close_matches(x.split("=")[0], known, n=1, cutoff=0.6)]
        target.error(f"unrecognized arguments: {' '.join(extras)}"
                     + (f" (did you mean {' or '.join(dict.fromkeys(hints))}?)" if hints else ""))
    return args


def _add_conversation_parsers(sub) -> None:
    """`generate`, `chat` and `run` (the one or the other, as `ollama run`)."""
    def conversation(name: str, positional: str, metavar: str, raw: bool, **parser) -> argparse.ArgumentParser:
        p = sub.add_parser(name, **parser)
        p.add_argument(positional, nargs="*", metavar=metavar)
        if raw:
            p.add_argument("--raw", action="store_true", help="complete the prompt as is, without the chat template")
        p.add_argument("--system", default=None, help="system message for the chat template")
        add_chat_template(p)
        add_reasoning_effort(p)
        add_model_options(p)
        add_sampling_options(p)
        return p

    conversation("generate", "args", "[MODEL] PROMPT", True, help="generate an answer to a prompt, streamed",
                 description="minerva generate [MODEL] [PROMPT]: MODEL is a pulled name, a .gguf "
                             "file, a Hugging Face directory or repo (OWNER/REPO[:QUANT]; default smollm2-135m)").set_defaults(func=cmd_generate)
    # chat and run: without -n (or the model's max_new_tokens), no cap on a reply but the context's
    conversation("chat", "model", "MODEL", False, help="interactive chat with the model's template",
                 description="minerva chat [MODEL]: an interactive chat with MODEL (default smollm2-135m) in its "
                             "chat template; /help lists the commands").set_defaults(func=cmd_chat, max_tokens_fallback=chat.UNCAPPED)
    conversation("run", "args", "[MODEL] [PROMPT]", True,
                 help="chat with MODEL, or answer PROMPT and end (as `ollama run`)",
                 description="minerva run [MODEL] [PROMPT]: with no PROMPT on a terminal, chat (as `minerva "
                             "chat`); with one, or one piped in, answer it (as `minerva generate`)"
                 ).set_defaults(func=cmd_run, max_tokens_fallback=chat.UNCAPPED)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="minerva", description="LLM inference for GGUF and SafeTensors models")
    parser.add_argument("--version", action=Version, nargs=0,
                        help="show the version and the kernel backends by device, then exit")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="fetch a known model into the model store, or a Hugging Face repo "
                                    "(OWNER/REPO[:QUANT], hf.co/OWNER/REPO[:QUANT]) into the Hugging Face cache")
    p.add_argument("name", metavar="MODEL")
    p.add_argument("--verify", action="store_true", help="re-hash an already pulled file")
    p.set_defaults(func=cmd_pull)

    sub.add_parser("list", help="show pulled models and the models in the Hugging Face cache").set_defaults(func=cmd_list)

    manage.add_parsers(sub)

    _add_conversation_parsers(sub)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, metrics)",
                       description="minerva serve [MODEL]: serve MODEL (default smollm2-135m) over the "
                                   "OpenAI API at http://HOST:PORT/v1")
    p.add_argument("model", nargs="*", metavar="MODEL")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but "
                                                          "/health and the chat page")
    add_chat_template(p)
    p.add_argument("--lora", action="append", default=None, metavar="NAME=PATH",
                   help="serve a LoRA adapter (PEFT's folder, or a Hugging Face repo) as model NAME on top of the "
                        "model; repeatable")
    p.add_argument("--allowed-origins", type=_origins, default=None, metavar="ORIGINS",
                   help="origins a browser page may call the API from (CORS): '*' for any, or a comma-separated "
                        "list (default: pages of this machine, http(s)://localhost, 127.0.0.1 and [::1])")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names clients may send, the first one reported in responses and "
                        "metrics (default: the pulled name or the file's stem)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait for the engine; beyond it, 503 with Retry-After")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGTERM before they are aborted")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a complete request head; slower: 408 and closed "
                        "(default 10)")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request has to send its whole body after its head; slower: 408 and closed "
                        "(default 60)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open connections allowed; one more gets 503 with Retry-After at once (default 1024)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="what the server logs; info includes one access line per request (default info)")
    several.add_flags(p)
    add_model_options(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("perplexity", help="perplexity of a model over a text file",
                       description="minerva perplexity [MODEL] FILE: the perplexity of MODEL (default "
                                   "smollm2-135m) over the text in FILE, in sliding windows")
    p.add_argument("args", nargs="+", metavar="[MODEL] FILE")
    p.add_argument("--context", type=int, default=None, help="window length in tokens (default min(1024, model context))")
    p.add_argument("--stride", type=int, default=None, help="window step in tokens (default = context)")
    add_model_options(p, engine=False)
    p.set_defaults(func=cmd_perplexity)

    bench.add_parser(sub)
    roofline.add_parser(sub)
    tune.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if sys.stdin is None:  # started with stdin closed (a daemon, `<&-`): as if it were empty
        sys.stdin = open(os.devnull)  # noqa: SIM115 - for the life of the process
    args = _parse(build_parser(), argv)
    try:
        if args.command == "bench":
            bench.check_args(args)
        return args.func(args)
    except MinervaError as exc:
        print(f"minerva: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`, which closed early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
