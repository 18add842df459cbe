"""Liveness: a silent peer that live requests need is declared lost fast; a live one never is,
nor a slow one whose pauses the connection has shown (the budget adapts, within a floor and
a cap)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import pytest

from lw.fsm import (
    DecodeConfig,
    DecodeEndpoint,
    PrefillConfig,
    ReleaseBlocks,
    Reprefill,
    SendFinished,
)
from lw.transport.dataplane import InProcessDataPlane
from lw.transport.liveness import Liveness
from lw.transport.loopconfig import LoopConfig
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
        assert "our connection to it is down" in fin.reason  # dead, not slow
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


def test_writes_landing_keep_a_decoder_with_a_starved_protocol_thread_alive() -> None:
    """Liveness by progress (issue 40): D's protocol thread does not run for 1.2 s (starved of
    CPU on a loaded host) while P's writes keep landing in D's memory: P does not declare D
    lost, although no message answers for four times the 0.3 s heartbeat floor."""
    pair = make_pair(pcfg=SLOW_P, **HB)
    try:
        reqs = [(f"r{i}", (2 * i, 2 * i + 1), (8 + 2 * i, 9 + 2 * i)) for i in range(3)]
        for rid, local, remote in reqs:
            pair.start(rid, local, remote)
        wait_for(lambda: all(pair.p.endpoint.state_of(r) == "META_READY" for r, _l, _r in reqs))
        stalled = pair.d.run(lambda lp: time.sleep(1.2))  # D's loop thread blocked
        for layer in range(L):
            for rid, local, _remote in reqs:
                pair.compute(rid, local, range(layer, layer + 1))
                time.sleep(0.1)  # a write lands every 0.1 s, under the 0.3 s floor
        stalled.result(10)
        pair.wait_reports(3, 3)
        assert pair.p.counters["peers_lost"] == 0
        assert [e.ok for e in pair.p_reports if isinstance(e, SendFinished)] == [True] * 3
    finally:
        pair.stop()


def test_a_decoder_whose_loop_is_frozen_but_whose_process_lives_is_kept_then_served() -> None:
    """Slow is not dead (issue 40): D's protocol thread does not run for 2 s, seven times the
    0.3 s floor, with nothing landing; P's connection to its side
    channel stays up, so P keeps it (up to the 30 s cap) and the request completes once D
    runs again."""
    pair = make_pair(pcfg=SLOW_P, **HB)
    try:
        pair.start("r1", (0, 1), (2, 3))
        wait_for(lambda: pair.p.endpoint.state_of("r1") == "META_READY")
        frozen = pair.d.run(lambda lp: time.sleep(2.0))
        time.sleep(0.2)
        pair.compute("r1", (0, 1))  # writes wait on D's answer to nothing: they land
        frozen.result(10)
        pair.wait_reports(1, 1)
        assert pair.p.counters["peers_lost"] == 0
        assert [e.ok for e in pair.p_reports if isinstance(e, SendFinished)] == [True]
    finally:
        pair.stop()


def test_a_frozen_decoder_is_lost_at_the_cap_and_says_its_process_held_its_port() -> None:
    pair = make_pair(pcfg=SLOW_P, heartbeat_cap_s=1.0, **HB)
    try:
        pair.start("r1", (0, 1), (2, 3))
        wait_for(lambda: pair.p.endpoint.state_of("r1") == "META_READY")
        t0 = time.monotonic()
        frozen = pair.d.run(lambda lp: time.sleep(4.0))
        pair.wait_reports(1, 0)
        took = time.monotonic() - t0
        (fin,) = [e for e in pair.p_reports if isinstance(e, SendFinished)]
        assert not fin.ok and "heartbeat_cap_s 1s" in fin.reason
        assert "our connection to it is up: its process lives" in fin.reason
        assert 1.0 < took < 3.5, took  # at the cap, not at the 0.3 s floor
        frozen.result(10)
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
    d = WorkerLoop(ep, side, dp, LoopConfig(name="test-d", **HB)).start()
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


# ------------------------------------------------------------ the detector alone, on a fake clock
def drive(hb: Liveness, until: float, answers: Iterable[float] = (), start: float = 0.0,
          peer: str = "d") -> list[tuple[float, float]]:
    """Rounds every interval from ``start`` to ``until`` with ``peer`` needed, which answers at
    the times ``answers`` (each heard before the round that follows it), until it is lost (the
    core then fails what needed it): [(round time, seconds quiet)] of the loss, or []."""
    pending = sorted(answers)
    i = 0
    while (t := start + i * hb.interval_s) <= until:
        while pending and pending[0] <= t:
            hb.heard(peer, pending.pop(0))
        _, lost, _ = hb.round([peer], t)
        if lost:  # the core's verdict with no probe possible: lost
            for addr, _ in lost:
                hb.lost(addr)
            return [(t, quiet) for _, quiet in lost]
        i += 1
    return []


def test_a_peer_that_has_shown_long_pauses_is_not_lost_in_a_shorter_one() -> None:
    hb = Liveness(0.5, 3)  # floor 1.5 s
    # pauses that grow under load: 1.2 s (within the floor), then 3 s ones
    assert drive(hb, 10.5, [1.2, 4.2, 7.2, 10.2]) == []
    assert hb.budget("d", 10.5) == pytest.approx(9.0, rel=0.01)  # 3 x the 3 s pause
    assert drive(hb, 12.5, start=11.0) == []  # 2 s quiet and more: not lost
    # silent for good: lost near three such pauses (their weight fading a little meanwhile),
    # long before the cap
    (t, quiet), = drive(hb, 40.0, start=13.0)
    assert 10.2 + 8.0 < t <= 10.2 + 9.0 + 0.5 and quiet > 8.0


def test_a_first_pause_past_the_floor_is_still_lost() -> None:
    hb = Liveness(0.5, 3)
    assert drive(hb, 5.0, [3.0]) == [(2.0, 2.0)]  # nothing shown yet: the floor


def test_a_peer_lost_in_a_pause_that_speaks_again_lifts_its_budget() -> None:
    """The pause that cost a request is learned too (seen on the 2-core heterogeneous-TP demo:
    a live D lost at 1.9 s again and again, the budget stuck at the floor): the peer's next
    answer ends a silence it came back from, and the next such pause is survived."""
    hb = Liveness(0.5, 3)
    assert drive(hb, 5.0, [3.0]) == [(2.0, 2.0)]  # lost at the floor; it answers at 3.0
    hb.heard("d", 3.0)
    assert hb.budget("d", 3.0) == pytest.approx(9.0)  # 3 x the 3 s it was silent
    assert drive(hb, 9.0, [8.0], start=5.0) == []  # the same pause again: not lost


def test_a_steady_fast_peer_is_lost_after_the_floor() -> None:
    hb = Liveness(0.5, 3)
    assert drive(hb, 10.0, [i * 0.1 for i in range(101)]) == []
    assert hb.budget("d", 10.0) == 1.5
    assert drive(hb, 20.0, start=10.5) == [(12.0, 2.0)]  # quiet 2.0 > 1.5 at the next round


def test_the_cap_bounds_the_budget_however_long_the_pauses_shown() -> None:
    hb = Liveness(0.5, 3, cap_s=30.0)
    hb.heard("d", 0.0)
    hb.heard("d", 1000.0)  # came back after 1000 s
    assert hb.budget("d", 1000.0) == 30.0
    assert drive(hb, 1100.0, start=1000.0) == [(1030.5, 30.5)]


def test_a_peer_never_heard_from_gets_the_floor() -> None:
    hb = Liveness(0.5, 3)
    assert hb.budget("d", 0.0) == 1.5
    assert drive(hb, 5.0) == [(2.0, 2.0)]


def test_a_backlog_of_answers_after_a_pause_keeps_the_budget_and_history_fades() -> None:
    hb = Liveness(0.5, 3)
    drive(hb, 4.0, [1.2, 4.0, 4.0, 4.0, 4.0])  # four heartbeats answered at once after 2.8 s
    assert hb.budget("d", 4.0) == pytest.approx(8.4)
    # the history outlives the peer being needed, and fades: half each HALF_LIFE_S
    hb.round([], 5.0)
    assert hb.budget("d", 4.0 + hb.HALF_LIFE_S) == pytest.approx(4.2)
    assert hb.budget("d", 4.0 + 10 * hb.HALF_LIFE_S) == 1.5
    hb.round([], 4.0 + 10 * hb.HALF_LIFE_S)
    assert hb._shown == {}  # forgotten once it lifts the budget no more


def test_a_late_round_is_our_silence_not_the_peers() -> None:
    hb = Liveness(1.0, 3)
    assert drive(hb, 2.0, [0.0]) == []
    assert hb.round(["d"], 10.0) == ([], [], True)  # we were stopped: every clock restarts
    assert hb.round(["d"], 13.0)[1:] == ([], True)
    assert drive(hb, 20.0, start=14.0) == [(17.0, 4.0)]
    # a round merely behind its time (1.8 s after the last, not 2 intervals) takes the 0.8 s
    # off: quiet 3.8 s counts as 3.0, not over the 3 s floor
    hb = Liveness(1.0, 3)
    drive(hb, 2.0, [0.0])
    assert hb.round(["d"], 3.8) == (["d"], [], False)
    assert hb.round(["d"], 4.8)[1] == [("d", 4.0)]


@pytest.mark.parametrize(("args", "kw", "says"), [
    ((-1.0, 3), {}, "heartbeat_s must be >= 0"),
    ((float("nan"), 3), {}, "heartbeat_s must be >= 0"),
    ((0.5, 0), {}, "heartbeat_misses must be >= 1"),
    ((0.5, 3), {"cap_s": 0.0}, "heartbeat_cap_s must be a finite number"),
    ((0.5, 3), {"cap_s": float("inf")}, "heartbeat_cap_s must be a finite number"),
    ((0.5, 3), {"cap_s": 1.0}, r"heartbeat_cap_s \(1.0\) must be >= .* \(1.5\)"),
    ((0.5, 3), {"factor": 0.5}, "heartbeat_factor must be >= 1"),
    ((0.5, 3), {"factor": float("nan")}, "heartbeat_factor must be >= 1"),
])
def test_bad_liveness_settings_are_refused_clearly(args: tuple[float, int], kw: dict[str, float],
                                                   says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Liveness(*args, **kw)
    assert not Liveness(0.0, 3, cap_s=0.1).on  # off: the cap need not cover a floor of 0


def test_the_loop_settings_carry_the_budget_and_refuse_a_cap_under_the_floor() -> None:
    """The cap and factor reach the loop's detector from its config (the connector's
    heartbeat_cap_s), and a bad pair fails when the config is made, not in a spawned worker."""
    hb = LoopConfig(heartbeat_s=0.2, heartbeat_misses=2, heartbeat_cap_s=5.0,
                    heartbeat_factor=2.0).liveness()
    assert (hb.floor_s, hb.cap_s, hb.factor) == (0.4, 5.0, 2.0)
    with pytest.raises(ValueError, match=r"heartbeat_cap_s \(1.0\) must be >= .* \(1.5\)"):
        LoopConfig(heartbeat_s=0.5, heartbeat_misses=3, heartbeat_cap_s=1.0)
