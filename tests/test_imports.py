"""The house's import rules: no circle of imports inside lw (imports under TYPE_CHECKING and
inside functions count: a circle of types is still a circle of responsibilities); lw.fsm and
lw.contract import nothing of lw above them; the packages of the engines' and the proxy's
processes import neither the checker (lw.sim) nor the lab (lw.lab), nor each other; no file in
lw passes 700 lines."""

from __future__ import annotations

from lw.house import ABOVE_THE_ENGINES, ENGINE_PACKAGES, LW, cycles, import_graph, inside

MAX_LINES = 600
# Files still over the limit, at most this long (none: the runtime's interpreter, writes,
# timers, heartbeats, wake pipe and status replies went to modules of their own).
OVER_THE_LIMIT: dict[str, int] = {}


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


def test_the_engine_packages_import_neither_the_checker_nor_the_lab() -> None:
    graph = import_graph()
    up = {m: sorted(d for d in deps if inside(d, ABOVE_THE_ENGINES))
          for m, deps in graph.items() if inside(m, ENGINE_PACKAGES)}
    assert not any(up.values()), {m: d for m, d in up.items() if d}


def test_the_connector_and_the_proxy_do_not_import_each_other() -> None:
    """One package per process: vLLM loads lw.vllm_adapter, the proxy runs lw.proxy."""
    graph = import_graph()
    for side, other in (("lw.vllm_adapter", "lw.proxy"), ("lw.proxy", "lw.vllm_adapter")):
        cross = {m: sorted(d for d in deps if inside(d, (other,)))
                 for m, deps in graph.items() if inside(m, (side,))}
        assert not any(cross.values()), {m: d for m, d in cross.items() if d}


def test_no_file_in_lw_is_over_700_lines() -> None:
    long = {name: n for p in LW.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > OVER_THE_LIMIT.get(
                name := str(p.relative_to(LW.parent)), MAX_LINES)}
    assert not long, f"split by concern: {long}"
