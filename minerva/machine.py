"""The host and this process, read from /proc (Linux) with `platform` and `os` as the
fallback: CPU name, physical cores, memory, and resident memory.

Low-level and torch-free: `llm` sizes its thread pool from the physical cores here, and
the reports of `minerva bench` and `minerva roofline` describe the machine with it.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    """The host a report ran on."""

    cpu: str
    physical_cores: int
    logical_cpus: int
    memory_bytes: int

    def describe(self) -> str:
        threads = f", {self.logical_cpus} threads" if self.logical_cpus != self.physical_cores else ""
        memory = f", {self.memory_bytes / 2**30:.1f} GiB" if self.memory_bytes else ""
        return f"{self.cpu} ({self.physical_cores} cores{threads}{memory})"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def machine() -> Machine:
    """Describe this host from /proc (Linux), falling back to what `platform` and `os` know."""
    cpuinfo = _read("/proc/cpuinfo")
    name = ""
    cores: set[tuple[str, str]] = set()
    physical_id = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and not name:
            name = value
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            cores.add((physical_id, value))
    logical = os.cpu_count() or 1
    memory = 0
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            memory = int(line.split()[1]) * 1024
            break
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    return Machine(cpu=name, physical_cores=len(cores) or logical, logical_cpus=logical,
                   memory_bytes=memory)


def rss_mb() -> float:
    """This process's resident memory now, in MB (nan where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (nan on Windows)."""
    try:
        import resource
    except ImportError:
        return float("nan")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
