"""The `minerva` command's entry point. The CLI imports torch, which takes a second or two: a
Ctrl-C meanwhile is held until the import is done (one inside torch's C++ start-up can abort
the process) and then ends the command as one later would (exit 130), without a traceback."""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    interrupted: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.default_int_handler:  # not where Ctrl-C is ignored (a background job)
        signal.signal(signal.SIGINT, lambda number, frame: interrupted.append(number))
    try:
        from minerva.cli import main as cli
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        print(file=sys.stderr)
        return 130
    return cli(argv)
