"""Observability of the core: timelines, ``lw status`` rows and the stuck-request alarm."""

from __future__ import annotations

import pytest

from lw.fsm import (
    DecodeConfig,
    KeptSums,
    PrefillConfig,
    ProtocolError,
    RecvDone,
    SumBlocks,
    SumPlan,
    Sums,
)
from lw.fsm.status import status_line
from lw.fsm.timeline import Timeline, state_class

from .harness import D_ADDR, P_ADDR, Pair
from .test_endpoints import L, compute_all, make_pair, send_done, start


def test_timeline_records_every_fired_event_in_order_on_both_sides() -> None:
    pair = make_pair()
    start(pair)
    pair.now = 1.0
    pair.deliver_all()
    compute_all(pair)
    pair.now = 2.0
    pair.complete_writes()
    pair.deliver_all()
    p_events = [(e[2], e[3], e[4]) for e in pair.ps[0].timeline.of("r1")]
    assert p_events[0] == ("admitted", "", "AWAIT_DECODER_META")
    assert ("meta_accepted", "AWAIT_DECODER_META", "META_READY") in p_events
    assert [e for e in p_events if e[0] == "layer_computed"] == [("layer_computed", "", "")] * L
    sent = [e[2] for e in p_events if e[0] == "layer_sent"]
    assert sent == [f"LAYER_{k}_SENT" for k in range(L)]
    assert p_events[-1] == ("ack", f"LAYER_{L - 1}_SENT", "DONE")
    d_events = [(e[2], e[3], e[4]) for e in pair.d.timeline.of("r1")]
    assert d_events == [("allocated", "", "PREFILL_REQUESTED"),
                        ("claim", "PREFILL_REQUESTED", "RECEIVING"),
                        ("sender_done", "RECEIVING", "RECEIVING"),
                        ("all_done", "RECEIVING", "DONE")]
    times = [e[0] for e in pair.ps[0].timeline.of("r1")]
    assert times == sorted(times)
    # Each state change left one time-in-state sample, classes bounded (LAYER_k -> LAYER_SENT).
    classes = {c for c, _ in pair.ps[0].timeline.drain_durations()}
    assert classes == {"AWAIT_DECODER_META", "META_READY", "LAYER_SENT"}
    assert not pair.ps[0].timeline.drain_durations()


def test_timeline_off_records_nothing_and_changes_no_behaviour() -> None:
    on, off = make_pair(), make_pair(pcfg=PrefillConfig(timeline_entries=0),
                                     dcfg=DecodeConfig(timeline_entries=0))
    for pair in (on, off):
        start(pair)
        pair.deliver_all()
        compute_all(pair)
        pair.complete_writes()
        pair.deliver_all()
    assert len(off.ps[0].timeline) == 0 and len(off.d.timeline) == 0
    assert off.ps[0].snapshot() == on.ps[0].snapshot()
    assert off.d.snapshot() == on.d.snapshot()
    assert [type(e) for e in off.finished] == [type(e) for e in on.finished]


def test_ring_is_bounded_and_keeps_the_newest() -> None:
    tl = Timeline(3)
    for i in range(5):
        tl.record(float(i), f"r{i}", "e")
    assert [e[1] for e in tl] == ["r2", "r3", "r4"]
    assert [e[1] for e in tl.last(2)] == ["r3", "r4"]
    tl.record(5.0, ("r3", "r9"), "layer_computed")
    assert [e[2] for e in tl.of("r9")] == ["layer_computed"]
    assert state_class("LAYER_17_SENT") == "LAYER_SENT"


def test_status_names_state_peer_and_deadline_while_waiting_for_meta() -> None:
    pair = make_pair(pcfg=PrefillConfig(request_timeout_s=30.0))
    start(pair)  # MetaRequest queued, not delivered: P waits for D
    pair.now = 4.0
    (row,) = pair.ps[0].status(pair.now)
    assert row.state == "AWAIT_DECODER_META"
    assert row.peers == [D_ADDR]
    assert "MetaReply" in row.waiting_for and D_ADDR in row.waiting_for
    assert row.in_state_s == 4.0 and row.deadline_in_s == 26.0
    assert row.blocks == 3 and row.layers_done == 0 and row.layers_total == L
    assert pair.ps[0].status(pair.now, "nope") == []
    (drow,) = pair.d.status(pair.now)
    assert drow.state == "PREFILL_REQUESTED" and "MetaRequest" in drow.waiting_for


def test_status_of_receiving_and_quarantined_requests_names_the_senders() -> None:
    pair = make_pair(n_ranks=2, dcfg=DecodeConfig(prefill_timeout_s=10.0, lease_s=90.0))
    start(pair, expected=2, rank=0)
    pair.deliver_all()
    (row,) = pair.d.status(pair.now)
    assert row.state == "RECEIVING"
    assert row.peers == [f"{P_ADDR}/0"]
    assert "P P rank 0" in row.waiting_for and "0 of 2" in row.waiting_for
    pair.now = 10.0  # D's deadline fires with a claimed sender: quarantine until it stops
    pair.absorb("d", pair.d.on_timer(("deadline", "r1"), pair.now))
    (row,) = pair.d.status(pair.now)
    assert row.state == "FAILED" and row.quarantined
    assert row.deadline_in_s > 0  # the lease now
    line = status_line("decode", pair.d.me, row)
    assert line.startswith("D D rank 0 request r1 FAILED for ") and "lease ends in" in line


def test_stuck_alarm_fires_once_per_state_after_the_configured_fraction() -> None:
    pair = make_pair(pcfg=PrefillConfig(request_timeout_s=10.0, stuck_fraction=0.5,
                                        meta_retry_s=100.0))
    start(pair)
    p = pair.ps[0]
    assert p.stuck(4.9) == []
    (row,) = p.stuck(5.1)
    assert row.stuck and row.state == "AWAIT_DECODER_META"
    assert p.stuck(6.0) == []  # once per state
    pair.now = 6.0
    pair.deliver_all()  # accepted: a new state, the alarm is re-armed
    assert [r.state for r in p.stuck(6.0)] == []
    assert [r.state for r in p.stuck(11.5)] == ["META_READY"]


# ------------------------------------------------------------------------------ KV checksums
def _done_with(pair: Pair, sums: list[int] | None) -> None:
    """Deliver P's DoneSending to D with ``sums`` as its checksums (D's own: range(n))."""
    send_done(pair, sums or [], list(range(L * 3)))  # 3 blocks per request in the harness
    pair.deliver_all()


def test_matching_checksums_finish_the_request_and_a_mismatch_names_layer_and_block() -> None:
    ok = make_pair(dcfg=DecodeConfig(kv_checksum=True))
    _done_with(ok, list(range(L * 3)))
    assert [type(e).__name__ for e in ok.recv] == ["RecvDone"]

    bad = make_pair(dcfg=DecodeConfig(kv_checksum=True))
    sums = list(range(L * 3))
    sums[4] += 1  # layer 1, second block (D block 6)
    _done_with(bad, sums)
    (failed,) = bad.recv
    assert type(failed).__name__ == "RecvFailed"
    assert "KV checksum mismatch" in failed.reason and "layer 1 block 6" in failed.reason
    assert bad.d.counters["checksum_mismatches"] == 1
    assert [f.ok for f in bad.finished] == [False]  # P learns it through the refused DONE
    assert not bad.d.live_requests()  # the sender had stopped: nothing to quarantine


def test_kv_checksum_on_d_refuses_a_done_without_checksums() -> None:
    pair = make_pair(dcfg=DecodeConfig(kv_checksum=True))
    _done_with(pair, None)
    (failed,) = pair.recv
    assert "sent none" in failed.reason and "kv_checksum" in failed.reason


def test_sum_plan_names_the_blocks_and_runs_a_sender_wrote() -> None:
    pair = make_pair()
    start(pair)
    pair.deliver_all()
    plan = pair.d.sum_plan("r1", ("P", 0))
    assert plan == SumPlan(("P", 0), (5, 6, 7), (((0, 4096),),) * L)
    assert pair.d.sum_plan("r1", ("P", 9)) is None and pair.d.sum_plan("nope", ("P", 0)) is None


def test_awaited_peers_are_the_peers_live_requests_still_need() -> None:
    pair = make_pair(n_ranks=2)
    start(pair, expected=2, rank=0)
    assert pair.ps[0].awaited_peers() == {D_ADDR: D_ADDR}
    assert pair.d.awaited_peers() == {}  # nobody claimed yet: D cannot know whom to watch
    pair.deliver_all()
    assert pair.d.awaited_peers() == {f"{P_ADDR}/0": "P"}  # the claimer, by engine for peer_lost
    compute_all(pair)
    pair.complete_writes()
    pair.deliver_all()  # rank 0 done; D still waits for rank 1, which never claimed
    assert pair.ps[0].awaited_peers() == {}
    assert pair.d.awaited_peers() == {}
    pair.absorb("d", pair.d.abort("r1", "test", pair.now))
    assert pair.d.awaited_peers() == {}  # final requests wait for nobody


def test_d_answers_a_done_about_an_unknown_request_with_not_accepted() -> None:
    from lw.fsm import Send
    from lw.transport.wire import PROTOCOL_VERSION, Ack, DoneSending

    pair = make_pair()
    msg = DoneSending(PROTOCOL_VERSION, "never-seen", pair.ps[0].me, 1, L)
    (eff,) = pair.d.on_message(msg, 0.0)
    assert isinstance(eff, Send) and isinstance(eff.msg, Ack)
    assert eff.msg.of == "done" and eff.msg.accepted is False
    assert pair.d.counters["unknown_requests"] == 1


def test_prefill_rows_say_what_each_state_waits_for() -> None:
    pair = make_pair(pcfg=PrefillConfig(request_timeout_s=30.0, ack_attempts=7))
    start(pair)
    pair.deliver_all()  # accepted
    p = pair.ps[0]
    pair.now = 2.0
    (row,) = p.status(pair.now)  # META_READY, nothing computed yet
    assert row.state == "META_READY" and row.peers == [D_ADDR]
    assert "0 of 3 layers written to D" in row.waiting_for
    assert "waiting for the forward pass to compute layer 0" in row.waiting_for
    assert row.in_state_s == 2.0 and row.deadline_in_s == 28.0 and row.layers_done == 0
    compute_all(pair)
    (row,) = p.status(pair.now)
    assert "3 write(s) in flight, 3 of 3 computed" in row.waiting_for
    assert "forward pass" not in row.waiting_for  # computed ahead of the writes
    pair.complete_writes()  # every layer written: DONE sent, its Ack awaited
    (row,) = p.status(pair.now)
    assert row.state == f"LAYER_{L - 1}_SENT" and row.layers_done == L
    assert row.waiting_for.startswith(f"waiting for Ack of DoneSending from D {D_ADDR}")
    assert "(try 1 of 7)" in row.waiting_for and row.peers == [D_ADDR]
    pair.deliver_all()
    assert p.status(pair.now) == []


def test_a_failed_prefill_row_names_the_writes_it_still_waits_for() -> None:
    pair = make_pair()
    start(pair)
    pair.deliver_all()
    compute_all(pair)  # three writes in flight
    pair.absorb(0, pair.ps[0].abort("r1", "client gone", pair.now))
    (row,) = pair.ps[0].status(pair.now)
    assert row.state == "FAILED" and row.peers == [D_ADDR]
    assert "aborted locally: client gone" in row.waiting_for
    assert f"3 write(s) in flight to D {D_ADDR}" in row.waiting_for


def test_long_peer_lists_are_cut_with_a_count() -> None:
    from lw.fsm.status import _join

    assert _join(["a", "b", "c", "d"]) == "a, b, c, d"
    assert _join(["a", "b", "c", "d", "e", "f"]) == "a, b, c, d and 2 more"


def test_observability_settings_are_checked_where_they_are_given() -> None:
    import pytest

    from lw.fsm.timeline import Timeline

    for bad in (dict(timeline_entries=-1), dict(stuck_fraction=0.0), dict(stuck_fraction=1.5)):
        with pytest.raises(ValueError, match="timeline_entries|stuck_fraction"):
            PrefillConfig(**bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeline_entries|stuck_fraction"):
            DecodeConfig(**bad)  # type: ignore[arg-type]
    assert PrefillConfig(stuck_fraction=1.0).stuck_fraction == 1.0  # the whole deadline is fine
    with pytest.raises(ValueError, match="capacity"):
        Timeline(-1)


def test_timeline_queries_at_their_edges() -> None:
    tl = Timeline(4)
    tl.record(1.0, "a", "x")
    tl.record(2.0, ("a", "b"), "layer_computed")
    tl.record(3.0, "ab", "y")  # a request whose id contains another's is not that request
    assert [e[2] for e in tl.of("a")] == ["x", "layer_computed"]
    assert [e[2] for e in tl.of("b")] == ["layer_computed"]
    assert tl.last(0) == [] and tl.last(-1) == []
    assert [e[0] for e in tl.last(3)] == [1.0, 2.0, 3.0] and len(tl.last(9)) == 3
    off = Timeline(0)
    off.record(1.0, "a", "x")
    assert len(off) == 0 and off.last(5) == [] and off.of("a") == []
    assert off.drain_durations() == []
    assert state_class("LAYER_3_SENT") == "LAYER_SENT" and state_class("LAYER_3") == "LAYER_3"
    assert state_class("META_READY") == "META_READY"


def test_status_line_says_how_far_the_deadline_is_or_was() -> None:
    from lw.transport.wire import RequestStatus

    row = RequestStatus("r", "RECEIVING", 1.0, "w", 0.0, 2)
    assert "deadline in 0.0s" in status_line("decode", d_sender_for_test(), row)
    late = RequestStatus("r", "RECEIVING", 1.0, "w", -2.5, 2)
    assert "deadline passed 2.5s ago" in status_line("decode", d_sender_for_test(), late)
    q = RequestStatus("r", "FAILED", 1.0, "w", 4.0, 2, quarantined=True)
    assert "lease ends in 4.0s" in status_line("decode", d_sender_for_test(), q)
    assert status_line("prefill", d_sender_for_test(), row).startswith("P D rank 0 request r ")


def d_sender_for_test():  # type: ignore[no-untyped-def]
    from .harness import d_sender

    return d_sender()


def test_stuck_is_strictly_past_the_fraction_of_the_deadline() -> None:
    pair = make_pair(dcfg=DecodeConfig(prefill_timeout_s=10.0, stuck_fraction=0.5))
    pair.absorb("d", pair.d.add_request("r1", (5,), 1, 0.0))
    assert pair.d.stuck(5.0) == []  # exactly half: not yet
    (row,) = pair.d.stuck(5.01)
    assert row.stuck and row.in_state_s == 5.01


def _two_senders_done(first_sums: dict, last_sums: dict):  # type: ignore[no-untyped-def]
    """Two P ranks write r1; D gets rank 0's DONE with ``first_sums``, then rank 1's with
    ``last_sums`` (each the driver's sums per sender D asked for); both send range(n)."""
    from msgspec.structs import replace

    from lw.fsm import PrefillRequest
    from lw.transport.wire import DoneSending

    pair = make_pair(n_ranks=2, dcfg=DecodeConfig(kv_checksum=True))
    pair.absorb("d", pair.d.add_request("r1", (5, 6, 7), 2, pair.now))
    for rank in (0, 1):
        req = PrefillRequest("r1", D_ADDR, (1, 2, 3), (5, 6, 7), 2)
        pair.absorb(rank, pair.ps[rank].add_request(req, pair.now))
    pair.deliver_all()
    for rank in (0, 1):
        compute_all(pair, rank=rank)
    pair.complete_writes()
    dones = sorted((s for s in pair.queue if isinstance(s.msg, DoneSending)),
                   key=lambda s: s.msg.sender.rank)
    asked = []
    for send, local in zip(dones, (first_sums, last_sums), strict=True):
        pair.queue.remove(send)
        msg = replace(send.msg, checksums=list(range(L * 3)))
        out = pair.d.on_message(msg, pair.now)
        (ask,) = [e for e in out if isinstance(e, SumBlocks)]
        asked.append([p.sender for p in ask.plans])
        got = tuple((tuple(local[p.sender]),) if p.sender in local else () for p in ask.plans)
        pair.absorb("d", [e for e in out if e is not ask] + pair.d.on_sums(Sums(ask, got),
                                                                          pair.now))
    pair.deliver_all()  # a failure aborts rank 0 (done earlier); its AbortAck releases
    return pair, asked


def test_the_last_done_re_verifies_every_sender_bytes_landing_late_are_caught() -> None:
    good = list(range(L * 3))
    pair, asked = _two_senders_done({("P", 0): good}, {("P", 0): good, ("P", 1): good})
    assert asked == [[("P", 0)], [("P", 0), ("P", 1)]]  # the last DONE asks for both
    assert [type(e).__name__ for e in pair.recv] == ["RecvDone"]

    # Rank 0's blocks matched at its DONE, then a late write of another claim changed one.
    late = list(good)
    late[2] += 7  # layer 0, third block (D block 7)
    pair, _ = _two_senders_done({("P", 0): good}, {("P", 0): late, ("P", 1): good})
    (failed,) = pair.recv
    assert type(failed).__name__ == "RecvFailed"
    assert "sender P rank 0" in failed.reason and "layer 0 block 7" in failed.reason
    assert "bytes changed after it was verified" in failed.reason
    assert pair.d.counters["checksum_mismatches"] == 1

    # A driver that gave no sums for an earlier sender fails the request: never accepted blind.
    pair, _ = _two_senders_done({("P", 0): good}, {("P", 1): good})
    (failed,) = pair.recv
    assert "(0 local sums)" in failed.reason
def _happy_path_from(t0: float) -> tuple:  # type: ignore[type-arg]
    """One request from t0: claimed at t0+1, every layer written at t0+3, acked at t0+6."""
    pair = make_pair()
    pair.now = t0
    start(pair)
    pair.now = t0 + 1.0
    pair.deliver_all()
    compute_all(pair)
    pair.now = t0 + 3.0
    pair.complete_writes()
    pair.now = t0 + 6.0
    pair.deliver_all()
    assert pair.ps[0].state_of("r1") == "DONE" and pair.d.state_of("r1") == "DONE"
    return pair.ps[0].timeline.drain_durations(), pair.d.timeline.drain_durations()


def test_time_in_state_samples_are_one_per_state_change_measured_from_entering_it() -> None:
    """Each sample is (state left, seconds since it was entered); declared no-ops (D's
    sender_done) and P's layer-to-layer steps leave none (the histograms would be skewed)."""
    p, d = _happy_path_from(10.0)
    assert p == [("AWAIT_DECODER_META", 1.0), ("META_READY", 2.0), ("LAYER_SENT", 3.0)]
    assert d == [("PREFILL_REQUESTED", 1.0), ("RECEIVING", 5.0)]


def test_status_time_in_state_restarts_when_the_state_changes() -> None:
    pair = make_pair()
    pair.now = 10.0
    start(pair)
    pair.now = 11.0
    pair.deliver_all()  # D claimed, P accepted
    (prow,), (drow,) = pair.ps[0].status(14.0), pair.d.status(14.0)
    assert (prow.state, prow.in_state_s) == ("META_READY", 3.0)
    assert (drow.state, drow.in_state_s) == ("RECEIVING", 3.0)


def test_d_stuck_alarm_is_rearmed_by_a_state_change() -> None:
    pair = make_pair(dcfg=DecodeConfig(prefill_timeout_s=10.0, stuck_fraction=0.5))
    start(pair)
    assert [r.state for r in pair.d.stuck(6.0)] == ["PREFILL_REQUESTED"]
    pair.now = 7.0
    pair.deliver_all()  # claimed: RECEIVING since 7
    assert pair.d.stuck(11.0) == []
    assert [r.state for r in pair.d.stuck(12.5)] == ["RECEIVING"]
    assert pair.d.stuck(13.0) == []


def test_a_default_timeline_keeps_the_newest_32768_events() -> None:
    tl = Timeline()
    for i in range(32768 + 1):
        tl.record(float(i), "r", "e")
    assert len(tl) == 32768 and next(iter(tl))[0] == 1.0


def test_undrained_time_in_state_samples_keep_only_the_newest_4096() -> None:
    tl = Timeline(1)
    assert tl.durations is not None
    for i in range(4096 + 1):
        tl.durations.append(("S", float(i)))  # what the endpoints do on each state change
    samples = tl.drain_durations()
    assert len(samples) == 4096 and samples[0] == ("S", 1.0)


def test_last_one_is_the_newest_event() -> None:
    tl = Timeline(4)
    tl.record(1.0, "a", "x")
    tl.record(2.0, "a", "y")
    assert [e[2] for e in tl.last(1)] == ["y"]


def test_d_asks_for_sums_only_for_a_done_it_may_count() -> None:
    """A live, claimed request's DONE asks the driver for the sums over its sender's blocks;
    a DONE of an unknown or failed request asks for nothing (it is refused outright), and
    one from a sender never accepted is a protocol error."""
    from msgspec.structs import replace

    from lw.transport.wire import DoneSending

    pair = make_pair(dcfg=DecodeConfig(kv_checksum=True))
    start(pair)
    pair.deliver_all()
    compute_all(pair)
    pair.complete_writes()
    (done,) = [s.msg for s in pair.queue if isinstance(s.msg, DoneSending)]

    def asks(msg: DoneSending) -> list[SumBlocks]:
        return [e for e in pair.d.on_message(msg, pair.now) if isinstance(e, SumBlocks)]

    (ask,) = asks(done)
    assert ask.plans == (pair.d.sum_plan("r1", ("P", 0)),) and ask.layout is pair.d.layout
    assert asks(replace(done, req_id="nope")) == []
    with pytest.raises(ProtocolError):
        asks(replace(done, sender=replace(done.sender, rank=7)))
    pair.absorb("d", pair.d.abort("r1", "test", pair.now))
    assert pair.d.state_of("r1") == "FAILED"
    assert asks(done) == []  # a failed request is verified by nobody


def test_sums_nobody_asked_for_are_a_protocol_error_on_both_sides() -> None:
    """P's DONE is built from the sums its KeptSums asked for. The answer to a checksum
    question comes in the same interpreter call as the question: one without its question
    (another side's, answered twice, or for a request that is gone) is refused."""
    from lw.transport.wire import decode, encode

    pair = make_pair(pcfg=PrefillConfig(kv_checksum=True), dcfg=DecodeConfig(kv_checksum=True))
    start(pair)
    pair.deliver_all()
    compute_all(pair)
    pair.complete_writes()
    (kept,) = [e for e in pair.other if isinstance(e, KeptSums)]
    assert kept.targets == (D_ADDR,) and kept.layers == L and pair.queue == []
    p = pair.ps[0]
    (send,) = p.on_sums(Sums(kept, ([[1, 2, 3]] * L,)), pair.now)
    assert send.dest == D_ADDR and send.msg.checksums == [1, 2, 3] * L
    with pytest.raises(ProtocolError, match="nobody asked"):
        p.on_sums(Sums(KeptSums("nope", kept.targets, L), ([],)), pair.now)
    (ask,) = [e for e in pair.d.on_message(decode(encode(send.msg)), pair.now)
              if isinstance(e, SumBlocks)]
    with pytest.raises(ProtocolError, match="nobody asked"):
        pair.d.on_sums(Sums(kept, ([],)), pair.now)  # P's question, not D's
    with pytest.raises(ProtocolError, match="nobody asked"):
        p.on_sums(Sums(ask, ([],)), pair.now)  # and the other way round
    pair.absorb("d", pair.d.on_sums(Sums(ask, ([[1, 2, 3]] * L,)), pair.now))
    assert pair.recv == [RecvDone("r1")]
    with pytest.raises(ProtocolError, match="nobody asked"):
        pair.d.on_sums(Sums(ask, ([[1, 2, 3]] * L,)), pair.now)  # answered twice
    pair.deliver_all()  # D's Ack
    assert p.state_of("r1") == "DONE"
    with pytest.raises(ProtocolError, match="nobody asked"):
        p.on_sums(Sums(kept, ([[1, 2, 3]] * L,)), pair.now)  # a finished request
