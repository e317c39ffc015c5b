"""What every `minerva bench` report is made of: measured figures, the systems that produced
them, the header naming machine, model and command, the side-by-side table, and the JSON copy."""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minerva.errors import write_output
from minerva.machine import machine


@dataclass
class Figure:
    """One measured rate: tokens/s over repetitions."""

    name: str  # e.g. "pp512", "tg128", "tg128@d512", "gen b32"
    system: str  # "minerva" or a peer
    samples: list[float] = field(default_factory=list)

    @property
    def timed(self) -> list[float]:
        """The samples that are rates (a NaN: nothing could be timed)."""
        return [s for s in self.samples if math.isfinite(s)]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.timed) if self.timed else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.timed) if len(self.timed) > 1 else 0.0

    def text(self) -> str:
        return f"{self.mean:9.1f} ± {self.std:6.1f}" if self.timed else "      n/a"


@dataclass
class SystemInfo:
    system: str
    load_seconds: float
    rss_mb: float  # resident memory of the loaded system (peak for minerva; growth for a peer)
    detail: str = ""


def threads_used(args) -> int:
    """The thread count a run used: --threads, or what the engine set torch to."""
    return args.threads or torch.get_num_threads()


def header(model_path: Path, threads: int) -> list[str]:
    return [f"machine: {machine().describe()}; {threads} threads",
            f"model:   {model_path}",
            f"command: {' '.join(['minerva', *sys.argv[1:]])}"]


def print_report(lines: list[str], systems: list[SystemInfo], figures: list[Figure]) -> None:
    for line in lines:
        print(line)
    for s in systems:
        print(f"{s.system:>12}: loaded in {s.load_seconds:.2f} s, resident {s.rss_mb:.0f} MB {s.detail}")
    names = list(dict.fromkeys(f.name for f in figures))
    peers = [s.system for s in systems if s.system != "minerva"]
    cols = ["minerva", *peers]
    print()
    print(f"{'test':<16}" + "".join(f"{c + ' tok/s':>22}" for c in cols)
          + "".join(f"{'vs ' + p:>17}" for p in peers))
    for name in names:
        row = {f.system: f for f in figures if f.name == name}
        cells = "".join(f"{row[c].text() if c in row else '      n/a':>22}" for c in cols)
        ratios = ""
        for p in peers:
            if p in row and "minerva" in row and row[p].mean > 0:
                ratios += f"{row['minerva'].mean / row[p].mean:>16.2f}x"
            else:
                ratios += f"{'':>17}"
        print(f"{name:<16}{cells}{ratios}")


def write_json(path: str | None, payload: dict, option: str = "--json") -> None:
    """`payload` into `path` (the file `option` names; checked before the run by `check_args`)."""
    if path:
        write_output(path, json.dumps(payload, indent=2), option)
        print(f"wrote {path}")
