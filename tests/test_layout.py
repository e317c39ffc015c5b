"""The package's shape, read with `ast`: imports point one way (no cycle among minerva's
modules, and no minerva import hidden inside a function, where one usually dodges a cycle),
files a reader can hold in their head (<= 500 lines) and functions that fit on a screen
(<= 80 lines); the C++ kernels' files (minerva/kernels/csrc) at most 800 lines each. Lazy
imports of optional third-party packages (llama_cpp, transformers, matplotlib, httpx, uvicorn)
stay allowed: they keep `minerva --help` from loading them."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minerva"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
CSRC = PACKAGE / "kernels" / "csrc"
MAX_CSRC_LINES = 800


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imported(node: ast.AST, module: str, names: set[str]) -> set[str]:
    """minerva modules an import statement names (`from a import b` may name module a.b)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in names}
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative import
            base = ".".join(module.split(".")[:-node.level] + ([base] if base else []))
        found = {base} if base in names else set()
        return found | {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in names}
    return set()


# The one function allowed a minerva import: the entry point holds a Ctrl-C while the CLI (and
# torch) load, so it imports the CLI inside main().
DEFERRED_IMPORTS = {"minerva/console.py:main"}


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """Module -> minerva modules it imports (anywhere in the file), and the minerva imports
    made inside functions."""
    mods = modules()
    names = set(mods)
    graph, inside = {}, []
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        deps = set()
        for node in ast.walk(tree):
            deps |= imported(node, name, names)
        graph[name] = deps - {name}
        for fn in ast.walk(tree):
            if (isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and f"{path.relative_to(PACKAGE.parent)}:{fn.name}" not in DEFERRED_IMPORTS):
                for node in ast.walk(fn):
                    if imported(node, name, names) or (
                            isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                                "minerva"))):
                        inside.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} in {fn.name}()")
    return graph, inside


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph, _ = import_graph()
    assert "minerva.engine.engine" in graph and graph["minerva.engine.engine"]  # the walk saw imports
    assert cycles(graph) == []



# packages that import none of the packages named beside them (the layers below the engine)
BELOW = {
    "minerva.formats": ("minerva.engine", "minerva.parsers", "minerva.serve", "minerva.llm", "minerva.cli"),
    "minerva.kernels": ("minerva.engine", "minerva.parsers", "minerva.serve", "minerva.llm", "minerva.models"),
    "minerva.engine": ("minerva.parsers", "minerva.serve", "minerva.llm", "minerva.cli"),
}


def test_the_lower_layers_import_nothing_above_them():
    graph, _ = import_graph()
    climbs = [f"{m} imports {d}" for m, deps in sorted(graph.items()) for low, above in BELOW.items()
              if m == low or m.startswith(low + ".") for d in sorted(deps)
              if any(d == a or d.startswith(a + ".") for a in above)]
    assert climbs == []

def test_no_minerva_import_inside_a_function():
    _, inside = import_graph()
    assert inside == []


def test_files_and_functions_stay_short():
    too_long = []
    for path in modules().values():
        source = path.read_text()
        lines = source.count("\n") + 1
        where = path.relative_to(PACKAGE.parent)
        if lines > MAX_FILE_LINES:
            too_long.append(f"{where}: {lines} lines")
        for fn in ast.walk(ast.parse(source)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = fn.end_lineno - fn.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{where}:{fn.lineno} {fn.name}(): {n} lines")
    assert too_long == []


def test_kernel_sources_stay_short():
    """Every C++ source and header under minerva/kernels/csrc is at most 800 lines (split a longer
    one along its seams, as the int8 matmul's q8_* files are)."""
    sources = sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h"))
    assert len(sources) > 10, f"found only {len(sources)} C++ files under {CSRC}"
    too_long = [f"{path.relative_to(PACKAGE.parent)}: {n} lines, more than {MAX_CSRC_LINES}"
                for path in sources if (n := len(path.read_text().splitlines())) > MAX_CSRC_LINES]
    assert too_long == [], "C++ files too long: " + "; ".join(too_long)
