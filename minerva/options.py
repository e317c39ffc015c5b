"""Command-line options shared by the `minerva` commands and `minerva bench`: the model,
engine, speculative-decoding and sampling flags, and what they turn into.

A leaf: it imports the engine's configuration and sampler, never the commands that use it,
so `cli` and `bench` can both depend on it.
"""

from __future__ import annotations

import argparse
import os

from minerva.engine.engine import EngineConfig
from minerva.engine.sampler import SamplingParams
from minerva.errors import MinervaError
from minerva.kernels import dispatch
from minerva.kernels.kv_quant import KV_FORMATS


ACTIVATIONS_HELP = ("float: quantized weights meet the float activations; int8: activations are "
                    "quantized to 8 bits per block of 32 (256 for K-quants) for integer dot products (faster on CPUs, "
                    "slightly different results, as llama.cpp computes); auto (default): int8 where Minerva's CPU "
                    "kernels run, else float")


TP_HELP = ("split the model over N processes on this host (tensor parallelism; each rank gets 1/N "
           "of the cores by default); under torchrun, every rank runs the same command")


class NoTune(argparse.Action):
    """--no-tune: the kernels' fixed defaults, not the choices measured for this machine
    (`minerva.kernels.tune`); through the environment, so tensor-parallel workers take it too."""

    def __call__(self, parser, namespace, values, option_string=None):
        os.environ["MINERVA_NO_TUNE"] = "1"
        setattr(namespace, self.dest, True)


def add_no_tune(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-tune", action=NoTune, nargs=0, default=False,
                   help="use the CPU kernels' fixed choices, not those measured on this machine on first use "
                        "(`minerva tune`; MINERVA_NO_TUNE=1 does the same)")


def add_device_options(p: argparse.ArgumentParser) -> None:
    """--device and --kernels: where the model runs and which backend's kernels run it."""
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cpu, unless a GPU is present and a GPU backend that "
                        "has passed its GPU tests is registered; `minerva --version` lists them)")
    p.add_argument("--kernels", default="auto", choices=["auto", *dispatch.BACKENDS],
                   help="the kernels that run on the device: auto (the device's checked backend, else the "
                        "reference), reference (plain torch), cpu (Minerva's C++ kernels) or triton (the GPU "
                        "kernels; not yet checked on a GPU, so only when asked for)")


def add_model_options(p: argparse.ArgumentParser, engine: bool = True) -> None:
    p.add_argument("--model", "-m", dest="model_flag", default=None, metavar="MODEL",
                   help="the model, as the MODEL argument takes it (a pulled name, a .gguf file, a Hugging "
                        "Face directory or repo), for those used to vLLM's --model")
    add_device_options(p)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation dtype (default auto: bfloat16 on CPUs with AVX-512 BF16 and on "
                        "GPUs, else float32)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: physical cores; at most 4 per CPU this process may use)")
    add_no_tune(p)
    p.add_argument("--activations", default="auto", choices=["auto", "float", "int8"],
                   help=ACTIVATIONS_HELP)
    p.add_argument("--quantize", default=None, choices=["int8", "int4"],
                   help="quantize a SafeTensors model's weights at load, group-wise (weight-only)")
    kv = sorted(KV_FORMATS)
    p.add_argument("--kv-cache-dtype", default=None, choices=kv, help="K and V cache precision")
    p.add_argument("--kv-cache-dtype-k", default=None, choices=kv, help="K cache precision (default auto)")
    p.add_argument("--kv-cache-dtype-v", default=None, choices=kv, help="V cache precision (default auto)")
    if not engine:
        return
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                   help=TP_HELP)
    g = p.add_argument_group("engine")
    g.add_argument("--kv-cache-memory", type=float, default=EngineConfig.kv_cache_memory,
                   help="KV pool size: bytes, or a fraction (<= 1) of the memory available at start, then at most "
                        "what --max-num-seqs requests of the whole context can fill (default: sized to fit, "
                        "0.9 of the memory beside the weights, shared by the models of a server; pages stay "
                        "untouched until used)")
    g.add_argument("--prefix-cache-memory", type=float, default=EngineConfig.prefix_cache_memory,
                   metavar="BYTES",
                   help="the finished requests' cached prompt blocks kept (resident) before unused pool "
                        "pages are touched: bytes, or a fraction (<= 1) of the memory available at start; at "
                        "most a quarter of the pool (default 0.05)")
    g.add_argument("--max-model-len", "--ctx-size", "-c", type=int, default=None, metavar="N",
                   help="tokens a request may reach, prompt and output (default: the model's context); "
                        "the KV pool is sized for it")
    g.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
                   help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                   help="token budget of one step (prompt chunks + decodes)")
    g.add_argument("--prefill-chunk-seconds", type=float, default=EngineConfig.prefill_chunk_seconds,
                   metavar="S",
                   help="while requests stream (or wait to start), a long prompt is computed in chunks of "
                        "about S seconds each, at the measured speed, so their tokens keep coming; alone, in "
                        "chunks of about 4 x S, so a request that arrives waits no longer "
                        "(default %(default)s; 0 = chunks of the whole --max-num-batched-tokens)")
    g.add_argument("--decode-steps", type=int, default=EngineConfig.decode_steps, metavar="N",
                   help=DECODE_STEPS_HELP)
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt blocks")
    g.add_argument("--no-hybrid-kv-cache", action="store_true",
                   help="one block table for all layers: sliding-window layers keep K/V for the whole context")
    add_speculative_options(p)


DECODE_STEPS_HELP = ("forwards a step of decodes may run in a row (a burst of at most ~0.1 s) while no request "
                     "waits to start, each sampled token fed back in: streams then get up to N tokens at a "
                     "time (default %(default)s; 1 = a token a step)")


def add_speculative_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (exact: the output distribution is unchanged)")
    g.add_argument("--speculative", default=None, metavar="METHOD",
                   help="ngram (prompt lookup), self[:LAYERS] (the model's first layers) or draft:MODEL")
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help=f"tokens guessed per step, with --speculative (default {EngineConfig.num_speculative_tokens})")
    g.add_argument("--speculative-max-batch", type=int, default=None,
                   help="no guesses in steps with more running requests than this, with --speculative (default "
                        f"{EngineConfig.speculative_max_batch})")


def check_speculative(args) -> None:
    """The speculative settings given without --speculative, which they would change nothing
    without: an error naming them (they were dropped without a word)."""
    if getattr(args, "speculative", None) is None:
        given = [f"--{name.replace('_', '-')}" for name in ("num_speculative_tokens", "speculative_max_batch")
                 if getattr(args, name, None) is not None]
        if given:
            raise MinervaError(f"{' and '.join(given)} {'set' if len(given) > 1 else 'sets'} speculative decoding, "
                               "which is off: add --speculative ngram|self[:LAYERS]|draft:MODEL, or drop "
                               f"{'them' if len(given) > 1 else 'it'}")


def speculative_options(args) -> dict:
    """The engine's speculative settings from the flags (checked by `check_speculative`)."""
    check_speculative(args)
    k, most = args.num_speculative_tokens, args.speculative_max_batch
    return dict(speculative=args.speculative,
                num_speculative_tokens=EngineConfig.num_speculative_tokens if k is None else k,
                speculative_max_batch=EngineConfig.speculative_max_batch if most is None else most)


def kv_formats(args) -> tuple[str, str]:
    both = args.kv_cache_dtype or "auto"
    return args.kv_cache_dtype_k or both, args.kv_cache_dtype_v or both


def engine_options(args) -> dict:
    k, v = kv_formats(args)
    return dict(kv_cache_memory=args.kv_cache_memory, prefix_cache_memory=args.prefix_cache_memory,
                block_size=args.block_size,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                prefill_chunk_seconds=args.prefill_chunk_seconds, enable_prefix_caching=not args.no_prefix_caching, hybrid_kv_cache=not args.no_hybrid_kv_cache,
                kv_cache_dtype_k=k, kv_cache_dtype_v=v, decode_steps=args.decode_steps,
                max_model_len=args.max_model_len, **speculative_options(args))


# the command line's own sampling defaults, for what neither a flag nor the model sets
FALLBACK = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", "-n", type=int, default=None,
                   help="tokens to generate at most, cut at the context (default: the model's generation "
                        "config; else 256 for generate, and the context for chat and run)")
    model = "(default: the model's generation config, else {})"
    g.add_argument("--temperature", "-t", type=float, default=None, help="0 = greedy " + model.format(0.8))
    g.add_argument("--top-k", type=int, default=None, help="0 = off " + model.format(40))
    g.add_argument("--top-p", type=float, default=None, help=model.format(0.95))
    g.add_argument("--min-p", type=float, default=None, help=model.format(0.05))
    g.add_argument("--repetition-penalty", type=float, default=None, help=model.format(1.0))
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling(args, defaults: dict | None = None) -> SamplingParams:
    """The command's parameters: its flags, else the model's sampling `defaults`, else FALLBACK
    (and the command's own `max_tokens_fallback`)."""
    fallback = {**FALLBACK, "max_tokens": getattr(args, "max_tokens_fallback", 256)}
    chosen = {name: value if (value := getattr(args, name)) is not None else (defaults or {}).get(name, otherwise)
              for name, otherwise in fallback.items()}
    return SamplingParams(**chosen,
                          presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed,
                          stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def add_chat_template(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="the Jinja chat template to render chats with instead of the model's own: a file, or the "
                        "template's text")
    p.add_argument("--generation-config", default="auto", metavar="auto|none|DIR",
                   help="sampling defaults for what a request (or the command line) leaves out: 'auto' the "
                        "model's own (generation_config.json, a GGUF's general.sampling.*), 'none' without them "
                        "(serve: the API's defaults; generate, chat, run: their flags' defaults), or DIR's "
                        "generation_config.json")


def add_reasoning_effort(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reasoning-effort", choices=("low", "medium", "high"), default=None,
                   help="how much a reasoning model thinks first (GPT-OSS's template reads it; "
                        "default: the template's)")
