"""Tests written to kill the survivors of ``tools/mutation.py`` (mutation testing of lw/fsm).

Each test states a piece of the protocol's intent that no earlier test or check pinned down;
the mutants it kills are listed in docs/checker.md ("Mutation testing").
"""

from __future__ import annotations

import msgspec
import pytest

from lw.fsm import (
    DecodeConfig,
    DecodeEndpoint,
    PrefillConfig,
    PrefillEndpoint,
    PrefillRequest,
    ProtocolError,
    Send,
    SendFinished,
    check_lease,
)
from lw.fsm.messages import PROTOCOL_VERSION, Abort, FailedSending, MetaReply, MetaRequest
from lw.transport.wire import decode, encode

from .harness import D_ADDR, Pair, d_layout, d_sender, p_sender

L = 2

# ------------------------------------------------------------------------------ configuration
DURATIONS = [(DecodeConfig, "prefill_timeout_s"), (DecodeConfig, "lease_s"),
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
    status = {rid: d.on_message(MetaRequest(PROTOCOL_VERSION, rid, p_sender(), True), 0.0)[0]
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
    late = MetaRequest(PROTOCOL_VERSION, "r1", p_sender(1), True)
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
