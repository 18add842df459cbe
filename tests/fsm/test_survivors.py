"""Tests written for the survivors of the 2026-11-30 mutation run over the whole of lw/fsm.

Like ``test_mutants.py``, each test states a piece of intent that no test or check pinned down
(the mutants are listed in docs/checker-findings.md, "Mutation testing").
"""

from __future__ import annotations

import pytest

from lw.fsm import (
    DecodeConfig,
    DecodeEndpoint,
    PrefillConfig,
    PrefillEndpoint,
    PrefillRequest,
    ProtocolError,
    Send,
    SumPlan,
)
from lw.fsm.kvmap import expected_senders, make_format
from lw.fsm.status import status_line
from lw.transport.wire import (
    PROTOCOL_VERSION,
    AbortAck,
    Ack,
    DoneSending,
    FailedSending,
    KVFormat,
    KVLayout,
    LayerLayout,
    MetaReply,
    MetaRequest,
    RequestStatus,
    Sender,
    StatusQuery,
    StatusReply,
    WireError,
    decode,
    encode,
)

from .harness import D_ADDR, P_ADDR, Pair, d_layout, d_sender, done_to_d, p_sender
from .test_endpoints import L, compute_all, done_unsent, make_pair, send_done, start


# ------------------------------------------------------------------------------ D
def test_d_refuses_a_message_only_p_takes() -> None:
    pair = make_pair()
    start(pair)
    reply = MetaReply(PROTOCOL_VERSION, "r1", "accepted", d_sender(), None)
    with pytest.raises(ProtocolError, match="only accepts"):
        pair.d.on_message(reply, 0.0)


def test_d_local_abort_of_an_unknown_or_finished_request_does_nothing() -> None:
    pair = make_pair()
    assert pair.d.abort("never-seen", "client gone", 0.0) == []
    start(pair)
    pair.deliver_all()
    compute_all(pair)
    pair.complete_writes()
    pair.deliver_all()
    assert pair.d.state_of("r1") == "DONE"
    assert pair.d.abort("r1", "client gone", 1.0) == []
    assert pair.d.state_of("r1") == "DONE"


def _meta(pair, rid: str, rank: int) -> str:  # type: ignore[no-untyped-def]  # noqa: ANN001
    """P rank ``rank`` sends a MetaRequest for ``rid`` to D: D's answer ("status: reason")."""
    rec = pair.d._reqs.get(rid)  # an honest sender names the blocks D registered
    msg = MetaRequest(PROTOCOL_VERSION, rid, p_sender(rank), want_layout=False,
                      blocks=rec.blocks if rec is not None else ())
    (reply,) = [e.msg for e in pair.d.on_message(decode(encode(msg)), pair.now)
                if isinstance(e, Send)]
    return f"{reply.status}: {reply.reason}"


def _d_events(pair, rid: str) -> list[tuple[str, str, str]]:  # type: ignore[no-untyped-def]  # noqa: ANN001
    return [(e[2], e[3], e[4]) for e in pair.d.timeline.of(rid)]


def test_d_answers_every_claim_and_records_it_even_when_nothing_changes() -> None:
    """A repeated MetaRequest is answered again (accepted while receiving, refused with the
    reason once quarantined); a claim on a failed request is refused;
    each is a ``claim`` in D's timeline (declared no-ops are recorded like transitions)."""
    pair = make_pair(n_ranks=3)
    pair.absorb("d", pair.d.add_request("r", (5, 6, 7), 2, pair.now))
    assert _meta(pair, "r", 0) == "accepted: "
    assert _meta(pair, "r", 0) == "accepted: "  # P's retry: the same answer
    assert _meta(pair, "r", 1) == "accepted: "
    assert _d_events(pair, "r")[1:] == [("claim", "PREFILL_REQUESTED", "RECEIVING"),
                                       ("claim", "RECEIVING", "RECEIVING"),
                                       ("claim", "RECEIVING", "RECEIVING")]
    pair.absorb("d", pair.d.abort("r", "gone", pair.now))
    assert pair.d.state_of("r") == "FAILED"
    n = len(_d_events(pair, "r"))
    assert _meta(pair, "r", 0) == "refused: aborted locally: gone"  # quarantined, not stopped
    assert _meta(pair, "r", 2).startswith("refused: request is FAILED")  # a new sender
    assert _d_events(pair, "r")[n:] == [("claim", "FAILED", "FAILED")] * 2


# ------------------------------------------------------------------------------ lw status rows
def _claim(pair, rid: str, rank: int, expected) -> None:  # type: ignore[no-untyped-def]  # noqa: ANN001
    """P rank ``rank`` claims ``rid`` on D (MetaRequest delivered, D's reply left queued)."""
    req = PrefillRequest(rid, D_ADDR, (1, 2, 3), (5, 6, 7),
                         expected if isinstance(expected, int) else len(expected))
    for s in pair.ps[rank].add_request(req, pair.now):
        if isinstance(s, Send):
            pair.absorb("d", pair.d.on_message(decode(encode(s.msg)), pair.now))


def test_rows_cut_long_texts_to_what_the_wire_carries() -> None:
    """A long failure reason is cut so the row still crosses the wire (1,024 characters)."""
    pair = make_pair(n_ranks=1)
    start(pair)
    pair.deliver_all()
    compute_all(pair)  # writes in flight: P stays FAILED, D stays quarantined
    pair.absorb(0, pair.ps[0].abort("r1", "x" * 3000, pair.now))
    pair.absorb("d", pair.d.abort("r1", "y" * 3000, pair.now))
    (prow,), (drow,) = pair.ps[0].status(pair.now), pair.d.status(pair.now)
    assert prow.state == drow.state == "FAILED"
    for row in (prow, drow):
        assert len(row.waiting_for) == 1024
        reply = StatusReply(PROTOCOL_VERSION, pair.d.me, "decode", 0.0, 0.0, [row])
        assert decode(encode(reply)).requests == [row]


def test_rows_name_at_most_64_peers() -> None:
    n = 70
    pair = make_pair(n_ranks=n)
    pair.absorb("d", pair.d.add_request("r1", (5, 6, 7), n, pair.now))
    for r in range(n):
        _claim(pair, "r1", r, n)
    (drow,) = pair.d.status(pair.now)
    assert drow.state == "RECEIVING" and len(drow.peers) == 64
    assert drow.peers == [f"{P_ADDR}/{r}" for r in range(64)]
    p = PrefillEndpoint(p_sender(), L)
    addrs = tuple(f"tcp://d{i}" for i in range(n))
    p.add_request(PrefillRequest("r2", addrs, (1,), (1,)), 0.0)
    (prow,) = p.status(0.0)
    assert prow.peers == list(addrs[:64])


def test_rows_measure_time_and_deadline_from_the_request_s_own_times() -> None:
    pair = make_pair(pcfg=PrefillConfig(request_timeout_s=30.0),
                     dcfg=DecodeConfig(prefill_timeout_s=20.0, lease_s=50.0))
    pair.now = 10.0
    start(pair)
    (prow,), (drow,) = pair.ps[0].status(14.0), pair.d.status(14.0)
    assert (prow.in_state_s, prow.deadline_in_s) == (4.0, 26.0)
    assert (drow.in_state_s, drow.deadline_in_s) == (4.0, 16.0)
    pair.now = 15.0
    pair.deliver_all()
    pair.absorb("d", pair.d.abort("r1", "gone", 16.0))  # quarantined: the lease is the deadline
    (drow,) = pair.d.status(18.0)
    assert drow.quarantined and (drow.in_state_s, drow.deadline_in_s) == (2.0, 48.0)


def test_rows_are_stuck_strictly_past_the_fraction_of_their_own_deadline() -> None:
    pair = make_pair(pcfg=PrefillConfig(request_timeout_s=10.0, stuck_fraction=0.5),
                     dcfg=DecodeConfig(prefill_timeout_s=20.0, lease_s=40.0,
                                       stuck_fraction=0.25))
    start(pair)
    assert [r.stuck for r in pair.ps[0].status(5.0)] == [False]
    assert [r.stuck for r in pair.ps[0].status(5.5)] == [True]
    assert [r.stuck for r in pair.d.status(5.0)] == [False]
    assert [r.stuck for r in pair.d.status(5.5)] == [True]
    pair.deliver_all()
    pair.absorb("d", pair.d.abort("r1", "gone", 0.0))  # quarantined at 0: the lease (40 s) counts
    assert [r.stuck for r in pair.d.status(10.0)] == [False]
    assert [r.stuck for r in pair.d.status(10.5)] == [True]
    assert pair.d.stuck(10.0) == [] and [r.state for r in pair.d.stuck(10.5)] == ["FAILED"]


def _tp2_into_tp1() -> Pair:
    """Two P ranks of TP 2 (one KV head each) and a D of TP 1 that waits for both."""
    def layout(engine: str, rank: int, tp: int, block_len: int) -> KVLayout:
        fmt = make_format(tp_rank=rank, tp_size=tp, total_heads=2, block_tokens=16,
                          dtype="bf16")
        layers = [LayerLayout(0x1000_0000 + i * 0x100_0000, block_len, block_len, 64)
                  for i in range(L)]
        return KVLayout(engine, 1, "127.0.0.1:15000", layers, fmt)

    ps = [PrefillEndpoint(p_sender(r), L, local=layout("P", r, 2, 2048)) for r in range(2)]
    return Pair(ps, DecodeEndpoint(d_sender(), layout("D", 0, 1, 4096)))


def test_d_rows_say_which_senders_are_awaited() -> None:
    pair = _tp2_into_tp1()
    pair.absorb("d", pair.d.add_request("any", (5, 6, 7), 2, pair.now))
    pair.absorb("d", pair.d.add_request("tp", (5, 6, 7), {0, 1}, pair.now))
    rows = {r.req_id: r for r in pair.d.status(pair.now)}
    assert "waiting for MetaRequest from 2 P sender(s)" in rows["any"].waiting_for
    assert "waiting for MetaRequest from P TP rank 0, P TP rank 1" in rows["tp"].waiting_for
    _claim(pair, "tp", 0, {0, 1})
    (row,) = pair.d.status(pair.now, "tp")
    assert row.state == "RECEIVING" and row.peers == [f"{P_ADDR}/0"]
    assert "P P rank 0, P TP rank 1 (not claimed yet)" in row.waiting_for
    for rank in (0, 1):  # any two senders: nobody is named as unclaimed
        _claim(pair, "any", rank, 2)
    (row,) = pair.d.status(pair.now, "any")
    assert "not claimed" not in row.waiting_for
    assert "P P rank 0, P P rank 1; 0 of 2 sender(s) done" in row.waiting_for
    # Quarantined: only the senders that have not stopped are awaited.
    pair.queue.clear()
    pair.absorb("d", pair.d.abort("any", "gone", pair.now))
    ack = AbortAck(PROTOCOL_VERSION, "any", pair.ps[1].me, known=True)
    pair.absorb("d", pair.d.on_message(ack, pair.now))
    (row,) = pair.d.status(pair.now, "any")
    assert row.quarantined and row.peers == [f"{P_ADDR}/0"]
    assert "P P rank 0" in row.waiting_for and "P P rank 1" not in row.waiting_for


def test_status_line_of_a_lease_ending_now() -> None:
    q = RequestStatus("r", "FAILED", 1.0, "w", 0.0, 2, quarantined=True)
    assert "lease ends in 0.0s" in status_line("decode", d_sender(), q)
    late = RequestStatus("r", "FAILED", 1.0, "w", -1.0, 2, quarantined=True)
    assert "lease passed 1.0s ago" in status_line("decode", d_sender(), late)


def _sliced_d(d_fmt: KVFormat, block_len: int) -> DecodeEndpoint:
    layers = [LayerLayout(0x1000_0000 + i * 0x100_0000, block_len, block_len, 64)
              for i in range(L)]
    return DecodeEndpoint(d_sender(), KVLayout("D", 1, "127.0.0.1:15000", layers, d_fmt))


@pytest.mark.parametrize(("p_tp", "p_rank", "d_tp", "d_rank", "d_block", "runs"), [
    (1, 0, 2, 1, 2048, ((0, 2048),)),  # P holds the 4 heads, D heads 2-3: all of D's block
    (2, 1, 1, 0, 4096, ((2048, 2048),)),  # P heads 2-3 into a D block of 4: its second half
    (2, 1, 2, 1, 2048, ((0, 2048),)),  # the same heads on both sides
])
def test_d_checksums_cover_the_bytes_each_head_sliced_sender_wrote(
        p_tp: int, p_rank: int, d_tp: int, d_rank: int, d_block: int,
        runs: tuple[tuple[int, int], ...]) -> None:
    """What D checksums for a sender is where that sender's heads are in D's block (4 KV heads
    of 1,024 bytes per block): ranks holding heads past the first count them from their own."""
    def fmt(rank: int, tp: int) -> KVFormat:
        return make_format(tp_rank=rank, tp_size=tp, total_heads=4, block_tokens=16,
                           dtype="bf16")

    d = _sliced_d(fmt(d_rank, d_tp), d_block)
    d.add_request("r", (3, 4), expected_senders(fmt(d_rank, d_tp), p_tp), 0.0)
    claim = MetaRequest(PROTOCOL_VERSION, "r", p_sender(p_rank), False, (3, 4),
                        fmt(p_rank, p_tp))
    (reply,) = [e.msg for e in d.on_message(decode(encode(claim)), 0.0) if isinstance(e, Send)]
    assert reply.status == "accepted", reply.reason
    assert d.sum_plan("r", ("P", p_rank)) == SumPlan(("P", p_rank), (3, 4), (runs,) * L)


@pytest.mark.parametrize(("sent", "mine"), [
    (L * 3 - 1, L * 3),  # the sender sent one checksum too few
    (L * 3 + 1, L * 3),  # or one too many
    (L * 3, L * 3 - 1),  # the driver summed one block too few
    (L * 3, 0),  # the driver passed no checksums at all
])
def test_kv_checksums_of_the_wrong_count_fail_the_request(sent: int, mine: int) -> None:
    """Checksums are compared one per (layer, block): any other count fails the request, it is
    never taken as a match."""
    pair = make_pair(dcfg=DecodeConfig(kv_checksum=True))
    send_done(pair, list(range(sent)), list(range(mine)))
    (failed,) = pair.recv
    assert type(failed).__name__ == "RecvFailed"
    assert f"sent {sent} checksums ({mine} local sums), expected {L * 3}" in failed.reason


def test_a_kv_checksum_mismatch_names_how_many_blocks_differ_and_the_first_four() -> None:
    from msgspec.structs import replace

    from lw.transport.wire import DoneSending

    pair = make_pair(dcfg=DecodeConfig(kv_checksum=True))
    start(pair)  # D blocks 5, 6, 7 in each of the L layers
    pair.deliver_all()
    compute_all(pair)
    pair.complete_writes()
    (done,) = [s for s in pair.queue if isinstance(s.msg, DoneSending)]
    pair.queue.remove(done)
    sums = [i + 1 for i in range(L * 3)]  # every block differs
    msg = decode(encode(replace(done.msg, checksums=sums)))
    pair.absorb("d", done_to_d(pair.d, msg, pair.now, list(range(L * 3))))
    assert pair.recv == []  # quarantined until P, told of the refusal, says it stopped
    pair.deliver_all()
    (failed,) = pair.recv
    assert failed.reason.endswith(f"{L * 3} of {L * 3} block(s) differ, first layer 0 block 5, "
                                  "layer 0 block 6, layer 0 block 7, layer 1 block 5")


# ------------------------------------------------------------------------------ timelines
# Each endpoint records every fired event, declared no-ops included (lw/fsm/timeline.py): what
# `lw status` and the traces show of a request that stays in one state, e.g. a retry.
def _events(ep, rid: str) -> list[tuple]:  # type: ignore[no-untyped-def]  # noqa: ANN001
    return [(e[2], e[3], e[4], e[5]) for e in ep.timeline.of(rid)][1:]  # after "admitted"


def test_p_timeline_records_meta_retries_duplicates_and_stale_replies() -> None:
    d0, d1 = "tcp://d0", "tcp://d1"
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(meta_attempts=5))
    p.add_request(PrefillRequest("r", (d0, d1), (1, 2, 3), (5, 6, 7)), 0.0)

    def reply(addr: str, status: str) -> None:
        who = Sender("D", int(addr[-1]), 1, addr)
        msg = MetaReply(PROTOCOL_VERSION, "r", status, who,
                        d_layout(L) if status == "accepted" else None, "no")
        p.on_message(decode(encode(msg)), 0.0)

    p.on_timer(("meta", "r"), 1.0)
    reply(d0, "unknown")
    reply(d0, "accepted")
    reply(d0, "accepted")
    reply(d1, "accepted")
    reply(d1, "accepted")
    reply(d0, "refused")
    reply(d0, "unknown")
    p.on_timer(("meta", "r"), 2.0)
    A, R = "AWAIT_DECODER_META", "META_READY"
    assert [e[:3] for e in _events(p, "r")] == [
        ("meta_timer", A, A), ("meta_unknown", A, A), ("target_accepted", A, A),
        ("target_accepted", A, A), ("meta_accepted", A, R), ("meta_accepted", R, R),
        ("meta_unknown", R, R), ("meta_unknown", R, R), ("meta_timer", R, R)]


def test_p_timeline_records_writes_out_of_order_failed_and_late() -> None:
    pair = make_pair()
    start(pair)
    pair.deliver_all()
    compute_all(pair)
    p = pair.ps[0]
    n = len(_events(p, "r1"))
    p.transfer_done("r1", 1, True, "", 1.0)  # layer 1 lands before layer 0
    p.transfer_done("r1", 0, True, "", 2.0)
    p.abort("r1", "gone", 3.0)
    p.abort("r1", "again", 4.0)  # already failed: recorded, nothing changes
    p.on_timer(("ack", "r1"), 4.5)  # a stale timer: recorded, no DONE sent
    ack = Ack(PROTOCOL_VERSION, "r1", "done", d_sender(), False)
    assert p.on_message(ack, 4.6) == []  # a late ack of a failed request
    p.transfer_done("r1", 2, False, "boom", 5.0)  # the last write in flight fails late
    assert p.live_requests() == []
    R, S0, S1, F = "META_READY", "LAYER_0_SENT", "LAYER_1_SENT", "FAILED"
    assert [e[:3] for e in _events(p, "r1")[n:]] == [
        ("layer_written", R, ""), ("layer_sent", R, S0), ("layer_sent", S0, S1),
        ("fail", S1, F), ("fail", F, F), ("ack_timer", F, F), ("ack", F, F),
        ("write_failed", F, ""), ("fail", F, F)]
    details = [e[3] for e in _events(p, "r1")[n:]]
    assert details[:3] == [1, 0, 1] and details[7] == "2: boom"


def test_p_timeline_records_a_write_landing_after_the_request_failed() -> None:
    pair = make_pair()
    start(pair)
    pair.deliver_all()
    compute_all(pair)
    p = pair.ps[0]
    p.abort("r1", "gone", 1.0)
    n = len(_events(p, "r1"))
    p.transfer_done("r1", 0, True, "", 2.0)
    assert _events(p, "r1")[n:] == [("layer_sent", "FAILED", "FAILED", 0)]


def test_p_timeline_records_a_resent_done() -> None:
    pair = make_pair(pcfg=PrefillConfig(ack_attempts=3))
    start(pair)
    pair.deliver_all()
    compute_all(pair)
    pair.complete_writes()
    p = pair.ps[0]
    n = len(_events(p, "r1"))
    pair.absorb(0, p.on_timer(("ack", "r1"), 1.0))
    pair.deliver_all()
    S2 = f"LAYER_{L - 1}_SENT"
    assert [e[:3] for e in _events(p, "r1")[n:]] == [
        ("ack_timer", S2, S2), ("ack", S2, "DONE")]


def _quarantined() -> Pair:
    """A D request claimed by two P ranks, then aborted: FAILED and quarantined."""
    pair = make_pair(n_ranks=2)
    pair.absorb("d", pair.d.add_request("r", (5, 6, 7), 2, pair.now))
    _meta(pair, "r", 0)
    _meta(pair, "r", 1)
    pair.absorb("d", pair.d.abort("r", "gone", pair.now))
    return pair


def test_d_timeline_records_what_arrives_for_a_quarantined_request() -> None:
    pair = _quarantined()
    n = len(_d_events(pair, "r"))
    wrong = DoneSending(PROTOCOL_VERSION, "r", p_sender(0), 2, L + 1)  # crossing our Abort
    pair.absorb("d", pair.d.on_message(decode(encode(wrong)), pair.now))
    stopped = FailedSending(PROTOCOL_VERSION, "r", p_sender(1), 2, "gone")
    pair.absorb("d", pair.d.on_message(decode(encode(stopped)), pair.now))
    F = "FAILED"
    assert _d_events(pair, "r")[n:] == [("fail", F, F), ("sender_done", F, F),
                                        ("sender_stopped", F, F)]
    # A DONE for another number of layers says nothing of rank 0's writes: still held
    assert pair.d.live_requests() == ["r"]
    gone = FailedSending(PROTOCOL_VERSION, "r", p_sender(0), 2, "refused")
    pair.absorb("d", pair.d.on_message(decode(encode(gone)), pair.now))
    assert pair.d.live_requests() == []  # both stopped: released


def test_d_timeline_records_an_abort_ack() -> None:
    pair = _quarantined()
    n = len(_d_events(pair, "r"))
    ack = AbortAck(PROTOCOL_VERSION, "r", p_sender(1), known=True)
    pair.absorb("d", pair.d.on_message(decode(encode(ack)), pair.now))
    assert _d_events(pair, "r")[n:] == [("sender_stopped", "FAILED", "FAILED")]
    assert pair.d.live_requests() == ["r"]  # rank 0 has not stopped yet


def test_d_counts_failed_sendings_about_requests_it_does_not_hold() -> None:
    """A FailedSending about an unknown request counts as one (a restarted D, or a forgotten
    request); about a finished one, as a stale message. Both are acknowledged as not accepted."""
    pair = make_pair()
    msg = FailedSending(PROTOCOL_VERSION, "never-seen", p_sender(), 1, "x")
    (eff,) = pair.d.on_message(msg, 0.0)
    assert isinstance(eff.msg, Ack) and not eff.msg.accepted and eff.msg.of == "failed"
    assert pair.d.counters["unknown_requests"] == 1 and pair.d.counters["stale_messages"] == 0
    start(pair)
    pair.deliver_all()
    pair.absorb("d", pair.d.abort("r1", "gone", pair.now))
    pair.queue.clear()
    done = FailedSending(PROTOCOL_VERSION, "r1", p_sender(), 1, "x")
    pair.d.on_message(done, 0.0)  # r1's only sender stopped: released
    assert pair.d.live_requests() == []
    (eff,) = pair.d.on_message(done, 0.0)
    assert isinstance(eff.msg, Ack) and not eff.msg.accepted
    assert pair.d.counters["unknown_requests"] == 1 and pair.d.counters["stale_messages"] == 1


def test_status_queries_may_ask_for_up_to_100000_timeline_entries_on_the_wire() -> None:
    """The bound is part of the wire format: a peer of the same protocol version may ask for
    100,000 entries (what ``lw status`` asks for), not more."""
    ok = StatusQuery(PROTOCOL_VERSION, "tcp://asker", timeline=100_000)
    assert decode(encode(ok)) == ok
    with pytest.raises(WireError, match="<= 100000"):
        decode(encode(StatusQuery(PROTOCOL_VERSION, "tcp://asker", timeline=100_001)))


def test_fields_added_to_the_wire_later_default_to_the_old_meaning() -> None:
    """A peer that does not send ``in_doubt`` means "not in doubt"; a D row knows no layer
    count (-1, 0), which ``lw status`` shows as unknown."""
    import msgspec

    me = msgspec.to_builtins(p_sender())
    for kind, extra in (("abort_ack", {"known": True}),
                        ("failed", {"expected_senders": 1, "reason": "x"})):
        raw = msgspec.msgpack.encode({"kind": kind, "version": PROTOCOL_VERSION, "req_id": "r",
                                      "sender": me, **extra})
        assert decode(raw).in_doubt is False
    pair = make_pair()
    start(pair)
    (row,) = pair.d.status(0.0)
    assert (row.layers_done, row.layers_total) == (-1, 0)


def test_status_fields_a_peer_leaves_out_mean_nothing_to_report() -> None:
    """Omitted on the wire: a row is not stuck and not quarantined, a query asks for no
    timeline entries, a reply is not truncated."""
    import msgspec

    enc = msgspec.msgpack.encode
    row = msgspec.msgpack.decode(enc({"req_id": "r", "state": "S", "in_state_s": 1.0,
                                      "waiting_for": "w", "deadline_in_s": 2.0, "blocks": 3}),
                                 type=RequestStatus)
    assert (row.stuck, row.quarantined, row.peers) == (False, False, [])
    q = decode(enc({"kind": "status_q", "version": PROTOCOL_VERSION, "asker": "tcp://a"}))
    assert isinstance(q, StatusQuery) and (q.req_id, q.timeline) == ("", 0)
    rep = decode(enc({"kind": "status_rep", "version": PROTOCOL_VERSION,
                      "worker": msgspec.to_builtins(d_sender()), "role": "decode", "now": 1.0,
                      "wall": 2.0}))
    assert isinstance(rep, StatusReply) and rep.truncated is False
    assert rep.requests == [] and rep.timeline == []


def test_a_prefill_request_has_one_sender_unless_told_otherwise() -> None:
    pair = make_pair()
    pair.absorb("d", pair.d.add_request("r1", (5, 6, 7), 1, pair.now))
    pair.absorb(0, pair.ps[0].add_request(PrefillRequest("r1", D_ADDR, (1, 2, 3), (5, 6, 7)),
                                          pair.now))
    pair.deliver_all()
    compute_all(pair)
    pair.complete_writes()
    (done,) = [s.msg for s in pair.queue if isinstance(s.msg, DoneSending)]
    assert done.expected_senders == 1
    pair.deliver_all()
    assert pair.d.state_of("r1") == "DONE"


def test_rows_count_stuck_time_from_entering_the_state_not_from_zero() -> None:
    pair = make_pair(pcfg=PrefillConfig(request_timeout_s=10.0, stuck_fraction=0.5),
                     dcfg=DecodeConfig(prefill_timeout_s=10.0, stuck_fraction=0.5))
    pair.now = 100.0
    start(pair)
    for ep in (pair.ps[0], pair.d):
        assert [r.stuck for r in ep.status(105.0)] == [False]
        assert [r.stuck for r in ep.status(105.5)] == [True]


# ------------------------------------------------------- survivors of the 2026-12-01/02 runs
def test_the_wire_carries_a_reason_of_1024_characters_and_senders_cut_longer_ones() -> None:
    """1,024 characters is the protocol's bound on free text (peers of this version send up to
    it): such a text crosses the wire, a longer one is refused there, and D cuts a longer
    reason to it before it sends the Abort that fences a lost P."""
    from lw.fsm.messages import MAX_TEXT, Abort

    assert decode(encode(Abort(PROTOCOL_VERSION, "r", d_sender(), "x" * 1024))).reason == "x" * 1024
    with pytest.raises(WireError):
        decode(encode(Abort(PROTOCOL_VERSION, "r", d_sender(), "x" * 1025)))
    assert MAX_TEXT == 1024
    pair = make_pair(dcfg=DecodeConfig(retry_prefill=1, lease_s=30.0))
    start(pair)
    pair.deliver_all()  # claimed
    pair.absorb("d", pair.d.prefill_routed("r1", "P", P_ADDR + "/0", 0, pair.now))
    pair.absorb("d", pair.d.peer_lost("P", "y" * 3000, 1.0))
    (abort,) = [s.msg for s in pair.queue if s.dest == P_ADDR + "/0"]
    assert len(abort.reason) == 1024 and abort.reason.endswith("y" * 900)
    decode(encode(abort))


def test_a_wrong_claim_names_at_most_16_of_its_blocks() -> None:
    pair = make_pair()
    start(pair)
    for n, shown in ((16, "115] (16)"), (17, "115, ...] (17)")):
        msg = MetaRequest(PROTOCOL_VERSION, "r1", p_sender(), want_layout=False,
                          blocks=tuple(range(100, 100 + n)))
        (reply,) = [e.msg for e in pair.d.on_message(msg, pair.now) if isinstance(e, Send)]
        assert reply.status != "accepted" and f"[100, 101, 102, 103, 104, 105, 106, 107, 108, " \
            f"109, 110, 111, 112, 113, 114, {shown}" in reply.reason


def test_checksums_are_answered_once_and_for_every_sender_asked() -> None:
    from lw.fsm import SumBlocks, Sums

    pair = make_pair(dcfg=DecodeConfig(kv_checksum=True))
    done = done_unsent(pair, [7] * 9)
    (ask,) = [e for e in pair.d.on_message(done, pair.now) if isinstance(e, SumBlocks)]
    with pytest.raises(ProtocolError, match="sums for 2 senders, asked for 1"):
        pair.d.on_sums(Sums(ask, ((), ())), pair.now)
    pair.d.on_sums(Sums(ask, (((6,) * 9,),)), pair.now)  # a mismatch: FAILED, still held
    assert pair.d.state_of("r1") == "FAILED"
    with pytest.raises(ProtocolError, match="nobody asked"):
        pair.d.on_sums(Sums(ask, ((tuple(done.checksums),),)), pair.now)


def test_a_done_whose_checksums_differ_is_refused_to_its_sender() -> None:
    pair = make_pair(dcfg=DecodeConfig(kv_checksum=True))
    done = done_unsent(pair, [7] * 9)
    bad = [6] * 9
    acks = [s.msg for s in done_to_d(pair.d, done, pair.now, bad) if isinstance(s, Send)
            and isinstance(s.msg, Ack)]
    assert [(a.of, a.accepted, s) for a, s in zip(acks, [P_ADDR + "/0"], strict=True)] == [
        ("done", False, P_ADDR + "/0")]
    assert pair.d.state_of("r1") == "FAILED"


def test_a_done_that_crosses_the_fence_ends_it_at_once_and_is_in_the_timeline() -> None:
    """P's DONE was on its way when D lost P and fenced the epoch: it is refused, recorded as
    its sender's last word, and, as that sender can write no more, the retry starts at once
    rather than after the lease."""
    from lw.fsm import Reprefill

    pair = make_pair(dcfg=DecodeConfig(retry_prefill=1, lease_s=30.0))
    done = done_unsent(pair)
    pair.absorb("d", pair.d.prefill_routed("r1", "P", P_ADDR + "/0", 0, pair.now))
    pair.absorb("d", pair.d.peer_lost("P", "heartbeats lost", 1.0))
    assert pair.d.state_of("r1") == "FENCING"
    out = pair.d.on_message(done, 1.5)
    assert [(a.of, a.accepted) for a in (s.msg for s in out if isinstance(s, Send))] == [
        ("done", False)]
    assert [e.epoch for e in out if isinstance(e, Reprefill)] == [1]
    assert ("sender_done", "FENCING", "FENCING") in [e[2:5] for e in pair.d.timeline.of("r1")]


def test_a_failure_report_after_d_failed_is_answered_not_accepted() -> None:
    pair = make_pair(dcfg=DecodeConfig(prefill_timeout_s=5.0, lease_s=30.0))
    start(pair)
    pair.deliver_all()  # claimed
    pair.absorb(0, pair.ps[0].layer_computed(0, ["r1"], pair.now))  # a write in flight
    pair.d.on_timer(("deadline", "r1"), 6.0)  # D fails it; its Abort to P is lost
    assert pair.d.state_of("r1") == "FAILED"
    pair.complete_writes(ok=False, reason="peer unreachable")  # P fails on its own
    (failed,) = [s for s in pair.queue if isinstance(s.msg, FailedSending)]
    out = pair.d.on_message(decode(encode(failed.msg)), 6.0)
    assert [(s.dest, s.msg.of, s.msg.accepted) for s in out if isinstance(s, Send)] == [
        (P_ADDR + "/0", "failed", False)]


def test_a_chunks_writes_are_recorded_with_its_index_and_a_late_chunk_too() -> None:
    """``chunk_sent`` names the chunk whose last layer was written (trace validation compares
    the numbers in details), and a chunk scheduled after the request failed is recorded and
    sends nothing."""
    pair = make_pair()
    pair.absorb("d", pair.d.add_request("r1", (5, 6), 1, pair.now))
    pair.absorb(0, pair.ps[0].add_request(
        PrefillRequest("r1", D_ADDR, (1,), (5, 6), 1, False), pair.now))
    pair.deliver_all()
    compute_all(pair)
    pair.complete_writes()
    assert [str(e[5]) for e in pair.ps[0].timeline.of("r1") if e[2] == "chunk_sent"] == ["0"]
    pair = make_pair()
    pair.absorb("d", pair.d.add_request("r1", (5, 6), 1, pair.now))
    p = pair.ps[0]
    pair.absorb(0, p.add_request(PrefillRequest("r1", D_ADDR, (1,), (5, 6), 1, False), pair.now))
    pair.deliver_all()
    pair.absorb(0, p.layer_computed(0, ["r1"], pair.now))  # its write stays in flight
    p.abort("r1", "client gone", pair.now)
    assert p.state_of("r1") == "FAILED" and "r1" in p.live_requests()
    assert p.add_chunk("r1", (2,), True, pair.now) == []
    assert [e[2] for e in p.timeline.of("r1")][-1] == "chunk_scheduled"
