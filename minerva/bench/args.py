"""The options every Minerva-side `minerva bench` sub-command takes, the argument types of
its lists and ranges, and the checks run before any model loads."""

from __future__ import annotations

import argparse
from pathlib import Path

from minerva.bench.peers import PEERS
from minerva.errors import MinervaError, make_output_folder, output_file
from minerva.engine.engine import EngineConfig
from minerva.options import ACTIVATIONS_HELP, DECODE_STEPS_HELP, TP_HELP, add_device_options, add_no_tune


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def int_range(text: str) -> tuple[int, int]:
    vals = ints(text.replace(":", ","))
    if len(vals) == 1:
        vals = vals * 2
    if len(vals) != 2 or not 1 <= vals[0] <= vals[1]:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX with 1 <= MIN <= MAX, got '{text}'")
    return vals[0], vals[1]


def add_common_options(q: argparse.ArgumentParser) -> None:
    q.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="pulled name, .gguf file, Hugging Face directory or repo (default smollm2-135m)")
    q.add_argument("--compare", action="append", default=[], choices=PEERS,
                   help="also run this peer on the same model file (repeatable)")
    add_device_options(q)
    q.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    add_no_tune(q)
    q.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="activation dtype (default auto: bfloat16 where the CPU has AVX-512 BF16)")
    q.add_argument("--quantize", default=None, choices=["int8", "int4"],
                   help="quantize a SafeTensors model at load (group-wise, weight-only)")
    q.add_argument("--activations", default="auto", choices=["auto", "float", "int8"], help=ACTIVATIONS_HELP)
    q.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N", help=TP_HELP)
    q.add_argument("--kv-cache-memory", type=float, default=None, help="KV pool: bytes, or a fraction of free memory (default: sized to fit)")
    q.add_argument("--max-num-batched-tokens", type=int, default=2048)
    q.add_argument("--decode-steps", type=int, default=EngineConfig.decode_steps, metavar="N", help=DECODE_STEPS_HELP)
    q.add_argument("--no-hybrid-kv-cache", action="store_true",
                   help="one block table for all layers: sliding-window layers keep K/V for the whole context")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--json", default=None, help="also write the results to this JSON file")


def check_args(args) -> None:
    for name in ("repetitions", "num_prompts", "threads", "output_len", "input_len", "max_batch"):
        v = getattr(args, name, None)
        if isinstance(v, int) and v < 1:
            raise MinervaError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    for name, least in (("prompt", 0), ("gen", 0), ("depth", 0)):  # bench latency's comma-separated lists
        v = getattr(args, name, None)
        if isinstance(v, list) and any(x < least for x in v):
            raise MinervaError(f"--{name} takes lengths >= {least}, got {','.join(map(str, v))}")
        if isinstance(v, int) and v < 1:  # bench speculative's -n
            raise MinervaError(f"--{name} must be at least 1, got {v}")
    if isinstance(getattr(args, "prompt", None), list) and not any(args.prompt) and not any(args.gen):
        raise MinervaError("nothing to measure: every --prompt and --gen length is 0; give one above 0")
    if getattr(args, "batch_sizes", None) is not None and (not args.batch_sizes or min(args.batch_sizes) < 1):
        raise MinervaError("--batch-sizes must be positive integers")
    # the files written when the run is done, checked before it starts, so its results are not lost
    for option in ("json", "result_file"):
        if getattr(args, option, None):
            output_file(getattr(args, option), f"--{option.replace('_', '-')}")
    if getattr(args, "bench_command", None) == "sweep":  # --out: a stem for .csv, .json and .png
        make_output_folder(Path(args.out).expanduser().parent, "--out")
        for suffix in (".csv", ".json", ".png"):
            output_file(Path(args.out).expanduser().with_suffix(suffix), "--out")
