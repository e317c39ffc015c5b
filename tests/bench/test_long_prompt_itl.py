"""benchmarks/long_prompt_itl.py refuses settings it cannot measure with, before starting a server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "long_prompt_itl.py"


@pytest.mark.parametrize("flags", [["--short-after", "-1"], ["--short-after", "nan"], ["--stream-tokens", "-5"],
                                   ["--tokens", "0"], ["--rounds", "0"]])
def test_bad_settings_are_refused(flags):
    r = subprocess.run([sys.executable, str(SCRIPT), "smollm2-135m", *flags], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--short-after from 0 to 3600 seconds" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
