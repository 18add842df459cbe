"""Prefill failover in the checker world (issue 22): P ranks as separate engines, one dies, D
re-prefills on the other under a new claim epoch, fenced when the dead rank had writes in
flight; the variants that drop the fence or the budget are caught (tests/sim/test_variants)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lw.sim.cli import STRONG
from lw.sim.config import WorldConfig
from lw.sim.explorer import explore, replay
from lw.sim.variants import DESIGNS
from lw.sim.world import World

FAILOVER = DESIGNS["retry-same-blocks"].config_overrides()


def _drain(w: World) -> World:
    """Take the first enabled action until none is left (the fault budget is spent), then
    check the terminal properties."""
    for _ in range(200):
        acts = w.enabled()
        if not acts:
            w.check_terminal()
            return w
        w.apply(acts[0])
    raise AssertionError("the run did not end")


def _orphan_world(retry: int) -> World:
    """r0 is routed to P rank 0, which dies before it claims; D learns of it."""
    w = World(WorldConfig(design="d-first", **{**FAILOVER, "retry_prefill": retry}))
    for a in (("arrive",), ("alloc", 0), ("start", 0), ("crash_rank", 0), ("rank_lost", 0, 0)):
        assert a in w.enabled(), a
        w.apply(a)
    return w


def test_an_orphan_is_prefilled_again_at_once_and_completes_on_the_live_rank() -> None:
    w = _orphan_world(retry=1)
    q = w.reqs[0]
    assert q.retry == ("P0",) and q.epoch == 1
    _drain(w)
    assert q.d_stage == "done" and q.p_rank == 1 and q.p_epoch == 1
    assert w.d[0].counters["reprefills"] == 1
    assert w.now == 0.0  # no deadline or lease was waited for: found by its P's loss


def test_without_a_budget_the_orphan_waits_for_its_deadline_as_before() -> None:
    w = _orphan_world(retry=0)
    q = w.reqs[0]
    assert q.retry is None and q.recv_reports == (0,)
    _drain(w)
    assert q.d_stage == "failed" and q.p_rank == 0
    assert w.now == w.cfg.prefill_timeout_s


def test_lw_fences_where_the_unfenced_retry_is_caught_then_completes() -> None:
    """The variant's counterexample (the dead rank had a write in flight) against lw's D: no
    new epoch until the lease passed, then the retry completes on the live rank."""
    cfg = WorldConfig(design="retry-same-blocks", **FAILOVER)
    ce = explore(cfg, max_seconds=60).counterexample
    assert ce is not None and ce.violation.prop == "stale-kv"
    w, _run, _texts, v = replay(replace(cfg, design="d-first"), ce.actions, record=False)
    assert v is None and w.d[0].state_of("r0") == "FENCING" and w.reqs[0].retry is None
    _drain(w)
    q = w.reqs[0]
    assert q.d_stage == "done" and q.p_epoch == 1
    assert w.d[0].counters["leases_expired"] == 1 and w.now >= cfg.lease_s


def test_the_budget_is_the_number_of_retries() -> None:
    """Both ranks die under r0 in turn: lw retries once (its budget), then fails it."""
    cfg = WorldConfig(design="retry-unbounded", **DESIGNS["retry-unbounded"].config_overrides())
    ce = explore(cfg, max_seconds=60).counterexample
    assert ce is not None and ce.violation.prop == "request-ends"
    w, _run, _texts, v = replay(replace(cfg, design="d-first"), ce.actions, record=False)
    assert v is None and w.d[0].counters["reprefills"] == 1
    _drain(w)
    assert w.reqs[0].d_stage == "failed"


def test_lw_retries_into_fresh_blocks_where_freeing_them_at_once_is_caught() -> None:
    """retry_fresh_blocks: the variant's counterexample (the old epoch's blocks freed while the
    dead rank's write may still land) against lw's D: the old blocks stay held as a ghost, the
    request goes on at once in fresh blocks and is done before the lease, which then frees
    them."""
    kw = DESIGNS["fresh-blocks-freed-at-once"].config_overrides()
    cfg = WorldConfig(design="fresh-blocks-freed-at-once", **kw)
    ce = explore(cfg, max_seconds=60).counterexample
    assert ce is not None and ce.violation.prop == "use-after-free"
    w, _run, _texts, v = replay(replace(cfg, design="d-first"), ce.actions, record=False)
    q = w.reqs[0]
    assert v is None and w.d[0].ghosts() == {("r0", 0): (0,)}
    assert q.d_blocks == (1,) and q.epoch == 1 and q.retry == ("P0",)
    assert w.s.d_pool[0] == [0, 0]  # both held for r0: the ghost's and the new epoch's
    for _ in range(200):
        if q.d_stage == "done":
            break
        w.apply(w.enabled()[0])
    assert q.d_stage == "done" and w.now < cfg.lease_s
    _drain(w)
    assert w.d[0].ghosts() == {} and w.s.d_pool[0] == [None, None]
    assert w.d[0].counters["ghosts_released"] == 1


def test_an_in_doubt_answer_leaves_the_ghost_to_its_lease() -> None:
    """retry_fresh_blocks, the old sender alive with a write in doubt: the variant's
    counterexample (its AbortAck says "in doubt", the ghost frees the blocks anyway) against
    lw's D: the ghost keeps them past the in-doubt bytes' window, until its lease."""
    name = "fresh-blocks-trust-in-doubt"
    cfg = WorldConfig(design=name, **DESIGNS[name].config_overrides())
    ce = explore(cfg, max_seconds=60).counterexample
    assert ce is not None and ce.violation.prop == "use-after-free"
    w, _run, _texts, v = replay(replace(cfg, design="d-first"), ce.actions, record=False)
    assert v is None and w.d[0].ghosts() == {("r0", 0): (0,)} and w.s.zombies
    _drain(w)
    assert w.d[0].ghosts() == {} and w.d[0].counters["leases_expired"] == 1
    assert w.s.d_pool[0] == [None, None] and w.reqs[0].d_stage == "done"


def _fresh_rows() -> tuple[list[dict], list[dict]]:
    """The strong default's rows of retries into fresh blocks with failed writes: without late
    writes (ownership judged), with them."""
    fresh = [kw for kw in STRONG if kw.get("retry_fresh_blocks") and "write" in kw["fault_kinds"]]
    return ([kw for kw in fresh if not kw.get("late_writes")],
            [kw for kw in fresh if kw.get("late_writes")])


def test_the_strong_check_judges_a_ghosts_blocks_by_ownership() -> None:
    """The strong default retries into fresh blocks with old senders in doubt and without late
    writes, where use-after-free judges who owns the ghost's blocks: the variant that frees
    them on an in-doubt answer is caught there."""
    judged, _late = _fresh_rows()
    assert judged
    res = explore(WorldConfig(design="fresh-blocks-trust-in-doubt", **judged[0]), max_seconds=60)
    assert res.counterexample is not None
    assert res.counterexample.violation.prop == "use-after-free"


@pytest.mark.slow
def test_with_late_writes_a_ghost_freed_on_an_in_doubt_answer_is_caught_too() -> None:
    """With late writes, bytes that land in a freed ghost block while the request now holding
    it decodes are caught as stale KV (no checksum sees them there); before issue 40 only
    landings before a DONE were judged, the checksums caught those, and the variant held."""
    _judged, late = _fresh_rows()
    assert late
    res = explore(WorldConfig(design="fresh-blocks-trust-in-doubt", **late[0]), max_seconds=120)
    assert res.counterexample is not None
    assert res.counterexample.violation.prop == "stale-kv"
