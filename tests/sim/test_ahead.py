"""Computing ahead in the checker's world: P computes before D's blocks are known, D's
allocation binds it, a prefill dropped before the bind is refused and started again D first,
and D's prefix hit is computed but never written."""

from __future__ import annotations

from lw.sim.explorer import drain, explore
from lw.sim.world import World, WorldConfig

from .test_chunks import _do

AHEAD = "compute-ahead"


def _computed_ahead(w: World) -> None:
    """r0 arrives, P schedules it and computes every layer before D allocates."""
    _do(w, "arrive")
    _do(w, "schedule")
    for _ in range(w.cfg.layers):
        _do(w, "layer")
    assert w.p[0].state_of("r0") == "AHEAD" and not w.s.fifo[0]


def test_layers_computed_ahead_are_written_once_d_allocates() -> None:
    w = World(WorldConfig(design=AHEAD, dp=1, requests=1, layers=2))
    _computed_ahead(w)
    _do(w, "alloc", 0)  # binds P: it claims D, then writes what it computed
    assert w.p[0].state_of("r0") == "AWAIT_DECODER_META"
    drain(w)
    q = w.reqs[0]
    assert q.d_stage == "done" and q.send_ok == (True,) and q.ahead == "bound"


def test_a_prefill_dropped_before_the_bind_is_started_again_d_first() -> None:
    w = World(WorldConfig(design=AHEAD, dp=1, requests=1, layers=1, faults=True,
                          fault_kinds=()))
    _computed_ahead(w)
    # the clock reaches P's ahead_wait_s before D allocates: P drops it and frees its block
    _do(w, "timer", ("p", 0), ("deadline", "r0"))
    q = w.reqs[0]
    assert w.p[0].state_of("r0") == "FAILED" and w.s.p_pool[0] == [None]
    _do(w, "alloc", 0)
    assert q.refused and not w.s.fifo[0]  # refused: nothing written from the freed block
    _do(w, "fallback", 0)
    assert q.ahead == "" and q.p_stage == "queued"
    drain(w)
    assert q.d_stage == "done" and q.send_ok == (True,)


def test_a_full_prefix_hit_on_d_ends_the_prefill_computed_ahead_unsent() -> None:
    w = World(WorldConfig(design=AHEAD, dp=1, requests=1, layers=1, prefix_hits=(1,)))
    _computed_ahead(w)
    _do(w, "alloc", 0)
    q = w.reqs[0]
    assert w.p[0].state_of("r0") == "DONE" and q.d_stage == "decoding" and not w.s.fifo[0]
    drain(w)
    assert w.s.p_pool[0] == [None] and q.d_stage == "done"


def test_prefix_hit_blocks_are_computed_but_not_written() -> None:
    w = World(WorldConfig(design=AHEAD, dp=1, requests=1, layers=1, blocks_per_request=2,
                          d_blocks=2, p_blocks=2, prefix_hits=(1,)))
    _computed_ahead(w)
    _do(w, "alloc", 0)
    drain(w)
    q = w.reqs[0]
    assert q.d_stage == "done" and {b for *_, b in q.landed} == set(q.d_remote) == {1}


def test_computing_ahead_holds_with_lost_and_duplicated_messages() -> None:
    res = explore(WorldConfig(design=AHEAD, dp=1, requests=2, layers=1, faults=True,
                              fault_kinds=("drop", "dup"), delays=False),
                  max_seconds=60, check_cycles=True)
    assert res.counterexample is None and res.complete


def test_a_request_queued_on_a_p_rank_that_dies_before_d_allocates_is_started_d_first() -> None:
    """Prefill failover, computing ahead: r0 went to P rank 0 with D, rank 0 dies before it
    scheduled r0 (nothing computed); D's allocation then sees P's ahead request failed and the
    proxy starts r0 D first on the live rank, which prefills it (before: D waited for its
    prefill deadline, although a rank lived and the retry budget was left)."""
    w = World(WorldConfig(design=AHEAD, dp=2, requests=1, layers=1, faults=True,
                          fault_kinds=("rank-crash",), delays=False, retry_prefill=1))
    _do(w, "arrive")
    q = w.reqs[0]
    assert q.p_stage == "queued" and q.p_rank == 0
    _do(w, "crash_rank", 0)
    _do(w, "alloc", 0)
    assert q.p_rank == 1 and q.p_stage == "queued" and q.ahead == ""
    drain(w)
    assert q.d_stage == "done" and q.send_ok == (True,)


def test_a_d_called_before_p_scheduled_watches_that_p() -> None:
    """D allocates while P has r0 queued, not scheduled: D's call is answered with the P of
    the attempt, so D notices that rank's death and prefills again elsewhere (the runtime's
    metaserver answer names the attempt's P in every case)."""
    w = World(WorldConfig(design=AHEAD, dp=2, requests=1, layers=1, faults=True,
                          fault_kinds=("rank-crash",), delays=False, retry_prefill=1))
    _do(w, "arrive")
    _do(w, "alloc", 0)  # routed now; P adds it with D's blocks when it schedules it
    _do(w, "crash_rank", 0)
    drain(w)
    q = w.reqs[0]
    assert q.d_stage == "done" and q.p_rank == 1 and q.epoch == 1


def test_computing_ahead_holds_under_prefill_failover() -> None:
    res = explore(WorldConfig(design=AHEAD, dp=2, requests=2, layers=1, faults=True,
                              fault_kinds=("rank-crash", "write"), delays=False,
                              retry_prefill=1),
                  max_seconds=60, check_cycles=True)
    assert res.counterexample is None and res.complete
