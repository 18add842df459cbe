"""The house's import rules: no circle of imports inside lw (imports under TYPE_CHECKING and
inside functions count: a circle of types is still a circle of responsibilities); lw.fsm and
lw.contract import nothing of lw above them; the packages of the engines' and the proxy's
processes import neither the checker (lw.sim) nor the lab (lw.lab), nor each other; no file in
lw passes 700 lines."""

from __future__ import annotations

import ast
from pathlib import Path

LW = Path(__file__).resolve().parent.parent / "lw"
MAX_LINES = 700
# Files still over the limit, at most this long (none: the runtime's interpreter, writes,
# timers, heartbeats, wake pipe and status replies went to modules of their own).
OVER_THE_LIMIT: dict[str, int] = {}


def modules() -> dict[str, Path]:
    """Every module of lw by dotted name (a package by its own name)."""
    out = {}
    for f in LW.rglob("*.py"):
        parts = f.relative_to(LW.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the lw modules it imports. ``from pkg import mod`` is an edge to ``pkg.mod``
    alone: the package is only the way there."""
    mods = modules()
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


def test_no_import_circles_in_lw() -> None:
    found = cycles(import_graph())
    assert not found, "import circles (break each by moving what both sides need below them):\n" + \
        "\n".join("  " + " <-> ".join(c) for c in found)


def test_the_finder_sees_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_core_imports_nothing_above_it() -> None:
    graph = import_graph()
    above = {m: sorted(d for d in deps if not d.startswith("lw.fsm") and d != "lw")
             for m, deps in graph.items() if m.startswith("lw.fsm")}
    assert not any(above.values()), {m: d for m, d in above.items() if d}


def test_the_contract_imports_nothing_of_lw_but_itself() -> None:
    """What P, D and the proxy speak (lw.contract) stands below all of them."""
    graph = import_graph()
    above = {m: sorted(d for d in deps if not d.startswith("lw.contract") and d != "lw")
             for m, deps in graph.items() if m.startswith("lw.contract")}
    assert not any(above.values()), above


ENGINE_PACKAGES = ("lw.vllm_adapter", "lw.proxy", "lw.contract", "lw.transport")
"""What runs in P's, D's and the proxy's processes: below the checker and the lab."""
ABOVE_THE_ENGINES = ("lw.sim", "lw.lab")


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_engine_packages_import_neither_the_checker_nor_the_lab() -> None:
    graph = import_graph()
    up = {m: sorted(d for d in deps if _in(d, ABOVE_THE_ENGINES))
          for m, deps in graph.items() if _in(m, ENGINE_PACKAGES)}
    assert not any(up.values()), {m: d for m, d in up.items() if d}


def test_the_connector_and_the_proxy_do_not_import_each_other() -> None:
    """One package per process: vLLM loads lw.vllm_adapter, the proxy runs lw.proxy."""
    graph = import_graph()
    for side, other in (("lw.vllm_adapter", "lw.proxy"), ("lw.proxy", "lw.vllm_adapter")):
        cross = {m: sorted(d for d in deps if _in(d, (other,)))
                 for m, deps in graph.items() if _in(m, (side,))}
        assert not any(cross.values()), {m: d for m, d in cross.items() if d}


def test_no_file_in_lw_is_over_700_lines() -> None:
    long = {name: n for p in LW.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > OVER_THE_LIMIT.get(
                name := str(p.relative_to(LW.parent)), MAX_LINES)}
    assert not long, f"split by concern: {long}"
