"""Chunked prefill in the checker's world: P's scheduler keeps a request for one step per chunk,
each chunk's blocks are pushed layer by layer as it computes them, and what the properties read
(writes in flight, landed KV, placement) is per (chunk, layer) and per block."""

from __future__ import annotations

import pytest

from lw.fsm import WriteLayer
from lw.sim.explorer import drain, explore
from lw.sim.properties import Violation
from lw.sim.world import Action, World, WorldConfig

CHUNKED = dict(dp=1, requests=1, layers=2, chunks=2, blocks_per_request=2, d_blocks=2,
               p_blocks=2)


def _do(w: World, kind: str, *args: object) -> Action:
    """Apply the first enabled action of this kind (and these arguments)."""
    for a in w.enabled():
        if a[0] == kind and a[1:1 + len(args)] == args:
            w.apply(a)
            return a
    raise AssertionError(f"no {kind}{args} enabled in {w.enabled()}")


def _deliver(w: World, kind: str) -> None:
    for a in w.enabled():
        if a[0] == "deliver" and a[1][2] == kind:
            w.apply(a)
            return
    raise AssertionError(f"no {kind} in flight")


def _first_step_with_meta(w: World) -> None:
    """r0 allocated on D, started on P, D's claim accepted, its first chunk computed."""
    for kind in ("arrive", "alloc", "start", "schedule"):
        _do(w, kind)
    _deliver(w, "MetaRequest")
    _deliver(w, "MetaReply")
    for _ in range(w.cfg.layers):
        _do(w, "layer")


@pytest.mark.parametrize(("chunks", "n", "sizes"), [
    (1, 3, (3,)), (2, 1, (0, 1)), (2, 2, (1, 1)), (2, 3, (2, 1)), (2, 5, (3, 2)),
    (3, 2, (0, 1, 1)), (3, 6, (2, 2, 2)), (2, 0, (0, 0)),
])
def test_chunks_after_the_first_each_complete_a_block(chunks: int, n: int,
                                                      sizes: tuple[int, ...]) -> None:
    cfg = WorldConfig(chunks=chunks, blocks_per_request=max(n, 1), d_blocks=max(n, 1),
                      p_blocks=max(n, 1))
    assert cfg.chunk_sizes(n) == sizes and sum(sizes) == n


def test_a_split_with_an_empty_later_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="only the first chunk may complete no block"):
        WorldConfig(chunks=3, blocks_per_request=1)
    with pytest.raises(ValueError, match="request 0 sends 1 block"):  # a prefix hit leaves 1
        WorldConfig(chunks=3, blocks_per_request=2, d_blocks=2, p_blocks=2, prefix_hits=(1,))
    WorldConfig(chunks=3, blocks_per_request=2, d_blocks=2, p_blocks=2, prefix_hits=(2,))


def test_each_chunk_is_pushed_while_the_next_computes() -> None:
    w = World(WorldConfig(**CHUNKED))
    _first_step_with_meta(w)
    q = w.reqs[0]
    assert w.s.p_running == [[0]] and q.chunk == 1 and w.s.phase is None
    assert [(x[1], x[2], x[3]) for x in w.s.fifo[0]] == [(0, (0,), (0,)), (1, (0,), (0,))]
    _do(w, "schedule")
    _do(w, "layer")  # chunk 1's layer 0 while chunk 0's writes are still in flight
    assert [(x[1], x[2], x[3]) for x in w.s.fifo[0]] == [
        (0, (0,), (0,)), (1, (0,), (0,)), (2, (1,), (1,))]
    assert w.p[0].state_of("r0") == "META_READY"
    _do(w, "complete", 0)
    _do(w, "complete", 0)
    assert w.p[0].state_of("r0") == "CHUNK_SENT"
    assert q.landed == {(0, 0, k, 0) for k in (0, 1)}
    drain(w)
    assert q.d_stage == "done" and q.send_ok == (True,) and q.recv_ok == (True,)
    assert q.landed == {(0, 0, k, b) for k in (0, 1) for b in (0, 1)}
    assert w.s.p_pool == [[None, None]] and w.s.d_pool == [[None, None]]


def test_a_first_chunk_without_a_block_claims_d_and_writes_nothing() -> None:
    w = World(WorldConfig(dp=1, requests=1, layers=2, chunks=2))
    _first_step_with_meta(w)
    assert w.p[0].state_of("r0") == "META_READY" and w.s.fifo == [[]]
    _do(w, "schedule")
    _do(w, "layer")
    assert [(x[1], x[2], x[3]) for x in w.s.fifo[0]] == [(0, (0,), (0,))]  # seq 0 of the core
    assert w.s.what(0, 0) == "chunk 1 layer 0"
    drain(w)
    assert w.reqs[0].d_stage == "done"


def test_a_client_abort_between_chunks_stops_the_prefill() -> None:
    w = World(WorldConfig(**CHUNKED, faults=True, fault_kinds=("abort",), delays=False))
    _first_step_with_meta(w)
    _do(w, "abort_p", 0)
    q = w.reqs[0]
    assert w.s.p_running == [[]] and w.p[0].state_of("r0") == "FAILED"
    assert w.s.p_pool == [[0, 0]]  # its writes still read them
    drain(w)
    assert q.chunk == 1 and q.p_stage == "released" and q.send_ok == (False,)
    assert w.s.p_pool == [[None, None]] and w.s.d_pool == [[None, None]]


def test_a_send_that_failed_mid_prefill_frees_p_blocks_only_at_its_end() -> None:
    """D aborts between chunks; P fails the request and reports it finished sending, but vLLM
    computes its last chunk into those blocks before it frees them."""
    w = World(WorldConfig(**CHUNKED, faults=True, fault_kinds=("abort",), delays=False))
    _first_step_with_meta(w)
    _do(w, "abort_d", 0)
    _deliver(w, "Abort")
    _do(w, "complete", 0)
    _do(w, "complete", 0)
    q = w.reqs[0]
    assert q.send_reports == (1,) and q.send_ok == (False,) and q.p_stage == "finished"
    assert w.s.p_running == [[0]] and w.s.p_pool == [[0, 0]] and w.s.p_free_pending == [[0]]
    _do(w, "schedule")
    for _ in range(2):
        _do(w, "layer")
    assert w.s.p_pool == [[None, None]] and q.p_stage == "released"
    drain(w)


def test_placement_is_checked_per_chunk() -> None:
    w = World(WorldConfig(**CHUNKED))
    _first_step_with_meta(w)
    lay = w.d[0].layout
    wrong = WriteLayer("r0", 0, lay, (1,), (1,), None, "d0", 0)  # chunk 1's blocks as chunk 0
    with pytest.raises(Violation, match="kv-placement.*chunk 0 completes are in P block"):
        w.data.on_write(0, wrong)
    early = WriteLayer("r0", 0, lay, (1,), (1,), None, "d0", 2)  # chunk 1, not computed yet
    with pytest.raises(Violation, match="before the forward pass computed it"):
        w.data.on_write(0, early)


def _later_chunk_landed_first(unordered: bool) -> bool:
    found = []

    def visit(w: World) -> None:
        q = w.reqs[0]
        if any(x[1] == 0 for x in w.s.fifo[0]) and any(t[3] == 1 for t in q.landed):
            found.append(True)

    res = explore(WorldConfig(**CHUNKED, unordered_writes=unordered), on_state=visit)
    assert res.counterexample is None and res.complete
    return bool(found)


def test_only_an_unordered_data_plane_lands_a_later_chunk_first() -> None:
    """lw's data plane reports a destination's writes in submission order; with
    ``unordered_writes`` chunk 1 can land while chunk 0 is in flight (the core's
    out-of-order bookkeeping, and the variant done-before-earlier-chunk)."""
    assert _later_chunk_landed_first(True)
    assert not _later_chunk_landed_first(False)
