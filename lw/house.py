"""The import graph of lw, read from the source with ast: what tests/test_imports.py holds to
the house's rules and `lw diagrams` draws as the package layers (docs/design.md)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

LW = Path(__file__).resolve().parent

ENGINE_PACKAGES = ("lw.vllm_adapter", "lw.proxy", "lw.contract", "lw.transport")
"""What runs in P's, D's and the proxy's processes: below the checker and the lab."""
ABOVE_THE_ENGINES = ("lw.sim", "lw.lab")
PROCESS_ROOTS = {"lw.vllm_adapter": "vLLM's processes", "lw.proxy": "the proxy"}
"""The package each production process loads lw through; whatever neither reaches is a tool."""
TOOLS = "tools"
ALONE = ("lw.seqdiagram",)
"""Top-level modules drawn on their own: a library other packages import. The other top-level
modules (the command line and its helpers) are drawn as one node, ``lw``."""


def modules(root: Path = LW) -> dict[str, Path]:
    """Every module of lw by dotted name (a package by its own name)."""
    out = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph(root: Path = LW) -> dict[str, set[str]]:
    """Module -> the lw modules it imports. ``from pkg import mod`` is an edge to ``pkg.mod``
    alone: the package is only the way there."""
    mods = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                subs = {f"{source}.{a.name}" for a in node.names} & mods.keys()
                graph[name] |= subs
                if source in mods and len(subs) < len(node.names):
                    graph[name].add(source)
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def inside(module: str, packages: tuple[str, ...]) -> bool:
    """Is ``module`` one of ``packages`` or in one of them?"""
    return any(module == p or module.startswith(p + ".") for p in packages)


def package_of(module: str, graph: dict[str, set[str]]) -> str:
    """The node ``module`` is drawn in: its package under lw, or ``lw`` for the command line."""
    parts = module.split(".")
    if len(parts) > 2:
        return ".".join(parts[:2])
    # a two-part name is a package of lw when modules live under it, else a top-level module
    if len(parts) == 2 and (module in ALONE or any(m.startswith(module + ".") for m in graph)):
        return module
    return "lw"


def package_graph(graph: dict[str, set[str]]) -> Counter[tuple[str, str]]:
    """(importing package, imported package) -> how many (module, imported module) pairs."""
    return Counter((package_of(m, graph), package_of(d, graph))
                   for m, deps in graph.items() for d in deps
                   if package_of(m, graph) != package_of(d, graph))


def reach(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    """``start`` and everything it imports, directly or not."""
    seen, todo = set(start), list(start)
    while todo:
        for d in graph.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def processes(graph: dict[str, set[str]]) -> dict[str, tuple[str, ...]]:
    """Package -> the processes that may load it (its modules reachable from a process root's
    modules, imports inside functions included); ``(TOOLS,)`` for those no root reaches."""
    loaded: dict[str, list[str]] = {package_of(m, graph): [] for m in sorted(graph)}
    for root, name in PROCESS_ROOTS.items():
        for p in sorted({package_of(m, graph)
                         for m in reach(graph, {m for m in graph if inside(m, (root,))})}):
            loaded[p].append(name)
    return {p: tuple(names) or (TOOLS,) for p, names in sorted(loaded.items())}
