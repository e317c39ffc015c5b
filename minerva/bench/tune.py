"""`minerva tune`: the command of the kernel planner (`minerva.kernels.tune`), a top-level
command as `roofline` is: measure this CPU's kernel choices and keep them (beside the kernel
build, or in --out FILE, checked writable before the plan), or show those kept."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from minerva.errors import MinervaError, output_file, write_output
from minerva.kernels import native, tune


def cmd_tune(args) -> int:
    kernels = native.load()
    if kernels is None:
        raise MinervaError(f"the packed CPU kernels are not available here ({native.unavailable_reason}): "
                           "there is nothing to tune")
    path = Path(args.out).expanduser() if args.out else tune.choices_path()
    if args.show:
        if not args.out and not path.exists():
            raise MinervaError(f"no choices at {path}: run `minerva tune` to measure them")
        # the build's own file, damaged: planning again mends it (a file the user named: tune --out)
        remedy = tune.WRITE_ONE if args.out else "`minerva tune` measures them again"
        data = tune.read_pinned(path, f"--out {args.out}" if args.out else str(path), remedy)
        tune.check(kernels, data, str(path), remedy)  # as a pinned file is, before its table
    else:
        if args.out:
            output_file(path, "--out")  # before the plan, so that it is not lost at its end
        data = tune.plan(kernels, rounds=args.rounds)
        text = json.dumps(data, indent=1) + "\n"
        if args.out:  # the user's file (a pipe, a device too: written into, never replaced)
            write_output(path, text, "--out")  # (failing: kept in a temporary file, which the error names)
        else:
            try:
                tune.save(data, path)
            except OSError:
                write_output(path, text, "the choices file")
    print(f"kernel choices for the {data.get('build')} build on {data.get('cpu')}, {data.get('threads')} threads "
          f"(measured {data.get('made')} in {data.get('seconds')} s): {path}")
    if tune.busy_note(data):
        print(f"note: {tune.busy_note(data)}")
    print("one row of x against matrices streamed from memory; GB/s with the choice, and with the CPU's defaults")
    print("\n".join(tune.table(data)))
    return 0


def _rounds(text: str) -> int:
    try:
        rounds = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
    if rounds < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {rounds}")
    return rounds


def add_parser(subparsers):
    p = subparsers.add_parser("tune", help="measure this CPU's kernel choices (planned once per kernel build)",
                              description="Time the int8 kernels' result-neutral settings for every packed type "
                                          "on this machine and keep the fastest beside the kernel build; "
                                          "MINERVA_CHOICES=FILE pins a file, --no-tune uses the fixed defaults.")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="write the choices to FILE (for MINERVA_CHOICES) instead of beside the build")
    p.add_argument("--rounds", type=_rounds, default=tune.ROUNDS,
                   help=f"rounds each setting is timed, alternating; the median counts (default {tune.ROUNDS})")
    p.add_argument("--show", action="store_true", help="print the choices kept (or FILE's) without measuring")
    p.set_defaults(func=cmd_tune)
    return p
