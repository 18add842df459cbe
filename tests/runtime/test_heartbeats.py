"""Liveness: a silent peer that live requests need is declared lost fast; a live one never is."""

from __future__ import annotations

import time

import numpy as np

from lw.fsm import (
    DecodeConfig,
    DecodeEndpoint,
    PrefillConfig,
    ReleaseBlocks,
    Reprefill,
    SendFinished,
)
from lw.transport.dataplane import InProcessDataPlane
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import SideChannel
from lw.transport.wire import KVLayout, Sender

from .loops import BLEN, NBLK, L, layouts, make_pair, wait_for

HB = {"heartbeat_s": 0.1, "heartbeat_misses": 3}
SLOW_P = PrefillConfig(meta_retry_s=5, ack_retry_s=5, request_timeout_s=30)


def test_a_decoder_that_goes_silent_is_lost_within_the_heartbeat_budget() -> None:
    pair = make_pair(pcfg=SLOW_P, **HB)
    try:
        pair.start("r1", (0, 1), (2, 3))
        wait_for(lambda: pair.p.endpoint.state_of("r1") == "META_READY")
        pair.d.stop()  # D's process is gone: nothing answers any more
        t0 = time.monotonic()
        pair.wait_reports(1, 0)
        took = time.monotonic() - t0
        (fin,) = [e for e in pair.p_reports if isinstance(e, SendFinished)]
        assert not fin.ok and "decoder lost" in fin.reason and "heartbeat" in fin.reason
        # timing: within the heartbeat budget (3 x 0.1 s plus a round), 10x generous: far
        # below the next way P would notice (its 5 s retries; the request deadline is 30 s)
        assert took < 4.0, took
        assert pair.p.counters["peers_lost"] == 1
    finally:
        pair.stop()


def test_a_quiet_but_live_decoder_is_never_lost() -> None:
    pair = make_pair(pcfg=SLOW_P, **HB)
    try:
        pair.start("r1", (0, 1), (2, 3))
        wait_for(lambda: pair.p.endpoint.state_of("r1") == "META_READY")
        # ten intervals with no protocol traffic: only heartbeats
        wait_for(lambda: pair.p.counters["heartbeats_sent"] >= 10)
        assert pair.p.counters["peers_lost"] == 0
        pair.compute("r1", (0, 1))
        pair.wait_reports(1, 1)
        assert [e.ok for e in pair.p_reports if isinstance(e, SendFinished)] == [True]
    finally:
        pair.stop()


def test_a_worker_that_was_stalled_itself_does_not_blame_its_peers() -> None:
    pair = make_pair(pcfg=SLOW_P, **HB)
    try:
        pair.start("r1", (0, 1), (2, 3))
        wait_for(lambda: pair.p.endpoint.state_of("r1") == "META_READY")

        def stall(lp):  # type: ignore[no-untyped-def]
            time.sleep(0.6)  # the loop thread itself does not run (SIGSTOP, starved CPU)
            lp._heartbeat(lp._clock())
            return lp.counters["self_stalls"], lp.counters["peers_lost"]

        stalls, lost = pair.p.run(stall).result(5)
        assert stalls >= 1 and lost == 0
    finally:
        pair.stop()


def test_heartbeats_off_leave_detection_to_the_retries() -> None:
    pair = make_pair(pcfg=SLOW_P, heartbeat_s=0)
    try:
        pair.start("r1", (0, 1), (2, 3))
        wait_for(lambda: pair.p.endpoint.state_of("r1") == "META_READY")
        pair.d.stop()
        time.sleep(0.6)
        assert pair.p.counters["heartbeats_sent"] == 0 and pair.p.endpoint.live_requests()
    finally:
        pair.stop()


def test_an_orphan_of_a_silent_prefill_is_prefilled_again_within_the_heartbeat_budget() -> None:
    """Prefill failover (issue 22): the P a request was routed to dies before it claims; D
    watches it from the routing on, so heartbeats find it and D asks for a re-prefill at
    once, long before its 5 s prefill deadline."""
    mem = np.zeros((L, NBLK, BLEN), dtype=np.uint8)
    dp = InProcessDataPlane(timeout_s=1.0)
    dp.register_memory(mem.ctypes.data, mem.nbytes)
    side, gone = SideChannel(), SideChannel()
    dead_addr = gone.addr
    gone.close()  # the P process is gone: nothing answers at its address
    ep = DecodeEndpoint(Sender("D", 0, 1, side.addr), KVLayout("D", 1, dp.session, layouts(mem)),
                        DecodeConfig(prefill_timeout_s=5, lease_s=10, retry_prefill=1))
    d = WorkerLoop(ep, side, dp, name="test-d", **HB).start()
    try:
        d.call("add_request", "r1", (0, 1), 1).result(5)
        t0 = time.monotonic()
        d.call("prefill_routed", "r1", "P-dead", dead_addr, 0).result(5)
        got = wait_for(lambda: [e for e in d.drain_reports() if isinstance(e, Reprefill)])
        took = time.monotonic() - t0
        assert [(e.epoch, e.avoid, e.fenced) for e in got] == [(1, ("P-dead",), False)]
        # found by heartbeats, not by the 5 s prefill deadline
        assert d.counters["peers_lost"] == 1 and d.endpoint.counters["deadlines"] == 0
        # timing: within the heartbeat budget (3 x 0.1 s plus a round), generous: under 5 s
        assert took < 4.0, took
    finally:
        d.stop()


def test_a_lost_claimed_prefill_goes_on_in_fresh_blocks_from_the_loops_allocator() -> None:
    """retry_fresh_blocks through the runtime's ports: the loop's allocator answers D's
    question on the loop thread, the Reprefill names the fresh blocks, and the old ones come
    back (ReleaseBlocks) once the old sender answered the abort."""
    pair = make_pair(pcfg=SLOW_P, dcfg=DecodeConfig(prefill_timeout_s=5, lease_s=10,
                                                    retry_prefill=1, retry_fresh_blocks=True))
    asked: list[tuple[str, int]] = []

    def fresh(rid: str, n: int) -> tuple[int, ...]:
        asked.append((rid, n))
        return (6, 7)

    pair.d._fresh_blocks = fresh  # before any loss: the loop thread reads it only then
    try:
        pair.start("r1", (0, 1), (2, 3))
        wait_for(lambda: pair.p.endpoint.state_of("r1") == "META_READY")  # claimed
        pair.d.call("peer_lost", "P", "test: heartbeats lost").result(5)
        pair.wait_reports(0, 2)
        rp = [e for e in pair.d_reports if isinstance(e, Reprefill)]
        rel = [e for e in pair.d_reports if isinstance(e, ReleaseBlocks)]
        assert asked == [("r1", 2)]
        assert [(e.epoch, e.block_ids, e.fenced) for e in rp] == [(1, (6, 7), False)]
        assert [(e.epoch, e.block_ids) for e in rel] == [(0, (2, 3))]
        assert pair.d.endpoint.ghosts() == {}
    finally:
        pair.stop()
