"""The world itself: cloning, determinism, and the atomic-layer reduction against the full model."""

from __future__ import annotations

import pytest

from lw.sim.explorer import drain, explore
from lw.sim.properties import Violation
from lw.sim.world import World, WorldConfig


def _advance(w: World, n: int) -> None:
    for _ in range(n):
        acts = w.enabled()
        if not acts:
            return
        w.apply(acts[0])


def test_clone_is_equal_and_independent() -> None:
    w = World(WorldConfig(dp=2, requests=2, layers=2, d_blocks=2, faults=True))
    _advance(w, 12)
    c = w.cloner()
    w2 = c.clone(w)
    assert w2.key() == w.key()
    assert w2.p[0]._table is w.p[0]._table  # shared, not copied
    assert w2.p[0] is not w.p[0] and w2.s.net is not w.s.net
    _advance(w2, 5)
    assert w2.key() != w.key()
    assert c.clone(w).key() == w.key()


def test_same_actions_same_state() -> None:
    a, b = World(WorldConfig()), World(WorldConfig())
    for _ in range(15):
        acts = a.enabled()
        assert acts == b.enabled()
        if not acts:
            break
        a.apply(acts[0])
        b.apply(acts[0])
        assert a.key() == b.key()


def test_fair_drain_completes_every_request_without_faults() -> None:
    w = World(WorldConfig(dp=2, requests=3, layers=3, d_blocks=2))
    drain(w)
    assert all(q.d_stage == "done" and q.send_ok and q.recv_ok for q in w.reqs)
    assert all(b is None for pool in w.s.p_pool + w.s.d_pool for b in pool)


def test_no_fault_timer_is_a_violation() -> None:
    """Without faults the clock must never be needed: firing a timer is reported."""
    w = World(WorldConfig(dp=1, requests=1, layers=1))
    w.apply(("arrive",))
    w.apply(("alloc", 0))
    # Pretend the proxy lost the request: only the D deadline can end it now.
    w.reqs[0].started = True
    w.reqs[0].p_stage = "aborted"
    assert w.enabled() and w.enabled()[0][0] == "timer"
    with pytest.raises(Violation, match="no-deadline-without-faults"):
        w.apply(w.enabled()[0])


def _boundary_states(cfg: WorldConfig) -> set[int]:
    seen: set[int] = set()

    def visit(w: World) -> None:
        if not any(w.s.hooks_done):
            seen.add(hash(w.key()))

    res = explore(cfg, on_state=visit)
    assert res.counterexample is None and res.complete
    return seen


@pytest.mark.parametrize("kw", [
    dict(),
    dict(dp=2, requests=2, layers=2, d_blocks=2),
    dict(dp=2, tp=2, d_tp=2, mla=True, requests=2, layers=2, prefix_hits=(0, 1)),
    dict(dp=2, requests=1, layers=1, faults=True, fault_kinds=("drop", "write"),
         abstract_time=False),
    # abstract time: idling is offered before the first hook of a layer only, like the atomic
    # layer (delays only, to keep it small)
    dict(dp=2, requests=1, layers=1, faults=True, fault_kinds=()),
])
def test_atomic_layers_reach_exactly_the_states_of_the_full_model(kw: dict) -> None:
    """Soundness of the reduction: at layer boundaries both models reach the same states."""
    atomic = _boundary_states(WorldConfig(atomic_layers=True, **kw))
    full = _boundary_states(WorldConfig(atomic_layers=False, **kw))
    assert atomic == full
