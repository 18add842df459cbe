"""Tests written to kill the survivors of ``tools/mutation.py`` (mutation testing of lw/fsm).

Each test states a piece of the protocol's intent that no earlier test or check pinned down;
the mutants it kills are listed in docs/checker-findings.md ("Mutation testing").
"""

from __future__ import annotations

import re

import msgspec
import pytest

from lw.fsm import (
    ArmTimer,
    CancelTimer,
    DecodeConfig,
    DecodeEndpoint,
    PrefillConfig,
    PrefillEndpoint,
    PrefillRequest,
    ProtocolError,
    Quarantine,
    RecvDone,
    RecvFailed,
    Send,
    SendFinished,
    WriteLayer,
    check_lease,
)
from lw.fsm.effects import effects_of_type
from lw.fsm.kvmap import (
    LayoutMismatch,
    block_segments,
    heads_of,
    make_format,
    pair_problem,
    tp_problem,
)
from lw.fsm.lifecycles import decode_declaration, prefill_declaration
from lw.fsm.machine import STAY, Declaration, Transition, rows
from lw.fsm.messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    Ack,
    DoneSending,
    FailedSending,
    KVFormat,
    MetaReply,
    MetaRequest,
    Sender,
)
from lw.transport.wire import decode, encode

from .harness import D_ADDR, Pair, d_layout, d_sender, p_sender

L = 2

# ------------------------------------------------------------------------------ configuration
DURATIONS = [(DecodeConfig, "prefill_timeout_s"), (DecodeConfig, "lease_s"),
             (DecodeConfig, "restart_claim_s"),
             (PrefillConfig, "meta_retry_s"), (PrefillConfig, "ack_retry_s"),
             (PrefillConfig, "request_timeout_s"), (PrefillConfig, "tombstone_ttl_s")]
COUNTS = [(DecodeConfig, "finished_memory"), (PrefillConfig, "meta_attempts"),
          (PrefillConfig, "ack_attempts"), (PrefillConfig, "finished_memory")]


@pytest.mark.parametrize(("cls", "name"), DURATIONS)
def test_every_deadline_must_be_positive_and_any_positive_one_is_accepted(cls, name) -> None:  # noqa: ANN001
    """A zero or negative deadline would fire at once: refused, naming the field."""
    for bad in (0, 0.0, -1.0):
        with pytest.raises(ValueError, match=name):
            cls(**{name: bad})
    for good in (1e-3, 0.5, 1.0, 2.0):
        assert getattr(cls(**{name: good}), name) == good


@pytest.mark.parametrize(("cls", "name"), COUNTS)
def test_budgets_and_memories_need_at_least_one(cls, name) -> None:  # noqa: ANN001
    """One attempt (or one remembered request) is the smallest working budget."""
    for bad in (0, -1):
        with pytest.raises(ValueError, match=name):
            cls(**{name: bad})
    for good in (1, 2):
        assert getattr(cls(**{name: good}), name) == good


def test_lease_must_outlast_every_write_prefill_may_still_start() -> None:
    """D's quarantine lease ends only after P's deadline plus a transfer timeout: equal is not
    enough (a write submitted at P's deadline may land up to the transfer timeout later)."""
    check_lease(DecodeConfig(lease_s=40.5), 30.0, 10.0)
    for lease in (40.0, 39.0, 10.0):
        with pytest.raises(ValueError, match="must exceed"):
            check_lease(DecodeConfig(lease_s=lease), 30.0, 10.0)


# ------------------------------------------------------------------------------ decode worker
def _d(finished_memory: int = 4096) -> DecodeEndpoint:
    return DecodeEndpoint(d_sender(), d_layout(L), DecodeConfig(finished_memory=finished_memory))


def test_decode_worker_only_serves_its_own_layout() -> None:
    """A layout of another engine or incarnation would send P to someone else's memory."""
    DecodeEndpoint(d_sender(1), d_layout(L, incarnation=1))
    with pytest.raises(ValueError, match="belong to this worker"):
        DecodeEndpoint(d_sender(2), d_layout(L, incarnation=1))
    other = msgspec.structs.replace(d_layout(L), engine_id="D2")
    with pytest.raises(ValueError, match="belong to this worker"):
        DecodeEndpoint(d_sender(1), other)


def test_quarantined_lists_exactly_the_failed_requests_whose_blocks_are_held() -> None:
    pair = Pair([PrefillEndpoint(p_sender(), L)], _d())
    pair.absorb("d", pair.d.add_request("r1", (5, 6), 1, 0.0))
    pair.absorb("d", pair.d.add_request("r2", (7,), 1, 0.0))
    pair.absorb(0, pair.ps[0].add_request(PrefillRequest("r1", D_ADDR, (1, 2), (5, 6)), 0.0))
    pair.deliver_all()  # r1 claimed: P may write into 5 and 6
    assert pair.d.quarantined() == {}  # receiving is not quarantined
    pair.absorb("d", pair.d.abort("r1", "client gone", 0.0))
    pair.absorb("d", pair.d.abort("r2", "client gone", 0.0))  # never claimed: freed at once
    assert pair.d.quarantined() == {"r1": (5, 6)}
    pair.deliver_all()  # Abort -> AbortAck: the sender stopped
    assert pair.d.quarantined() == {}
    assert sorted(r.req_id for r in pair.recv) == ["r1", "r2"]


def test_decode_forgets_the_oldest_finished_request_first() -> None:
    d = _d(finished_memory=2)
    for rid in ("a", "b", "c"):
        d.add_request(rid, (1,), 1, 0.0)
        d.abort(rid, "gone", 0.0)  # never claimed: FAILED and released at once
    assert [d.state_of(r) for r in ("a", "b", "c")] == [None, "FAILED", "FAILED"]
    # A late claim of a remembered request is refused; a forgotten one is only "unknown".
    status = {rid: d.on_message(MetaRequest(PROTOCOL_VERSION, rid, p_sender(), True, (1,)),
                                0.0)[0]
              .msg.status for rid in ("a", "c")}
    assert status == {"a": "unknown", "c": "refused"}


def test_prefill_forgets_the_oldest_finished_request_first() -> None:
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(finished_memory=2))
    for rid in ("a", "b", "c"):
        out = p.add_request(PrefillRequest(rid, (), (1,), (2,)), 0.0)  # no target: DONE at once
        assert [type(e) for e in out] == [SendFinished]
    assert [p.state_of(r) for r in ("a", "b", "c")] == [None, "DONE", "DONE"]


# ------------------------------------------------------------------------------ message sizes
LONG = "x" * 5000


def _crosses_wire(effects: list, kind: type) -> list:
    msgs = [e.msg for e in effects if isinstance(e, Send) and isinstance(e.msg, kind)]
    assert msgs, f"no {kind.__name__} sent"
    for m in msgs:
        assert decode(encode(m)) == m
    return msgs


def test_long_failure_reasons_are_cut_to_what_the_wire_carries() -> None:
    """A reason of any length never makes a message unencodable; the first 1024 chars go."""
    pair = Pair([PrefillEndpoint(p_sender(), L)], _d())
    pair.absorb("d", pair.d.add_request("r1", (5, 6), 1, 0.0))
    pair.absorb(0, pair.ps[0].add_request(PrefillRequest("r1", D_ADDR, (1, 2), (5, 6)), 0.0))
    pair.deliver_all()
    aborts = _crosses_wire(pair.d.abort("r1", LONG, 0.0), Abort)
    assert [len(m.reason) for m in aborts] == [1024]
    # D failed r1 with that reason: a new sender's claim is refused with it, cut to size.
    late = MetaRequest(PROTOCOL_VERSION, "r1", p_sender(1), True, (5, 6))
    replies = _crosses_wire(pair.d.on_message(late, 0.0), MetaReply)
    assert [(m.status, len(m.reason)) for m in replies] == [("refused", 1024)]
    # P fails with a long reason of its own: FailedSending carries its first 1024 chars.
    p = PrefillEndpoint(p_sender(), L)
    p.add_request(PrefillRequest("r2", D_ADDR, (1,), (5,)), 0.0)
    p.on_message(MetaReply(PROTOCOL_VERSION, "r2", "accepted", d_sender(), d_layout(L)), 0.0)
    failed = _crosses_wire(p.abort("r2", LONG, 0.0), FailedSending)
    assert [len(m.reason) for m in failed] == [1024]
    assert failed[0].reason == ("aborted locally: " + LONG)[:1024]


# ------------------------------------------------------------------------------ checker hooks
def test_decode_snapshot_tells_protocol_states_apart() -> None:
    """The explorer merges states with equal snapshots: every step of a request must show."""
    pair = Pair([PrefillEndpoint(p_sender(), L)], _d())
    seen = [pair.d.snapshot()]
    pair.absorb("d", pair.d.add_request("r1", (5, 6), 1, 0.0))
    seen.append(pair.d.snapshot())
    pair.absorb(0, pair.ps[0].add_request(PrefillRequest("r1", D_ADDR, (1, 2), (5, 6)), 0.0))
    pair.deliver_all()  # claimed
    seen.append(pair.d.snapshot())
    for layer in range(L):
        pair.absorb(0, pair.ps[0].layer_computed(layer, ["r1"], 0.0))
    pair.complete_writes()
    pair.deliver_all()  # DONE, acknowledged: finished
    seen.append(pair.d.snapshot())
    assert pair.d.state_of("r1") == "DONE"
    assert len(set(seen)) == len(seen), seen
    twin = _d()
    assert twin.snapshot() == seen[0]  # equal histories, equal snapshots
    hash(seen[-1])


def test_a_lease_for_a_request_that_is_not_failed_is_a_protocol_error() -> None:
    """Only a quarantined request has a lease; a stray lease timer names request and state."""
    d = _d()
    d.add_request("r1", (5,), 1, 0.0)
    with pytest.raises(ProtocolError) as err:
        d.on_timer(("lease", "r1"), 1.0)
    assert (err.value.req_id, err.value.state, err.value.event) == (
        "r1", "PREFILL_REQUESTED", "lease_expired")
    assert d.state_of("r1") == "PREFILL_REQUESTED"


# ------------------------------------------------------------------------------ request records
def test_a_live_request_cannot_be_added_twice() -> None:
    """A second add would reset the record under writes that may be in flight."""
    d = _d()
    d.add_request("r1", (5,), 1, 0.0)
    d.on_message(MetaRequest(PROTOCOL_VERSION, "r1", p_sender(), True, (5,)), 0.0)
    with pytest.raises(ValueError, match="already live"):
        d.add_request("r1", (6,), 1, 0.0)
    assert d.state_of("r1") == "RECEIVING" and d.awaited_peers()  # still claimed
    p = PrefillEndpoint(p_sender(), L)
    p.add_request(PrefillRequest("r1", D_ADDR, (1,), (5,)), 0.0)
    with pytest.raises(ValueError, match="already live"):
        p.add_request(PrefillRequest("r1", D_ADDR, (2,), (6,)), 0.0)


@pytest.mark.parametrize("expected", [0, -1, (), frozenset()])
def test_decode_needs_at_least_one_expected_sender(expected) -> None:  # noqa: ANN001
    """With no sender to wait for, D could never tell complete KV from none."""
    d = _d()
    with pytest.raises(ValueError, match="expected_senders"):
        d.add_request("r1", (5,), expected, 0.0)
    assert d.live_requests() == []
    d.add_request("r2", (5,), 1, 0.0)
    d.add_request("r3", (6,), frozenset({0}), 0.0)


def test_a_reused_request_id_is_remembered_as_the_newest() -> None:
    """When an id comes back, its finished record is the new one (and the last to go)."""
    d = _d(finished_memory=2)
    for rid in ("a", "b", "a", "c"):
        d.add_request(rid, (1,), 1, 0.0)
        d.abort(rid, "gone", 0.0)
    assert [d.state_of(r) for r in ("a", "b", "c")] == ["FAILED", None, "FAILED"]
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(finished_memory=2))
    for rid in ("a", "b", "a", "c"):
        p.add_request(PrefillRequest(rid, (), (1,), (2,)), 0.0)
    assert [p.state_of(r) for r in ("a", "b", "c")] == ["DONE", None, "DONE"]


def test_timers_of_released_requests_do_nothing() -> None:
    d = _d()
    p = PrefillEndpoint(p_sender(), L)
    for kind in ("deadline", "lease"):
        assert d.on_timer((kind, "gone"), 1.0) == []
    for kind in ("deadline", "meta", "ack", "tomb"):
        assert p.on_timer((kind, "gone"), 1.0) == []


def test_unknown_timer_kinds_are_refused() -> None:
    d = _d()
    d.add_request("r1", (5,), 1, 0.0)
    with pytest.raises(ValueError, match="unknown timer kind"):
        d.on_timer(("meta", "r1"), 1.0)
    p = PrefillEndpoint(p_sender(), L)
    p.add_request(PrefillRequest("r1", D_ADDR, (1,), (5,)), 0.0)
    with pytest.raises(ValueError, match="unknown timer kind"):
        p.on_timer(("lease", "r1"), 1.0)


# ------------------------------------------------------------------------------ peers and restarts
def _registered(d: DecodeEndpoint, rid: str) -> tuple[int, ...]:
    """The blocks D registered for ``rid`` (what an honest sender's claim names)."""
    rec = d._reqs.get(rid)
    return rec.blocks if rec is not None else ()


def _claim(d: DecodeEndpoint, rid: str, sender: Sender) -> str:
    out = d.on_message(MetaRequest(PROTOCOL_VERSION, rid, sender, True, _registered(d, rid)),
                       0.0)
    return next(e.msg.status for e in out if isinstance(e, Send) and isinstance(e.msg, MetaReply))


def test_losing_a_prefill_engine_fails_only_what_it_was_sending() -> None:
    d = _d()
    for rid in ("mine", "other", "unclaimed"):
        d.add_request(rid, (1,), 1, 0.0)
    assert _claim(d, "mine", Sender("P1", 0, 1, "tcp://p1/0")) == "accepted"
    assert _claim(d, "other", Sender("P2", 0, 1, "tcp://p2/0")) == "accepted"
    out = d.peer_lost("P1", "heartbeat lost", 1.0)
    assert [d.state_of(r) for r in ("mine", "other", "unclaimed")] == [
        "FAILED", "RECEIVING", "PREFILL_REQUESTED"]
    assert {e.req_id for e in out if isinstance(e, Quarantine)} == {"mine"}


def test_a_restarted_prefill_worker_is_noticed_once_and_then_served() -> None:
    """Incarnation 2 fails the claims of incarnation 1 once; its own claims then proceed."""
    d = _d()
    d.add_request("old", (1,), 1, 0.0)
    assert _claim(d, "old", Sender("P", 0, 1, "tcp://p0/0")) == "accepted"
    new = Sender("P", 0, 2, "tcp://p0/0")
    d.add_request("r2", (2,), 1, 0.0)
    assert _claim(d, "r2", new) == "accepted"
    assert d.state_of("old") == "FAILED" and d.counters["peer_restarts"] == 1
    d.add_request("r3", (3,), 1, 0.0)
    assert _claim(d, "r3", new) == "accepted"
    d.on_message(DoneSending(PROTOCOL_VERSION, "r2", new, 1, L), 0.0)
    assert d.state_of("r2") == "DONE" and d.state_of("r3") == "RECEIVING"
    assert d.counters["peer_restarts"] == 1
    # An older incarnation showing up late is not a restart either.
    d.add_request("r4", (4,), 1, 0.0)
    _claim(d, "r4", Sender("P", 0, 1, "tcp://p0/0"))
    assert d.state_of("r3") == "RECEIVING" and d.counters["peer_restarts"] == 1


def test_sender_memory_is_bounded_against_forged_senders() -> None:
    """Restart detection remembers at most 65536 senders: a flood of forged ids stops there,
    and the senders known before it are still watched."""
    d = _d()
    d.add_request("r", (1,), 1, 0.0)
    assert _claim(d, "r", Sender("P", 0, 1, "tcp://p0/0")) == "accepted"
    for i in range(65536 + 8):
        d.on_message(MetaRequest(PROTOCOL_VERSION, "nope", Sender(f"F{i}", 0, 1, "x"), True,
                                 ()), 0.0)
    assert len(d._incarnations) == 65536
    _claim(d, "nope", Sender("P", 0, 2, "tcp://p0/0"))
    assert d.state_of("r") == "FAILED"


# ------------------------------------------------------------------------------ claims on D
def _fmt(**kw: object) -> KVFormat:
    base: dict = dict(tp_rank=0, tp_size=1, total_heads=4, block_tokens=16, dtype="bf16")
    return make_format(**{**base, **kw})  # type: ignore[arg-type]


def _d_fmt(fmt: KVFormat) -> DecodeEndpoint:
    layout = msgspec.structs.replace(d_layout(L), fmt=fmt)
    return DecodeEndpoint(d_sender(), layout)


def _claim_fmt(d: DecodeEndpoint, rid: str, sender: Sender, fmt: KVFormat) -> MetaReply:
    out = d.on_message(MetaRequest(PROTOCOL_VERSION, rid, sender, True, _registered(d, rid),
                                   fmt), 0.0)
    return next(e.msg for e in out if isinstance(e, Send) and isinstance(e.msg, MetaReply))


def test_decode_refuses_a_sender_whose_heads_it_cannot_map() -> None:
    """D itself refuses a claim in another format: no write of that sender may land."""
    d = _d_fmt(_fmt())
    d.add_request("r", (1,), frozenset({0}), 0.0)
    rep = _claim_fmt(d, "r", Sender("P", 0, 1, "tcp://p0/0"), _fmt(dtype="fp8"))
    assert rep.status == "refused" and "different dtypes" in rep.reason
    assert rep.layout is None
    assert d.state_of("r") == "PREFILL_REQUESTED"  # nobody may write yet
    assert _claim_fmt(d, "r", Sender("P", 0, 1, "tcp://p0/0"), _fmt()).status == "accepted"


def test_one_sender_per_prefill_rank_even_from_another_engine() -> None:
    """A D rank expecting P TP rank 0 accepts one sender for it: a second one (another P
    engine, a stale incarnation's twin) is refused, or D would finish on the first DONE while
    the other still writes."""
    d = _d_fmt(_fmt())
    d.add_request("r", (1,), frozenset({0}), 0.0)
    first, second = Sender("PA", 0, 1, "tcp://pa/0"), Sender("PB", 0, 1, "tcp://pb/0")
    assert _claim_fmt(d, "r", first, _fmt()).status == "accepted"
    rep = _claim_fmt(d, "r", second, _fmt())
    assert rep.status == "refused" and "already claimed" in rep.reason
    assert _claim_fmt(d, "r", first, _fmt()).status == "accepted"  # a retry of the first


def test_decode_takes_no_more_senders_than_it_expects() -> None:
    """Counted senders (no rank set): the one beyond the expected number is refused."""
    d = _d()
    d.add_request("r", (1,), 2, 0.0)
    senders = [Sender("P", i, 1, f"tcp://p0/{i}") for i in range(3)]
    assert [_claim(d, "r", s) for s in senders] == ["accepted", "accepted", "refused"]
    assert _claim(d, "r", senders[0]) == "accepted"  # a retry of an accepted one


def test_decode_refuses_a_rank_it_does_not_expect() -> None:
    """The rank set D got from its scheduler wins over what the format would allow."""
    d = _d_fmt(_fmt())
    d.add_request("r", (1,), frozenset({1}), 0.0)
    rep = _claim_fmt(d, "r", Sender("P", 0, 1, "tcp://p0/0"), _fmt())
    assert rep.status == "refused" and "not a sender of this D worker" in rep.reason
    assert d.state_of("r") == "PREFILL_REQUESTED"


# ------------------------------------------------------------------------------ DONE on D
def _acks(out: list) -> list[tuple[str, bool]]:
    return [(e.msg.of, e.msg.accepted) for e in out if isinstance(e, Send)
            and isinstance(e.msg, Ack)]


def _received(d: DecodeEndpoint, rid: str, sender: Sender) -> None:
    d.add_request(rid, (5, 6), 1, 0.0)
    assert _claim(d, rid, sender) == "accepted"


def test_done_for_a_finished_request_is_acknowledged_with_its_outcome() -> None:
    """A duplicate DONE after DONE is accepted; a DONE for a request D failed is not (P must
    not believe its KV was used)."""
    d = _d()
    s = Sender("P", 0, 1, "tcp://p0/0")
    _received(d, "ok", s)
    assert _acks(d.on_message(DoneSending(PROTOCOL_VERSION, "ok", s, 1, L), 0.0)) == [
        ("done", True)]
    assert _acks(d.on_message(DoneSending(PROTOCOL_VERSION, "ok", s, 1, L), 0.0)) == [
        ("done", True)]
    d.add_request("bad", (7,), 1, 0.0)
    d.abort("bad", "gone", 0.0)  # never claimed: failed and forgotten at once
    assert _acks(d.on_message(DoneSending(PROTOCOL_VERSION, "bad", s, 1, L), 0.0)) == [
        ("done", False)]


def test_done_from_a_sender_that_never_claimed_is_a_protocol_error() -> None:
    d = _d()
    _received(d, "r", Sender("P", 0, 1, "tcp://p0/0"))
    with pytest.raises(ProtocolError, match="never accepted"):
        d.on_message(DoneSending(PROTOCOL_VERSION, "r", Sender("Q", 0, 1, "tcp://q/0"), 1, L),
                     0.0)
    assert d.state_of("r") == "RECEIVING"


@pytest.mark.parametrize("layers", [L - 1, L + 1])
def test_done_for_another_number_of_layers_is_never_decoded(layers: int) -> None:
    """A sender that wrote another number of layers left KV partial: FAILED, no RecvDone."""
    d = _d()
    s = Sender("P", 0, 1, "tcp://p0/0")
    _received(d, "r", s)
    out = d.on_message(DoneSending(PROTOCOL_VERSION, "r", s, 1, layers), 0.0)
    assert not any(isinstance(e, RecvDone) for e in out)
    assert d.state_of("r") == "FAILED"
    assert _acks(out) == [("done", False)]
    # A DONE that does not describe the request says nothing about the sender's writes: the
    # blocks stay quarantined until it confirms it stopped (FailedSending after the refusal).
    assert not any(isinstance(e, RecvFailed) for e in out)
    assert "r" in d.quarantined()
    out = d.on_message(FailedSending(PROTOCOL_VERSION, "r", s, 1, "refused"), 0.0)
    assert [e.block_ids for e in out if isinstance(e, RecvFailed)] == [(5, 6)]


def test_done_crossing_the_decoders_abort_releases_the_quarantine() -> None:
    """D failed the request (deadline) while the sender finished: its DONE says it stopped,
    so the blocks are released at once, and P is told its KV was not used."""
    d = DecodeEndpoint(d_sender(), d_layout(L), DecodeConfig(prefill_timeout_s=5, lease_s=50))
    s = Sender("P", 0, 1, "tcp://p0/0")
    _received(d, "r", s)
    out = d.on_timer(("deadline", "r"), 5.0)
    assert [e.req_id for e in out if isinstance(e, Quarantine)] == ["r"]
    out = d.on_message(DoneSending(PROTOCOL_VERSION, "r", s, 1, L), 6.0)
    assert _acks(out) == [("done", False)]
    assert [e.block_ids for e in out if isinstance(e, RecvFailed)] == [(5, 6)]
    assert any(isinstance(e, CancelTimer) and e.key == ("lease", "r") for e in out)
    assert d.live_requests() == [] and d.state_of("r") == "FAILED"


# ------------------------------------------------------------ FailedSending, AbortAck
def test_failed_sending_is_acknowledged_with_whether_it_changed_the_request() -> None:
    """Ack(failed, accepted=True) when the report failed a live request, False when D had
    already failed (or forgotten) it."""
    d = _d()
    s = Sender("P", 0, 1, "tcp://p0/0")
    _received(d, "r", s)
    out = d.on_message(FailedSending(PROTOCOL_VERSION, "r", s, 1, "write failed"), 0.0)
    assert _acks(out) == [("failed", True)]
    assert [e.req_id for e in out if isinstance(e, RecvFailed)] == ["r"]  # sender stopped
    out = d.on_message(FailedSending(PROTOCOL_VERSION, "r", s, 1, "again"), 0.0)
    assert _acks(out) == [("failed", False)]


def test_failed_sending_into_a_quarantine_releases_it_unless_in_doubt() -> None:
    for in_doubt in (False, True):
        d = DecodeEndpoint(d_sender(), d_layout(L), DecodeConfig(prefill_timeout_s=5,
                                                                 lease_s=50))
        s = Sender("P", 0, 1, "tcp://p0/0")
        _received(d, "r", s)
        d.on_timer(("deadline", "r"), 5.0)  # quarantined: s may still write
        out = d.on_message(FailedSending(PROTOCOL_VERSION, "r", s, 1, "stopped", in_doubt), 6.0)
        assert _acks(out) == [("failed", False)]
        released = [e.req_id for e in out if isinstance(e, RecvFailed)]
        assert released == ([] if in_doubt else ["r"])
        assert d.quarantined() == ({"r": (5, 6)} if in_doubt else {})


def test_reports_about_requests_decode_never_had_are_refused_or_protocol_errors() -> None:
    """DONE / FailedSending about a request D never had get "not accepted" (the sender fails
    at once instead of retrying); an AbortAck for one is a protocol error."""
    d = _d()
    s = Sender("P", 0, 1, "tcp://p0/0")
    for msg in (DoneSending(PROTOCOL_VERSION, "zz", s, 1, L),
                FailedSending(PROTOCOL_VERSION, "zz", s, 1, "x")):
        (reply,) = d.on_message(msg, 0.0)
        assert reply.msg.accepted is False  # type: ignore[attr-defined]
    with pytest.raises(ProtocolError, match="no such request"):
        d.on_message(AbortAck(PROTOCOL_VERSION, "zz", s, True), 0.0)
    _received(d, "r", s)
    with pytest.raises(ProtocolError, match="never accepted"):
        d.on_message(FailedSending(PROTOCOL_VERSION, "r", Sender("Q", 0, 1, "q"), 1, "x"), 0.0)
    with pytest.raises(ProtocolError, match="did not abort"):
        d.on_message(AbortAck(PROTOCOL_VERSION, "r", s, True), 0.0)
    assert d.state_of("r") == "RECEIVING"


# ------------------------------------------------------------------------------ timers
def _pair() -> Pair:
    return Pair([PrefillEndpoint(p_sender(), L)],
                DecodeEndpoint(d_sender(), d_layout(L), DecodeConfig(prefill_timeout_s=5,
                                                                     lease_s=50)))


def _start(pair: Pair) -> None:
    pair.absorb("d", pair.d.add_request("r", (5, 6), 1, pair.now))
    pair.absorb(0, pair.ps[0].add_request(PrefillRequest("r", D_ADDR, (1, 2), (5, 6)),
                                          pair.now))


def _finish(pair: Pair) -> None:
    """Run everything to the end; afterwards no request is live and no timer is armed."""
    for _ in range(4):
        pair.deliver_all()
        pair.complete_writes()
    pair.deliver_all()
    assert pair.ps[0].live_requests() == [] and pair.d.live_requests() == []
    assert pair.timers == {}, pair.timers


def test_no_timer_outlives_its_request() -> None:
    """A finished request waits for nothing: each scenario ends with every timer cancelled
    (the runtime would otherwise hold one timer per past request)."""
    happy = _pair()
    _start(happy)
    happy.deliver_all()
    for layer in range(L):
        happy.absorb(0, happy.ps[0].layer_computed(layer, ["r"], 0.0))
    _finish(happy)
    assert happy.recv == [RecvDone("r")]

    aborted = _pair()  # D aborts while a write is in flight: quarantine, AbortAck, release
    _start(aborted)
    aborted.deliver_all()
    aborted.absorb(0, aborted.ps[0].layer_computed(0, ["r"], 0.0))
    aborted.absorb("d", aborted.d.abort("r", "client gone", 0.0))
    _finish(aborted)

    failed = _pair()  # P's write fails: FailedSending, D releases
    _start(failed)
    failed.deliver_all()
    failed.absorb(0, failed.ps[0].layer_computed(0, ["r"], 0.0))
    failed.complete_writes(ok=False, reason="peer closed")
    _finish(failed)
    assert [type(r) for r in failed.recv] == [RecvFailed]


# ------------------------------------------------------------------------------ kvmap, effects
@pytest.mark.parametrize(("tp", "heads"), [(0, 4), (4, 0), (0, 0), (-1, 4), (2, -2)])
def test_tp_and_heads_must_both_be_positive(tp: int, heads: int) -> None:
    assert "must be >= 1" in tp_problem(tp, heads)
    assert "must be >= 1" in tp_problem(tp, heads, mla=True)


def test_effects_of_type_keeps_order_and_kind() -> None:
    effects = [RecvDone("a"), CancelTimer(("x", "a")), RecvDone("b")]
    assert effects_of_type(effects, RecvDone) == [RecvDone("a"), RecvDone("b")]
    assert effects_of_type(effects, Send) == []


@pytest.mark.parametrize(("tp", "heads", "mla"), [(1, 1, False), (2, 4, False), (4, 2, False),
                                                  (2, 1, True), (8, 1, True), (1, 8, False)])
def test_shapes_vllm_can_shard_have_no_problem(tp: int, heads: int, mla: bool) -> None:
    """The contract is a string: "" (not None) when the shape works."""
    assert tp_problem(tp, heads, mla) == ""


def test_heads_of_refuses_shapes_and_ranks_that_do_not_exist() -> None:
    """A rank outside TP (or a shape vLLM cannot shard) has no heads: asking is an error, not
    a range of someone else's heads."""
    with pytest.raises(ValueError, match="do not split evenly"):
        heads_of(0, 3, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        heads_of(0, 3, 2)
    for rank in (-1, 2, 3):
        with pytest.raises(ValueError, match="outside TP"):
            heads_of(rank, 2, 4)
    assert [heads_of(r, 2, 4) for r in (0, 1)] == [(0, 2), (2, 4)]


@pytest.mark.parametrize("heads", [1, 4, 16])
def test_mla_format_is_one_latent_head_whatever_the_model_says(heads: int) -> None:
    """MLA's latent vector is one head on every rank, so P and D formats built from configs
    that name different head counts still pair."""
    for rank in range(2):
        f = make_format(tp_rank=rank, tp_size=2, total_heads=heads, block_tokens=16,
                        dtype="bf16", mla=True)
        assert (f.total_heads, f.head_lo, f.head_hi, f.mla) == (1, 0, 1, True)


def _f(rank: int, tp: int, order: str) -> KVFormat:
    return make_format(tp_rank=rank, tp_size=tp, total_heads=4, block_tokens=16, dtype="bf16",
                       order=order)


@pytest.mark.parametrize(("p", "d", "ok"), [
    ((1, 4), (1, 4), True),    # one head on each side: HND and NHD are the same bytes
    ((0, 2), (0, 2), False),   # two heads each: the orders interleave differently
    ((0, 2), (1, 4), False),   # P holds two heads, D one
    ((3, 4), (1, 2), False),   # P holds one head (3), D two (2..3)
])
def test_in_block_order_matters_only_when_a_block_holds_several_heads(p, d, ok) -> None:  # noqa: ANN001
    for po, do in (("HND", "NHD"), ("NHD", "HND")):
        why = pair_problem(_f(*p, po), _f(*d, do))
        assert (why == "") == ok, why
        if not ok:
            assert "in-block orders" in why
    assert pair_problem(_f(*p, "NHD"), _f(*d, "NHD")) == ""


def test_disjoint_heads_are_named_as_such() -> None:
    """P heads 0..1 and D heads 2..3 touch but share nothing: the refusal says why."""
    why = pair_problem(_f(0, 2, "HND"), _f(1, 2, "HND"))
    assert "no KV head in common" in why
    assert pair_problem(_f(1, 2, "HND"), _f(1, 2, "HND")) == ""


# ------------------------------------------------------------------------------ small contracts
def test_protocol_error_reads_as_one_sentence_with_its_detail() -> None:
    plain = ProtocolError("decode", "r1", "RECEIVING", "lease_expired")
    assert str(plain) == "decode: request 'r1' in state RECEIVING cannot take event 'lease_expired'"
    full = ProtocolError("prefill", "r2", "META_READY", "ack", "before DONE was sent")
    assert str(full).endswith("cannot take event 'ack' (before DONE was sent)")


def test_a_model_has_at_least_one_layer() -> None:
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        PrefillEndpoint(p_sender(), 0)
    assert PrefillEndpoint(p_sender(), 1).declaration.states[:4] == (
        "AHEAD", "AWAIT_DECODER_META", "META_READY", "LAYER_0_SENT")


def _nhd(rank: int, tp: int, heads: int = 4) -> KVFormat:
    return make_format(tp_rank=rank, tp_size=tp, total_heads=heads, block_tokens=16,
                       dtype="bf16", order="NHD")


def test_nhd_blocks_with_the_same_heads_are_one_run() -> None:
    """Same heads on both sides: the block is copied as one run, not one run per token."""
    assert block_segments(_nhd(0, 1), 4 * 64, _nhd(0, 1), 4 * 64) == ((0, 0, 256),)
    # One head per block: any byte size works (no token split is needed).
    assert block_segments(_nhd(1, 4), 100, _nhd(1, 4), 100) == ((0, 0, 100),)


def test_nhd_heads_that_do_not_split_into_tokens_are_refused() -> None:
    """Several heads per block, token-major: a head's bytes must split evenly by token."""
    with pytest.raises(LayoutMismatch, match="do not split into 16 tokens"):
        block_segments(_nhd(0, 1), 4 * 100, _nhd(0, 2), 2 * 100)
    assert len(block_segments(_nhd(0, 1), 4 * 64, _nhd(0, 2), 2 * 64)) == 16


# ------------------------------------------------------------------------------ declarations
def _decl(*rows_: Transition) -> Declaration:
    return Declaration("m", ("A", "B", "END"), "A", frozenset({"END"}), tuple(rows_))


def test_declaration_lists_each_event_once_in_order_of_first_use() -> None:
    d = _decl(rows("go", ["A"], "B"), rows("stop", ["A", "B"], "END"), rows("go", ["B"], STAY),
              rows("stop", ["END"], STAY))
    assert d.events == ("go", "stop")
    assert d.compile() == {("A", "go"): "B", ("B", "go"): "B", ("A", "stop"): "END",
                           ("B", "stop"): "END", ("END", "stop"): "END"}


@pytest.mark.parametrize(("bad", "needle"), [
    (rows("go", ["Z"], "B"), "unknown source state Z"),
    (rows("go", ["A"], "Z"), "unknown destination Z"),
    (rows("go", ["END"], "A"), "final states may only STAY"),
    (rows("go", ["A", "B", "A"], "B"), "two rows for (A, go)"),
])
def test_a_malformed_table_is_refused_when_declared(bad: Transition, needle: str) -> None:
    """A table with an unknown state, a duplicate row or a way out of a final state is a bug
    in the declaration: refused at import, not found in production."""
    with pytest.raises(ValueError, match=re.escape(needle)):
        _decl(rows("stop", ["A"], "END"), bad)
    with pytest.raises(ValueError, match="two rows"):
        _decl(rows("go", ["A"], "B"), rows("go", ["A"], "END"))


@pytest.mark.parametrize("decl", [prefill_declaration(2), decode_declaration()],
                         ids=["prefill", "decode"])
def test_reference_machine_knows_only_the_declared_events(decl: Declaration) -> None:
    """transitions' own machine is the reference semantics: no implicit ``to_STATE`` moves,
    and an undeclared event is an error, never ignored."""
    for state in decl.states:
        model = type("M", (), {})()
        m = decl.reference_machine(model, initial=state)
        assert set(m.get_triggers(state)) == {t.event for t in decl.transitions
                                              if state in t.sources}
        assert not any(name.startswith("to_") for name in dir(model))


# ------------------------------------------------------------------------------ wire compatibility
# Bytes of protocol version 8 as a peer built from another commit sends them (claim epoch 2,
# the prompt's digest).
PROMPT = "0123456789abcdef0123456789abcdef"
GOLDEN_CLAIM = (
    b"\x89\xa4kind\xa8meta_req\xa7version\x08\xa6req_id\xa2r1\xa6sender\x84\xa9engine_id\xa1P"
    b"\xa4rank\x00\xabincarnation\x01\xa4addr\xa8tcp://p0\xabwant_layout\xc3"
    b"\xa6blocks\x92\x05\x06\xa3fmt\x89\xa5dtype"
    b"\xa4bf16\xacblock_tokens\x10\xa5order\xa3HND\xabtotal_heads\x04\xa7head_lo\x00\xa7head_hi"
    b"\x02\xa7tp_rank\x00\xa7tp_size\x02\xa3mla\xc2\xa5epoch\x02\xa6prompt\xd9 "
    + PROMPT.encode())


def test_messages_of_this_protocol_version_keep_their_bytes() -> None:
    """Peers of the same version interoperate: a captured claim decodes, and encodes back to
    the same bytes (a change of version or field must be deliberate)."""
    msg = decode(GOLDEN_CLAIM)
    assert msg == MetaRequest(PROTOCOL_VERSION, "r1", Sender("P", 0, 1, "tcp://p0"), True,
                              (5, 6), _fmt(tp_size=2), 2, PROMPT)
    assert encode(msg) == GOLDEN_CLAIM


def test_a_claim_without_a_format_is_an_opaque_single_head_block() -> None:
    """An omitted format (an older sender) means whole opaque blocks: one head, one rank,
    not MLA; D with the same default format accepts it."""
    raw = msgspec.msgpack.encode({"kind": "meta_req", "version": PROTOCOL_VERSION,
                                  "req_id": "r1", "want_layout": True, "blocks": [5],
                                  "sender": {"engine_id": "P", "rank": 0, "incarnation": 1,
                                             "addr": "tcp://p0/0"}})
    msg = decode(raw)
    assert isinstance(msg, MetaRequest)
    f = msg.fmt
    assert (f.total_heads, f.head_lo, f.head_hi, f.tp_rank, f.tp_size, f.mla, f.order,
            f.block_tokens) == (1, 0, 1, 0, 1, False, "HND", 1)
    d = _d()
    d.add_request("r1", (5,), 1, 0.0)
    assert next(e.msg.status for e in d.on_message(msg, 0.0)) == "accepted"


# ------------------------------------------------------------------------------ prefill inputs
def test_prefill_refuses_requests_it_could_not_write_consistently() -> None:
    p = PrefillEndpoint(p_sender(), L)
    with pytest.raises(ValueError, match="2 local blocks but 1 remote"):
        p.add_request(PrefillRequest("r", D_ADDR, (1, 2), (5,)), 0.0)
    with pytest.raises(ValueError, match="named twice"):
        p.add_request(PrefillRequest("r", (D_ADDR, "tcp://d1", D_ADDR), (1,), (5,)), 0.0)
    assert p.live_requests() == []
    with pytest.raises(ValueError, match="local layout has 3 layers, not 2"):
        PrefillEndpoint(p_sender(), L, local=d_layout(3))


def test_a_stray_ack_timer_while_waiting_for_meta_is_a_protocol_error() -> None:
    p = PrefillEndpoint(p_sender(), L)
    p.add_request(PrefillRequest("r", D_ADDR, (1,), (5,)), 0.0)
    with pytest.raises(ProtocolError) as err:
        p.on_timer(("ack", "r"), 1.0)
    assert (err.value.state, err.value.event) == ("AWAIT_DECODER_META", "ack_timer")


def _abort_msg(rid: str) -> Abort:
    return Abort(PROTOCOL_VERSION, rid, d_sender(), "client gone")


def test_an_abort_that_overtakes_the_request_stops_it_once() -> None:
    """D aborted a request P has not seen: P confirms at once, and when the request arrives it
    fails it without a claim or a write; the tombstone is then spent."""
    p = PrefillEndpoint(p_sender(), L)
    out = p.on_message(_abort_msg("r"), 0.0)
    acks = [e.msg for e in out if isinstance(e, Send)]
    assert [(type(m).__name__, m.known) for m in acks] == [("AbortAck", False)]
    assert [e.key for e in out if isinstance(e, ArmTimer)] == [("tomb", "r")]
    out = p.add_request(PrefillRequest("r", D_ADDR, (1,), (5,)), 1.0)
    assert [(f.ok, "before it reached" in f.reason) for f in out
            if isinstance(f, SendFinished)] == [(False, True)]
    assert not any(isinstance(e, Send) for e in out)  # no claim: D gave up
    assert any(isinstance(e, CancelTimer) and e.key == ("tomb", "r") for e in out)
    assert isinstance(out, list) and p.state_of("r") == "FAILED"
    # The id comes back later (a retry of the client): a new request, served normally.
    out = p.add_request(PrefillRequest("r", D_ADDR, (1,), (5,)), 2.0)
    assert p.state_of("r") == "AWAIT_DECODER_META"
    assert [type(e.msg).__name__ for e in out if isinstance(e, Send)] == ["MetaRequest"]


def test_a_tombstone_expires() -> None:
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(tombstone_ttl_s=10.0))
    out = p.on_message(_abort_msg("r"), 0.0)
    assert [e.at for e in out if isinstance(e, ArmTimer)] == [10.0]
    assert p.on_timer(("tomb", "r"), 10.0) == []
    p.add_request(PrefillRequest("r", D_ADDR, (1,), (5,)), 11.0)
    assert p.state_of("r") == "AWAIT_DECODER_META"


# ------------------------------------------------------------------------------ write completions
def _meta_ready(p: PrefillEndpoint, rid: str = "r") -> None:
    p.add_request(PrefillRequest(rid, D_ADDR, (1,), (5,)), 0.0)
    p.on_message(MetaReply(PROTOCOL_VERSION, rid, "accepted", d_sender(), d_layout(L)), 0.0)
    assert p.state_of(rid) == "META_READY"


def test_a_completion_without_a_write_in_flight_is_a_protocol_error() -> None:
    """The data plane reports each submitted write once: anything else is a driver bug."""
    p = PrefillEndpoint(p_sender(), L)
    with pytest.raises(ProtocolError, match="no such live request"):
        p.transfer_done("zz", 0, True, "", 0.0)
    _meta_ready(p)
    with pytest.raises(ProtocolError, match="no write of layer 0 in flight"):
        p.transfer_done("r", 0, True, "", 0.0)  # nothing submitted yet
    writes = p.layer_computed(0, ["r"], 0.0)
    assert len(writes) == 1
    with pytest.raises(ProtocolError, match="no write of layer 1 in flight"):
        p.transfer_done("r", 1, True, "", 0.0)  # layer 0 is in flight, not layer 1
    p.layer_computed(1, ["r"], 0.0)
    p.transfer_done("r", 0, True, "", 0.0)
    with pytest.raises(ProtocolError, match="no write of layer 0 in flight"):
        p.transfer_done("r", 0, True, "", 0.0)  # reported twice, while layer 1 is in flight
    assert p.state_of("r") == "LAYER_0_SENT" and p.inflight_writes("r") == 1


# ------------------------------------------------------------------------------ retries
def _sent(out: list, kind: type) -> list:
    return [e.msg for e in out if isinstance(e, Send) and isinstance(e.msg, kind)]


def test_done_is_resent_until_acknowledged_then_the_request_fails() -> None:
    """A lost DONE (vllm-ascend #8166) is retried every ack_retry_s, ack_attempts times in
    all; without an acknowledgement the request fails rather than hanging."""
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(ack_retry_s=1.0, ack_attempts=3))
    _meta_ready(p)
    out: list = []
    for layer in range(L):
        out += p.layer_computed(layer, ["r"], 0.0)
        out += p.transfer_done("r", layer, True, "", 0.0)
    dones = _sent(out, DoneSending)
    timers = [e for e in out if isinstance(e, ArmTimer) and e.key == ("ack", "r")]
    assert len(dones) == 1 and [t.at for t in timers] == [1.0]
    now = 1.0
    for _ in range(2):  # two more tries: DONE again, timer again
        out = p.on_timer(("ack", "r"), now)
        assert len(_sent(out, DoneSending)) == 1
        now += 1.0
        assert [e.at for e in out if isinstance(e, ArmTimer)] == [now]
    out = p.on_timer(("ack", "r"), now)  # third try unanswered: give up
    assert _sent(out, DoneSending) == []
    assert [(f.ok, "no acknowledgement" in f.reason) for f in out
            if isinstance(f, SendFinished)] == [(False, True)]


def test_meta_requests_are_sent_meta_attempts_times_then_the_request_fails() -> None:
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(meta_retry_s=1.0, meta_attempts=3))
    out = p.add_request(PrefillRequest("r", (D_ADDR, "tcp://d1"), (1,), (5,)), 0.0)
    # d0 accepts at once; d1 never answers.
    out += p.on_message(MetaReply(PROTOCOL_VERSION, "r", "accepted", d_sender(), d_layout(L)),
                        0.0)
    for t in (1.0, 2.0, 3.0):
        out += p.on_timer(("meta", "r"), t)
    claims = _sent(out, MetaRequest)
    assert len(claims) == 2 + 2  # both targets once, then d1 alone on each retry
    fin = [f for f in out if isinstance(f, SendFinished)]
    assert [f.ok for f in fin] == [False]
    assert "tcp://d1" in fin[0].reason and D_ADDR not in fin[0].reason
    assert "after 3 MetaRequests" in fin[0].reason


def test_prefill_refuses_messages_only_a_decoder_receives() -> None:
    p = PrefillEndpoint(p_sender(), L)
    _meta_ready(p)
    for msg in (MetaRequest(PROTOCOL_VERSION, "r", p_sender(1), True, (1,)),
                DoneSending(PROTOCOL_VERSION, "r", p_sender(1), 1, L)):
        with pytest.raises(ProtocolError, match="only accepts MetaReply, Ack and Abort"):
            p.on_message(msg, 0.0)
    assert p.state_of("r") == "META_READY"


def test_losing_a_decoder_fails_only_its_requests_and_forgets_its_layout() -> None:
    p = PrefillEndpoint(p_sender(), L)
    _meta_ready(p, "r0")  # claimed on d0: its layout is cached
    p.add_request(PrefillRequest("r1", "tcp://d1", (2,), (6,)), 0.0)
    out = p.peer_lost(D_ADDR, "connection refused", 1.0)
    assert [p.state_of(r) for r in ("r0", "r1")] == ["FAILED", "AWAIT_DECODER_META"]
    assert [(f.req_id, f.ok) for f in out if isinstance(f, SendFinished)] == [("r0", False)]
    # the claimed D still gets a word, fire and forget: one declared lost may be alive (a
    # starved protocol thread) and then fails or retries at once (issue 40); only r0's
    assert [(e.dest, type(e.msg).__name__, e.msg.req_id) for e in out if isinstance(e, Send)
            ] == [(D_ADDR, "FailedSending", "r0")]
    # A restarted D at that address: the next claim asks for its layout again.
    out = p.add_request(PrefillRequest("r2", D_ADDR, (3,), (7,)), 2.0)
    assert [m.want_layout for m in _sent(out, MetaRequest)] == [True]


# ------------------------------------------------------------------------------ late MetaReplies
def _reply(rid: str, status: str, addr: str = D_ADDR) -> MetaReply:
    layout = d_layout(L) if status == "accepted" else None
    return MetaReply(PROTOCOL_VERSION, rid, status, Sender("D", 0, 1, addr), layout)


def test_an_acceptance_after_prefill_gave_up_is_answered_with_failed_sending() -> None:
    """D took us as a sender after we failed and released the request: D must hear that we
    stopped (or it holds the blocks until its lease); an in-doubt failure says so."""
    for in_doubt in (False, True):
        p = PrefillEndpoint(p_sender(), L)
        _meta_ready(p)
        p.layer_computed(0, ["r"], 0.0)
        p.transfer_done("r", 0, False, "timeout", 0.0, in_doubt=in_doubt)
        assert p.state_of("r") == "FAILED" and p.live_requests() == []
        out = p.on_message(_reply("r", "accepted"), 1.0)  # answer to an old retry
        told = _sent(out, FailedSending)
        assert [(m.req_id, m.in_doubt) for m in told] == [("r", in_doubt)]
        assert [s.dest for s in out if isinstance(s, Send)] == [D_ADDR]
        assert p.counters["stale_messages"] == 1


def test_late_replies_that_claim_nothing_are_only_counted() -> None:
    p = PrefillEndpoint(p_sender(), L)
    done = PrefillEndpoint(p_sender(), L)  # finished DONE: a late acceptance changes nothing
    _meta_ready(done)
    for layer in range(L):
        done.layer_computed(layer, ["r"], 0.0)
        done.transfer_done("r", layer, True, "", 0.0)
    done.on_message(Ack(PROTOCOL_VERSION, "r", "done", d_sender(), True), 0.0)
    assert done.state_of("r") == "DONE"
    assert done.on_message(_reply("r", "accepted"), 1.0) == []
    _meta_ready(p)
    p.abort("r", "client gone", 0.0)  # failed and released; D was told
    for status in ("refused", "unknown"):
        assert p.on_message(_reply("r", status), 1.0) == []
    with pytest.raises(ProtocolError, match="no such request"):
        p.on_message(_reply("never", "accepted"), 1.0)


def test_an_acceptance_from_a_decoder_we_never_asked_is_answered_with_failed_sending() -> None:
    p = PrefillEndpoint(p_sender(), L)
    p.add_request(PrefillRequest("r", D_ADDR, (1,), (5,)), 0.0)
    out = p.on_message(_reply("r", "accepted", "tcp://elsewhere"), 0.0)
    assert [(s.dest, type(s.msg).__name__) for s in out if isinstance(s, Send)] == [
        ("tcp://elsewhere", "FailedSending")]
    assert p.state_of("r") == "AWAIT_DECODER_META"  # our own target still decides
    assert p.on_message(_reply("r", "refused", "tcp://elsewhere"), 0.0) == []


def test_a_decoder_presumed_lost_that_accepts_again_is_told_when_we_stop() -> None:
    """A D presumed lost may be alive (issue 40): once the write in flight ends it hears
    FailedSending, whether a late reply accepts again or refuses (a refusal takes back
    nothing D accepted before: it is told once, as a claimed D always is)."""
    for status, told in (("accepted", ["FailedSending"]), ("refused", ["FailedSending"])):
        p = PrefillEndpoint(p_sender(), L)
        _meta_ready(p)
        p.layer_computed(0, ["r"], 0.0)
        p.peer_lost(D_ADDR, "heartbeat", 1.0)
        assert p.state_of("r") == "FAILED" and p.live_requests() == ["r"]
        p.on_message(_reply("r", status), 2.0)
        out = p.transfer_done("r", 0, True, "", 3.0)
        assert [type(m.msg).__name__ for m in out if isinstance(m, Send)] == told


# ------------------------------------------------------------------------------ stale layouts
def test_a_layout_from_an_earlier_decoder_incarnation_is_never_written() -> None:
    """vllm-ascend #4650's class: D restarted (incarnation 2) while P cached its layout of
    incarnation 1. P must not write with the old addresses: it asks again for the layout."""
    p = PrefillEndpoint(p_sender(), L)
    _meta_ready(p, "r1")  # caches D's layout of incarnation 1
    new_d = Sender("D", 0, 2, D_ADDR)
    out = p.add_request(PrefillRequest("r2", D_ADDR, (2,), (6,)), 1.0)
    assert [m.want_layout for m in _sent(out, MetaRequest)] == [False]  # cached
    # D (restarted) accepts without a layout, as asked.
    out = p.on_message(MetaReply(PROTOCOL_VERSION, "r2", "accepted", new_d, None), 1.0)
    assert [m.want_layout for m in _sent(out, MetaRequest)] == [True]
    assert p.state_of("r2") == "AWAIT_DECODER_META"
    assert p.layer_computed(0, ["r2"], 1.0) == []  # nothing written meanwhile
    # The next request asks for the layout at once: the stale one is forgotten.
    out = p.add_request(PrefillRequest("r3", D_ADDR, (3,), (7,)), 1.0)
    assert [m.want_layout for m in _sent(out, MetaRequest)] == [True]
    out = p.on_message(MetaReply(PROTOCOL_VERSION, "r2", "accepted", new_d,
                                 d_layout(L, incarnation=2)), 2.0)
    assert {w.layout.incarnation for w in out if isinstance(w, WriteLayer)} == {2}


def test_an_acceptance_without_any_layout_asks_for_it() -> None:
    p = PrefillEndpoint(p_sender(), L)
    p.add_request(PrefillRequest("r", D_ADDR, (1,), (5,)), 0.0)
    out = p.on_message(MetaReply(PROTOCOL_VERSION, "r", "accepted", d_sender(), None), 0.0)
    assert [m.want_layout for m in _sent(out, MetaRequest)] == [True]
    assert p.state_of("r") == "AWAIT_DECODER_META"


def test_no_meta_retry_is_pending_once_every_target_accepted() -> None:
    p = PrefillEndpoint(p_sender(), L)
    out = p.add_request(PrefillRequest("r", (D_ADDR, "tcp://d1"), (1,), (5,)), 0.0)
    assert ("meta", "r") in [e.key for e in out if isinstance(e, ArmTimer)]
    out = p.on_message(_reply("r", "accepted"), 0.0)
    assert not any(isinstance(e, CancelTimer) for e in out)  # d1 still pending
    out = p.on_message(_reply("r", "accepted", "tcp://d1"), 0.0)
    assert [e.key for e in out if isinstance(e, CancelTimer)] == [("meta", "r")]
    assert p.state_of("r") == "META_READY"


# ---------------------------------------------------------------- acknowledgements on P
def _ack(rid: str, accepted: bool = True, addr: str = D_ADDR, of: str = "done") -> Ack:
    return Ack(PROTOCOL_VERSION, rid, of, Sender("D", 0, 1, addr), accepted)


def _all_sent(p: PrefillEndpoint, rid: str = "r") -> list:
    out: list = []
    for layer in range(L):
        out += p.layer_computed(layer, [rid], 0.0)
        out += p.transfer_done(rid, layer, True, "", 0.0)
    return out


def test_done_refused_by_the_decoder_fails_the_request() -> None:
    """Ack(done, accepted=False): D had already failed the request, its KV is not used."""
    p = PrefillEndpoint(p_sender(), L)
    _meta_ready(p)
    _all_sent(p)
    out = p.on_message(_ack("r", accepted=False), 1.0)
    assert [(f.ok, "had already failed" in f.reason) for f in out
            if isinstance(f, SendFinished)] == [(False, True)]


def test_acks_that_acknowledge_nothing_change_nothing() -> None:
    p = PrefillEndpoint(p_sender(), L)
    _meta_ready(p)
    p.layer_computed(0, ["r"], 0.0)
    assert p.on_message(_ack("r", addr="tcp://elsewhere"), 0.0) == []  # not a target of ours
    assert p.on_message(_ack("r", of="failed"), 0.0) == []  # D has a FailedSending of ours
    p.abort("r", "client gone", 0.0)  # FAILED, the write still in flight
    assert p.live_requests() == ["r"]
    assert p.on_message(_ack("r"), 0.0) == []  # a stray Ack after failing: declared no-op
    assert p.state_of("r") == "FAILED" and p.counters["stale_messages"] == 1


def test_an_ack_before_done_was_sent_is_a_protocol_error_even_from_one_of_two_targets() -> None:
    p = PrefillEndpoint(p_sender(), L)
    p.add_request(PrefillRequest("r", (D_ADDR, "tcp://d1"), (1,), (5,)), 0.0)
    p.on_message(_reply("r", "accepted"), 0.0)
    p.on_message(_reply("r", "accepted", "tcp://d1"), 0.0)
    p.layer_computed(0, ["r"], 0.0)
    with pytest.raises(ProtocolError, match="before DONE was sent"):
        p.on_message(_ack("r"), 0.0)


# ------------------------------------------------------------------------------ aborts on P
def test_decoder_abort_is_confirmed_with_abort_ack_only_once_nothing_is_in_flight() -> None:
    """D aborted: P answers AbortAck (not FailedSending: D started it) when no write of ours
    can land any more: at once when idle, after the drain otherwise."""
    idle = PrefillEndpoint(p_sender(), L)
    _meta_ready(idle)
    out = idle.on_message(_abort_msg("r"), 1.0)
    assert [(type(m.msg).__name__, m.msg.known) for m in out if isinstance(m, Send)] == [
        ("AbortAck", True)]
    assert [f.ok for f in out if isinstance(f, SendFinished)] == [False]
    busy = PrefillEndpoint(p_sender(), L)
    _meta_ready(busy)
    busy.layer_computed(0, ["r"], 0.0)
    assert not any(isinstance(e, Send) for e in busy.on_message(_abort_msg("r"), 1.0))
    out = busy.transfer_done("r", 0, True, "", 2.0)
    assert [type(m.msg).__name__ for m in out if isinstance(m, Send)] == ["AbortAck"]
    # A repeated Abort for the finished request: confirmed again, known, no tombstone.
    out = busy.on_message(_abort_msg("r"), 3.0)
    assert [(type(m.msg).__name__, m.msg.known) for m in out if isinstance(m, Send)] == [
        ("AbortAck", True)]
    assert not any(isinstance(e, ArmTimer) for e in out)


def test_re_asking_for_a_layout_spends_the_meta_budget() -> None:
    """A D that keeps accepting without a layout cannot keep P asking for ever."""
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(meta_retry_s=1.0, meta_attempts=3))
    out = p.add_request(PrefillRequest("r", D_ADDR, (1,), (5,)), 0.0)
    now = 0.0
    for _ in range(2):
        now += 0.25
        out += (step := p.on_message(MetaReply(PROTOCOL_VERSION, "r", "accepted", d_sender(),
                                               None), now))
        assert [e.at for e in step if isinstance(e, ArmTimer)] == [now + 1.0]
    assert len(_sent(out, MetaRequest)) == 3
    out = p.on_timer(("meta", "r"), now + 1.0)
    assert [f.ok for f in out if isinstance(f, SendFinished)] == [False]
    assert _sent(out, MetaRequest) == []


def test_each_layout_re_ask_costs_exactly_one_attempt() -> None:
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(meta_retry_s=1.0, meta_attempts=4))
    p.add_request(PrefillRequest("r", D_ADDR, (1,), (5,)), 0.0)
    for now in (0.25, 0.5):
        p.on_message(MetaReply(PROTOCOL_VERSION, "r", "accepted", d_sender(), None), now)
    out = p.on_timer(("meta", "r"), 1.5)  # 3 of 4 attempts spent: one more try
    assert len(_sent(out, MetaRequest)) == 1 and p.state_of("r") == "AWAIT_DECODER_META"
    out = p.on_timer(("meta", "r"), 2.5)
    assert [f.ok for f in out if isinstance(f, SendFinished)] == [False]


def test_in_doubt_memory_is_bounded_with_the_finished_memory() -> None:
    p = PrefillEndpoint(p_sender(), L, PrefillConfig(finished_memory=1))
    _meta_ready(p, "a")
    p.layer_computed(0, ["a"], 0.0)
    p.transfer_done("a", 0, False, "timeout", 0.0, in_doubt=True)
    assert p.snapshot()[4] == ("a",)
    p.add_request(PrefillRequest("b", (), (1,), (2,)), 1.0)  # finishes at once: "a" forgotten
    assert p.state_of("a") is None and p.snapshot()[4] == ()


def test_a_claim_for_other_blocks_is_refused_and_writes_nothing() -> None:
    """A prefill started with D block ids D did not register for the request (a forged or
    mistaken metaserver call) is refused at its claim: no layout, no write, and D's request
    still waits for an honest sender."""
    d = _d()
    d.add_request("r1", (5, 6), 1, 0.0)
    for blocks in ((6, 5), (5,), (5, 6, 7), (0, 1), ()):
        out = d.on_message(MetaRequest(PROTOCOL_VERSION, "r1", p_sender(), True, blocks), 0.0)
        [reply] = [e.msg for e in out if isinstance(e, Send)]
        assert reply.status == "refused" and reply.layout is None, blocks
        assert "receives into [5, 6]" in reply.reason
    assert d.state_of("r1") == "PREFILL_REQUESTED" and d.counters["refused"] == 5
    assert _claim(d, "r1", p_sender()) == "accepted"  # the honest one still gets in
    # End to end: P told other blocks fails its request and writes nothing.
    pair = Pair([PrefillEndpoint(p_sender(), L)], _d())
    pair.absorb("d", pair.d.add_request("r2", (5, 6), 1, 0.0))
    pair.absorb(0, pair.ps[0].add_request(PrefillRequest("r2", D_ADDR, (1, 2), (7, 8)), 0.0))
    pair.deliver_all()
    assert pair.ps[0].state_of("r2") == "FAILED"
    assert not effects_of_type(pair.ps[0].layer_computed(0, ["r2"], 0.0), WriteLayer)
    long = d.on_message(MetaRequest(PROTOCOL_VERSION, "r1", p_sender(1), True,
                                    tuple(range(10_000))), 0.0)
    assert len(long[0].msg.reason) < 200  # bounded, whatever the claim names
