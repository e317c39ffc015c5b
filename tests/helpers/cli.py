"""Run the `minerva` command in a subprocess and check what a bad input must look like."""

from __future__ import annotations

import os
import subprocess
import sys


def run(*args: str, env_home=None, input: str | None = None, timeout: int = 300):
    env = None if env_home is None else {**os.environ, "MINERVA_HOME": str(env_home)}
    return subprocess.run([sys.executable, "-m", "minerva", *args], capture_output=True, text=True,
                          input=input, timeout=timeout, env=env)


def assert_clean_error(proc, *fragments: str, code: int = 1):
    """Exit status `code`, no traceback, and exactly one `error:` line naming every fragment."""
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    assert len(errors) == 1, proc.stderr
    for f in fragments:
        assert f in errors[0], errors[0]
