"""Whether llama-cpp-python is there to compare with: installed and importable. A copy
installed without its dependencies (`pip install --no-deps`) is found by importlib but
fails on import; the tests that need it skip and say why."""

from __future__ import annotations

import importlib.util


def _llama_cpp_problem() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    try:
        from llama_cpp import Llama  # noqa: F401
    except Exception as e:  # an install missing a dependency, or a library that does not load
        return f"llama-cpp-python does not import ({type(e).__name__}: {e})"
    return None


LLAMA_CPP_PROBLEM = _llama_cpp_problem()
HAS_LLAMA_CPP = LLAMA_CPP_PROBLEM is None
LLAMA_CPP_INSTALLED = importlib.util.find_spec("llama_cpp") is not None
