"""Core endpoint behaviour: happy path, early layers, failures, aborts, quarantine, duplicates."""

from __future__ import annotations

import pytest

from lw.fsm import (
    DecodeConfig,
    DecodeEndpoint,
    PrefillConfig,
    PrefillEndpoint,
    PrefillRequest,
    ProtocolError,
    Quarantine,
    RecvDone,
    RecvFailed,
)
from lw.transport.wire import PROTOCOL_VERSION, Ack, DoneSending, MetaReply, MetaRequest, Sender

from .harness import D_ADDR, Pair, d_layout, d_sender, done_to_d, p_sender

L = 3


def make_pair(n_ranks: int = 1, pcfg: PrefillConfig | None = None,
              dcfg: DecodeConfig | None = None) -> Pair:
    ps = [PrefillEndpoint(p_sender(r), L, pcfg) for r in range(n_ranks)]
    return Pair(ps, DecodeEndpoint(d_sender(), d_layout(L), dcfg))


def start(pair: Pair, rid: str = "r1", rank: int = 0, expected: int = 1) -> None:
    pair.absorb("d", pair.d.add_request(rid, (5, 6, 7), expected, pair.now))
    req = PrefillRequest(rid, D_ADDR, (1, 2, 3), (5, 6, 7), expected)
    pair.absorb(rank, pair.ps[rank].add_request(req, pair.now))


def compute_all(pair: Pair, rid: str = "r1", rank: int = 0) -> None:
    for layer in range(L):
        pair.absorb(rank, pair.ps[rank].layer_computed(layer, [rid], pair.now))


def done_unsent(pair: Pair, checksums: list[int] | None = None) -> DoneSending:
    """Run r1 until P's DONE is queued and take it out of the queue, undelivered (with
    ``checksums`` in place of P's: D's own sums are the test's to give)."""
    from msgspec.structs import replace

    from lw.transport.wire import decode, encode

    start(pair)
    pair.deliver_all()
    compute_all(pair)
    pair.complete_writes()
    (done,) = [s for s in pair.queue if isinstance(s.msg, DoneSending)]
    pair.queue.remove(done)
    msg = done.msg if checksums is None else replace(done.msg, checksums=checksums)
    return decode(encode(msg))


def send_done(pair: Pair, sums: list[int], local: list[int]) -> None:
    """Run r1 to its DONE and hand that DONE to D with ``sums`` as its checksums and ``local``
    as D's own sums (the driver's CRC-32C)."""
    msg = done_unsent(pair, sums)
    pair.absorb("d", done_to_d(pair.d, msg, pair.now, local))
    pair.deliver_all()  # a refused DONE: P stops and says so, which ends D's quarantine


def test_happy_path_layers_before_meta_are_remembered() -> None:
    pair = make_pair()
    start(pair)
    compute_all(pair)  # every layer computed before D's metadata arrived
    assert pair.writes == []
    assert pair.ps[0].state_of("r1") == "AWAIT_DECODER_META"
    pair.deliver_all()  # MetaRequest -> accepted with layout
    assert [w.layer for _, w in pair.writes] == [0, 1, 2]
    pair.complete_writes()
    assert pair.ps[0].state_of("r1") == "LAYER_2_SENT"
    pair.deliver_all()  # DoneSending -> Ack
    assert pair.ps[0].state_of("r1") == "DONE"
    assert pair.d.state_of("r1") == "DONE"
    assert pair.recv == [RecvDone("r1")]
    assert [f.ok for f in pair.finished] == [True]
    assert pair.ps[0].live_requests() == [] and pair.d.live_requests() == []


def test_layers_after_meta_are_written_as_computed() -> None:
    pair = make_pair()
    start(pair)
    pair.deliver_all()
    assert pair.ps[0].state_of("r1") == "META_READY"
    pair.absorb(0, pair.ps[0].layer_computed(0, ["r1"], 0.0))
    assert [w.layer for _, w in pair.writes] == [0]
    pair.complete_writes()
    assert pair.ps[0].state_of("r1") == "LAYER_0_SENT"


def test_writes_carry_the_request_deadline_as_not_after() -> None:
    """The lease argument needs every write handed to the transport before P's request
    deadline: the core tells the driver when that is, on each write."""
    pair = make_pair(pcfg=PrefillConfig(request_timeout_s=7.0))
    pair.now = 100.0
    start(pair)
    pair.deliver_all()
    pair.now = 103.0
    compute_all(pair)
    assert [w.not_after for _, w in pair.writes] == [107.0] * L


def test_failed_write_holds_blocks_until_inflight_writes_finish() -> None:
    pair = make_pair()
    start(pair)
    pair.deliver_all()
    compute_all(pair)
    assert len(pair.writes) == 3
    rank, w0 = pair.writes.pop(0)
    pair.absorb(0, pair.ps[0].transfer_done("r1", 0, False, "peer closed", 0.0))
    assert pair.ps[0].state_of("r1") == "FAILED"
    assert pair.finished == []  # two writes still read the blocks
    pair.complete_writes()
    assert [f.ok for f in pair.finished] == [False]
    pair.deliver_all()  # FailedSending reaches D
    assert pair.d.state_of("r1") == "FAILED"
    assert isinstance(pair.recv[0], RecvFailed)


def test_decoder_deadline_quarantines_until_sender_confirms() -> None:
    pair = make_pair(dcfg=DecodeConfig(prefill_timeout_s=5, lease_s=100))
    start(pair)
    pair.deliver_all()  # claim accepted
    pair.absorb(0, pair.ps[0].layer_computed(0, ["r1"], 0.0))  # one write in flight
    pair.advance(6.0)  # D's deadline fires: Abort goes to P
    assert pair.d.state_of("r1") == "FAILED"
    assert any(isinstance(e, Quarantine) for e in pair.other)
    assert pair.recv == []  # not reported: P may still write
    assert pair.ps[0].state_of("r1") == "FAILED"
    pair.complete_writes()  # P's last write ends -> AbortAck -> D releases
    pair.deliver_all()
    assert [type(r) for r in pair.recv] == [RecvFailed]
    assert pair.d.live_requests() == []


def test_lease_expiry_releases_quarantine_when_sender_is_silent() -> None:
    pair = make_pair(dcfg=DecodeConfig(prefill_timeout_s=5, lease_s=50))
    start(pair)
    pair.deliver_all()
    pair.timers = {k: v for k, v in pair.timers.items() if k[0] == "d"}  # P froze
    pair.absorb("d", pair.d.abort("r1", "client gone", pair.now))
    pair.queue.clear()  # the Abort is lost
    pair.advance(10.0)
    assert pair.recv == []
    pair.advance(60.0)
    assert [type(r) for r in pair.recv] == [RecvFailed]
    assert pair.d.counters["leases_expired"] == 1


def test_abort_before_request_reaches_prefill_is_remembered() -> None:
    pair = make_pair()
    pair.absorb("d", pair.d.add_request("r1", (5, 6, 7), 1, 0.0))
    # D aborts; P never claimed, so nothing is quarantined and no Abort is sent.
    pair.absorb("d", pair.d.abort("r1", "client gone", 0.0))
    assert [type(r) for r in pair.recv] == [RecvFailed]
    req = PrefillRequest("r1", D_ADDR, (1, 2, 3), (5, 6, 7), 1)
    pair.absorb(0, pair.ps[0].add_request(req, 0.0))
    pair.deliver_all()  # D refuses the late claim
    assert pair.ps[0].state_of("r1") == "FAILED"
    assert pair.writes == []
    assert [f.ok for f in pair.finished] == [False]


def test_unknown_request_is_retried_until_attempts_run_out() -> None:
    pair = make_pair(pcfg=PrefillConfig(meta_retry_s=1.0, meta_attempts=3))
    req = PrefillRequest("r9", D_ADDR, (1,), (2,), 1)
    pair.absorb(0, pair.ps[0].add_request(req, 0.0))
    pair.deliver_all()
    assert pair.ps[0].state_of("r9") == "AWAIT_DECODER_META"
    pair.advance(10.0)
    assert pair.ps[0].state_of("r9") == "FAILED"
    assert pair.writes == []


def test_two_senders_decoder_done_only_after_both() -> None:
    pair = make_pair(n_ranks=2)
    pair.absorb("d", pair.d.add_request("r1", (5, 6, 7), 2, 0.0))
    for rank in (0, 1):
        req = PrefillRequest("r1", D_ADDR, (1, 2, 3), (5, 6, 7), 2)
        pair.absorb(rank, pair.ps[rank].add_request(req, 0.0))
        compute_all(pair, rank=rank)
    pair.deliver_all()
    w = [x for x in pair.writes if x[0] == 1]
    pair.writes = [x for x in pair.writes if x[0] == 0]
    pair.complete_writes()
    pair.deliver_all()
    assert pair.d.state_of("r1") == "RECEIVING"
    assert pair.recv == []
    pair.writes = w
    pair.complete_writes()
    pair.deliver_all()
    assert pair.d.state_of("r1") == "DONE"
    assert pair.recv == [RecvDone("r1")]


def test_duplicates_are_declared_noops() -> None:
    pair = make_pair()
    start(pair)
    pair.deliver_all()
    dup = MetaReply(PROTOCOL_VERSION, "r1", "accepted", d_sender(), None, "")
    assert pair.ps[0].on_message(dup, 0.0) == []
    compute_all(pair)
    pair.complete_writes()
    pair.deliver_all()
    ack = Ack(PROTOCOL_VERSION, "r1", "done", d_sender(), True)
    assert pair.ps[0].on_message(ack, 0.0) == []  # late duplicate of a finished request
    assert pair.ps[0].counters["stale_messages"] == 1


def test_impossible_event_names_request_state_and_event() -> None:
    pair = make_pair()
    start(pair)
    with pytest.raises(ProtocolError) as err:
        pair.ps[0].on_message(Ack(PROTOCOL_VERSION, "r1", "done", d_sender(), True), 0.0)
    text = str(err.value)
    assert "'r1'" in text and "AWAIT_DECODER_META" in text and "'ack'" in text
    with pytest.raises(ProtocolError, match="no such request"):
        pair.ps[0].on_message(Ack(PROTOCOL_VERSION, "zz", "done", d_sender(), True), 0.0)


def test_decoder_restart_invalidates_cached_layout() -> None:
    pair = make_pair()
    start(pair)
    compute_all(pair)
    pair.deliver_all()
    pair.complete_writes()
    pair.deliver_all()
    # D restarts with a new incarnation and a new layout.
    pair.d = DecodeEndpoint(d_sender(2), d_layout(L, incarnation=2))
    start(pair, "r2")
    sent = [s.msg for s in pair.queue]
    assert sent[0].want_layout is False  # cached from incarnation 1
    pair.deliver_all()  # accepted, but incarnation differs -> re-ask with want_layout
    assert pair.ps[0].state_of("r2") == "META_READY"
    assert pair.writes == [] or all(w.layout.incarnation == 2 for _, w in pair.writes)


def test_late_acceptance_after_prefill_gave_up_is_answered_with_failure() -> None:
    pair = make_pair(pcfg=PrefillConfig(request_timeout_s=1.0))
    start(pair)
    pending = list(pair.queue)  # the MetaRequest is delayed in the network
    pair.queue.clear()
    pair.advance(2.0)  # P's deadline: FAILED before D accepted anything
    assert pair.ps[0].state_of("r1") == "FAILED"
    pair.queue.extend(pending)
    pair.deliver_all()  # D accepts the stale claim; P answers FailedSending at once
    assert pair.d.state_of("r1") == "FAILED"
    assert [type(r) for r in pair.recv] == [RecvFailed]


def test_write_in_doubt_keeps_decoder_quarantine_until_lease() -> None:
    pair = make_pair(dcfg=DecodeConfig(prefill_timeout_s=50, lease_s=100))
    start(pair)
    pair.deliver_all()
    compute_all(pair)
    rank, w0 = pair.writes.pop(0)
    pair.absorb(0, pair.ps[0].transfer_done("r1", 0, False, "timeout", 0.0, in_doubt=True))
    pair.complete_writes()
    assert [f.ok for f in pair.finished] == [False]  # P's blocks: nothing reads them any more
    pair.deliver_all()  # FailedSending(in_doubt) reaches D
    assert pair.d.state_of("r1") == "FAILED"
    assert pair.recv == []  # the timed-out write may still land: quarantined
    pair.advance(99.0)
    assert pair.recv == []
    pair.advance(101.0)
    assert [type(r) for r in pair.recv] == [RecvFailed]


def test_bad_request_in_batch_changes_nothing() -> None:
    """layer_computed is all or nothing: one out-of-order request loses no other's write."""
    pair = make_pair()
    start(pair, "a")
    start(pair, "b")
    pair.deliver_all()
    pair.absorb(0, pair.ps[0].layer_computed(0, ["a"], 0.0))  # "b" has not computed layer 0
    with pytest.raises(ProtocolError, match="layer 1 computed but 0 was expected"):
        pair.ps[0].layer_computed(1, ["a", "b"], 0.0)
    assert pair.ps[0].inflight_writes("a") == 1 and len(pair.writes) == 1


def test_prefill_restart_fails_its_claims_on_decoder() -> None:
    """A higher incarnation of a P worker means the old one is gone: its claims are failed."""
    pair = make_pair()
    start(pair)
    pair.deliver_all()  # claim of incarnation 1 accepted
    old = p_sender()
    newer = Sender(old.engine_id, old.rank, 2, old.addr)
    pair.absorb("d", pair.d.add_request("r2", (9,), 1, 0.0))
    pair.absorb("d", pair.d.on_message(MetaRequest(PROTOCOL_VERSION, "r2", newer, False, (9,)),
                                           0.0))
    assert pair.d.state_of("r1") == "FAILED" and pair.d.counters["peer_restarts"] == 1
    assert any(isinstance(e, Quarantine) and e.req_id == "r1" for e in pair.other)


def test_a_repeated_claim_on_a_quarantined_request_is_refused_even_from_a_stopped_sender() -> None:
    """A failed request authorises no write: a late duplicate MetaRequest from a sender that
    already stopped (while another keeps the quarantine) gets "refused", not "accepted"."""
    from lw.fsm import PrefillRequest
    from lw.transport.wire import FailedSending, MetaReply, MetaRequest

    pair = make_pair(n_ranks=2, dcfg=DecodeConfig(prefill_timeout_s=50, lease_s=100))
    pair.absorb("d", pair.d.add_request("r1", (5, 6, 7), 2, pair.now))
    for rank in (0, 1):
        req = PrefillRequest("r1", D_ADDR, (1, 2, 3), (5, 6, 7), 2)
        pair.absorb(rank, pair.ps[rank].add_request(req, pair.now))
    claim = next(s.msg for s in pair.queue
                 if isinstance(s.msg, MetaRequest) and s.msg.sender.rank == 0)
    pair.deliver_all()
    compute_all(pair, rank=0)
    rank, _w = pair.writes.pop(0)
    assert rank == 0
    pair.absorb(0, pair.ps[0].transfer_done("r1", 0, False, "refused by peer", 0.0))
    pair.complete_writes()
    (failed,) = [s for s in pair.queue if isinstance(s.msg, FailedSending)]
    pair.queue.remove(failed)
    pair.absorb("d", pair.d.on_message(failed.msg, 1.0))  # its Abort to rank 1 stays queued
    # rank 0 stopped; rank 1 (claimed, not stopped) keeps the blocks quarantined
    assert pair.d.state_of("r1") == "FAILED" and pair.d.quarantined() == {"r1": (5, 6, 7)}
    replies = [e.msg for e in pair.d.on_message(claim, 1.0) if isinstance(e.msg, MetaReply)]
    assert [r.status for r in replies] == ["refused"]
