"""`minerva bench`, `minerva roofline` and `minerva tune`: how fast Minerva runs, against its
peers and against the ceiling the machine sets.

Sub-commands, one module each: `latency` (llama-bench style), `throughput` (offline, N
requests at once), `sweep` (batch sizes against the roofline), `speculative` (with and
without speculative decoding) and `serve` (a load client for OpenAI-compatible servers).
`roofline` and `tune` (the kernel planner's command) are top-level commands of their own.
Shared parts: `measure` (how Minerva is timed), `report` (figures, header, table, JSON),
`peers` (llama.cpp, transformers), `hardware` (bandwidth and compute peaks, probed or from
datasheets), `args` (common options and the checks run before any model loads).

Each sub-command measures Minerva through its public engine API and, with
`--compare llama.cpp` or `--compare transformers`, the peer on the same model file
in the same process and run, then prints each figure side by side with the ratio.
Every report names the machine, the model, the command line, peak resident memory
and load time. Figures are the mean ± standard deviation over `-r` repetitions
(latency) or one timed run after a warm-up (throughput, sweep).
"""

from __future__ import annotations

from minerva.bench import latency, serve, speculative, sweep, throughput
from minerva.bench.args import check_args

__all__ = ["add_parser", "check_args"]


def add_parser(sub) -> None:
    """Register `minerva bench` and its sub-commands on the CLI's sub-command parsers."""
    p = sub.add_parser("bench", help="measure speed (latency, throughput, sweep), optionally against a peer")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    for command in (latency, throughput, sweep, speculative, serve):
        command.add_parser(bsub)
