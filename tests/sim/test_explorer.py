"""The exhaustive explorer: lw's protocol holds; the known bad designs are caught, shortest."""

from __future__ import annotations

import pytest

from lw.sim.explorer import Result, explore, random_walks, replay
from lw.sim.world import WorldConfig


def test_d_first_holds_on_the_done_when_bounds() -> None:
    res = explore(WorldConfig(design="d-first", dp=2, requests=2, layers=2))
    assert res.counterexample is None
    assert res.complete and res.states > 50 and "done" in res.seen


@pytest.mark.parametrize("kw", [
    dict(d_blocks=2),
    dict(dp=1, requests=3, layers=1, d_blocks=2, p_blocks=2),
    dict(dp=2, requests=2, layers=2, d_dp=2, d_blocks=1),
    dict(dp=3, requests=3, layers=1, d_blocks=2),
])
def test_d_first_holds_without_faults(kw: dict) -> None:
    res = explore(WorldConfig(design="d-first", **kw))
    assert res.counterexample is None, res.counterexample
    assert res.complete


def test_d_first_holds_with_faults_without_p_loss_detection() -> None:
    cfg = WorldConfig(design="d-first", dp=1, requests=1, layers=1, faults=True,
                      p_loss_detection=False)
    res = explore(cfg)
    assert res.counterexample is None, res.counterexample
    assert res.complete and {"done", "deadline"} <= res.seen


def test_p_first_deadlocks_with_dp2_and_a_full_decode_pool() -> None:
    cfg = WorldConfig(design="p-first", dp=2, requests=2, layers=2)
    res = explore(cfg)
    ce = res.counterexample
    assert ce is not None and ce.violation.prop == "deadlock"
    assert len(ce.actions) <= 8
    text = "\n".join(ce.violation.details)
    assert "cycle of waits" in text
    assert "blocked inside the layer-0 save hook" in text
    assert "waits in D0's queue for a free block" in text
    assert "waits in the layer-0 collective" in text
    # the trace replays to the same violation
    _w, _run, _texts, v = replay(cfg, ce.actions)
    assert v is not None and v.prop == "deadlock"


def test_p_first_is_fine_when_decode_has_room() -> None:
    """The deadlock needs the full pool: with a block per request p-first completes."""
    res = explore(WorldConfig(design="p-first", dp=2, requests=2, layers=2, d_blocks=2))
    assert res.counterexample is None


def test_eager_free_is_a_use_after_free() -> None:
    cfg = WorldConfig(design="eager-free", dp=2, requests=2, layers=2)
    res = explore(cfg)
    ce = res.counterexample
    assert ce is not None and ce.violation.prop == "use-after-free"
    assert "request_finished" in ce.violation.message
    assert len(ce.actions) <= 8


def test_eager_free_found_by_random_walks_too() -> None:
    res = random_walks(WorldConfig(design="eager-free"), seconds=5, seed=1)
    assert res.counterexample is not None
    assert res.counterexample.violation.prop == "use-after-free"


def test_non_atomic_layers_find_the_same_bugs() -> None:
    pf = explore(WorldConfig(design="p-first", atomic_layers=False))
    assert pf.counterexample is not None and pf.counterexample.violation.prop == "deadlock"
    ef = explore(WorldConfig(design="eager-free", atomic_layers=False))
    assert ef.counterexample is not None
    assert ef.counterexample.violation.prop == "use-after-free"


def test_random_mode_holds_for_d_first_with_faults() -> None:
    cfg = WorldConfig(design="d-first", dp=2, requests=3, layers=2, d_blocks=2, faults=True,
                      max_faults=3, p_loss_detection=False)
    res = random_walks(cfg, seconds=4, seed=7)
    assert res.counterexample is None, res.counterexample
    assert res.walks > 10 and {"done", "deadline"} <= res.seen


def test_vacuity_is_reported() -> None:
    res = Result(WorldConfig(faults=True), "exhaustive", complete=True, seen=set())
    v = res.vacuity()
    assert v is not None and v.prop == "sometimes-done"
    res.seen = {"done"}
    v = res.vacuity()
    assert v is not None and v.prop == "sometimes-deadline"
    res.seen = {"done", "deadline"}
    assert res.vacuity() is None


def test_state_budget_stops_and_says_partial() -> None:
    res = explore(WorldConfig(dp=2, requests=2, layers=1, faults=True, p_loss_detection=False),
                  max_states=200)
    assert not res.complete and "state limit" in res.stopped_by
    assert res.counterexample is None


@pytest.mark.parametrize("kw", [
    dict(d_blocks=2, p_blocks=2, requests=3),
    dict(dp=1, requests=1, layers=1, faults=True, fault_kinds=("drop", "dup", "write")),
])
def test_state_graph_is_acyclic(kw: dict) -> None:
    """Every run ends: liveness checked at terminal states covers every run."""
    res = explore(WorldConfig(**kw), check_cycles=True)
    assert res.counterexample is None and res.acyclic is True


def test_a_cycle_is_reported() -> None:
    from lw.sim.explorer import acyclic

    assert acyclic(3, [(0, 1), (1, 2)])
    assert not acyclic(3, [(0, 1), (1, 2), (2, 1)])
