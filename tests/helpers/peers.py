"""Whether llama-cpp-python is there to compare with: installed, importable, and built
without AMX. A copy installed without its dependencies (`pip install --no-deps`) is found by
importlib but fails on import; a copy built with AMX (GGML_NATIVE on a CPU that has it)
crashes the process with a segmentation fault at its first forward on some machines
(minerva/bench/peers.py's AMX_WARNING), which no test can catch. The tests that need it skip
and say why."""

from __future__ import annotations

import importlib.util

from minerva.bench.peers import AMX_WARNING


def _import_problem() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    try:
        from llama_cpp import Llama  # noqa: F401
    except Exception as e:  # an install missing a dependency, or a library that does not load
        return f"llama-cpp-python does not import ({type(e).__name__}: {e})"
    return None


def _llama_cpp_problem() -> str | None:
    if IMPORT_PROBLEM is not None:
        return IMPORT_PROBLEM
    import llama_cpp
    if "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace"):
        return "llama-cpp-python " + AMX_WARNING.removeprefix("warning: this llama.cpp ")
    return None


IMPORT_PROBLEM = _import_problem()
LLAMA_CPP_IMPORTS = IMPORT_PROBLEM is None
LLAMA_CPP_PROBLEM = _llama_cpp_problem()
HAS_LLAMA_CPP = LLAMA_CPP_PROBLEM is None
LLAMA_CPP_INSTALLED = importlib.util.find_spec("llama_cpp") is not None
