"""Every bug found in the wild is a named variant the checker catches; lw's design holds there.

Each variant runs at its own default bounds (``Design.bounds``) and must be caught with the
property it names; d-first at the same bounds must hold. A checker that cannot fail proves
nothing, and one that fails lw's design at a variant's bounds proves the wrong thing.
"""

from __future__ import annotations

import time

import pytest

from lw.sim.cli import list_designs, main, strong_configs
from lw.sim.config import WorldConfig
from lw.sim.explorer import explore
from lw.sim.trace import render_text
from lw.sim.variants import DESIGNS, Design

VARIANTS = [d for d in DESIGNS.values() if d.expected != "holds"]
# d-first at these variants' bounds explores thousands of states (seconds on a loaded machine)
SLOW_HOLDS = {"deadline-frees-under-write", "handshake-hol"}


def _cfg(design: str, bounds_of: Design) -> WorldConfig:
    return WorldConfig(design=design, **bounds_of.config_overrides())


def test_at_least_fourteen_upstream_variants_are_listed() -> None:
    upstream = [d for d in VARIANTS if d.ref and d.name not in ("p-first", "eager-free")]
    assert len(upstream) >= 14
    text = "\n".join(list_designs())
    for d in VARIANTS:
        assert d.name in text and d.ref in text
        assert d.summary and d.ruled_out and d.expected != "holds"


@pytest.mark.parametrize("design", VARIANTS, ids=lambda d: d.name)
def test_variant_is_caught_with_its_property(design: Design) -> None:
    t0 = time.perf_counter()
    cfg = _cfg(design.name, design)
    res = explore(cfg, max_seconds=60, check_cycles=True)
    ce = res.counterexample
    assert ce is not None, f"{design.name} not caught in {res.states} states"
    assert ce.violation.prop == design.expected, ce.violation.headline()
    assert ce.actions, "a counterexample is a trace"
    assert render_text(cfg, ce, shortest=True)[0].startswith("VIOLATION")  # it replays
    # timing: the checker's budget (each variant is caught in at most ~2 s on a 2-core box)
    assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize("design", [
    pytest.param(d, marks=pytest.mark.slow) if d.name in SLOW_HOLDS else d for d in VARIANTS
], ids=lambda d: d.name)
def test_d_first_holds_at_the_variant_bounds(design: Design) -> None:
    """lw's design, the one the variant changes (computing ahead or d-first), holds there."""
    res = explore(_cfg("compute-ahead" if design.ahead else "d-first", design),
                  max_seconds=120, check_cycles=True)
    assert res.counterexample is None, res.counterexample.violation.headline()
    assert res.complete


def test_deadline_during_a_write_needs_abstract_time() -> None:
    """Issue 12 (4c): with timers only at their fixed values, D's deadline never fires while a
    P write is in flight; idling until just before a deadline reaches that interleaving."""
    design = DESIGNS["deadline-frees-under-write"]
    fixed = WorldConfig(design=design.name, abstract_time=False, **design.config_overrides())
    res = explore(fixed, check_cycles=True)
    assert res.counterexample is None and res.complete
    assert any(a == ("idle",) for a in explore_trace(design))


def explore_trace(design: Design) -> list[tuple]:
    """The counterexample of a variant at its bounds (abstract time on)."""
    res = explore(_cfg(design.name, design))
    assert res.counterexample is not None
    return res.counterexample.actions


def test_cli_design_exits_1_and_d_first_bounds_of_exits_0(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--design", "shared-layer-slot"]) == 1
    assert "VIOLATION use-after-free" in capsys.readouterr().out
    assert main(["--design", "d-first", "--bounds-of", "shared-layer-slot"]) == 0
    assert "RESULT: all properties hold" in capsys.readouterr().out
    assert main(["--list-designs"]) == 0
    assert "vllm-ascend #4650" in capsys.readouterr().out


def test_strong_check_covers_every_variant_bounds() -> None:
    configs = [kw for _label, kw in strong_configs("d-first")]
    for d in VARIANTS:
        want = {**d.config_overrides(), **({"design": "compute-ahead"} if d.ahead else {})}
        assert want in configs, d.name
    assert sum(kw.get("design") == "compute-ahead" for kw in configs) >= 6
    assert any(kw.get("faults") and kw.get("d_restarts") for kw in configs)
    assert any(kw.get("faults") and kw.get("delays", True) for kw in configs)


@pytest.mark.slow
def test_lw_check_without_flags_is_the_strong_check(capsys: pytest.CaptureFixture[str]) -> None:
    """`lw check` with no flags: lw's design at its base bounds and every variant's."""
    assert main(["--seconds", "60"]) == 0
    out = capsys.readouterr().out
    assert "strong check of design d-first" in out and "RESULT: all properties hold" in out
    assert "PARTIAL" not in out


@pytest.mark.parametrize("name", ["done-before-earlier-chunk", "d-counts-chunks"])
def test_progressive_push_variants_need_chunks(name: str) -> None:
    """Bugs of progressive push: caught at their bounds (two chunks), absent when the prompt is
    prefilled in one chunk."""
    kw = DESIGNS[name].config_overrides()
    assert kw["chunks"] >= 2
    res = explore(WorldConfig(design=name, **{**kw, "chunks": 1}), check_cycles=True)
    assert res.counterexample is None and res.complete


def test_done_before_an_earlier_chunk_needs_writes_completing_out_of_order() -> None:
    """lw's data plane reports a destination's writes in submission order: there the last
    chunk's writes never complete before an earlier chunk's, and the defect stays hidden."""
    kw = {**DESIGNS["done-before-earlier-chunk"].config_overrides(), "unordered_writes": False}
    res = explore(WorldConfig(design="done-before-earlier-chunk", **kw), check_cycles=True)
    assert res.counterexample is None and res.complete
