"""Prefill failover in the core: D re-prefills a request whose P was lost under a new claim
epoch, into the same blocks only once nothing of the old epoch can land (docs/protocol.md,
"Prefill failover")."""

from __future__ import annotations

import pytest

from lw.fsm import (
    DecodeConfig,
    DecodeEndpoint,
    PrefillEndpoint,
    PrefillRequest,
    Quarantine,
    RecvDone,
    RecvFailed,
    Reprefill,
    Send,
)
from lw.fsm.lifecycles import FENCING, PREFILL_REQUESTED
from lw.fsm.messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    Ack,
    DoneSending,
    FailedSending,
    MetaReply,
    Sender,
)
from tests.fsm.harness import D_ADDR, P_ADDR, Pair, d_layout, d_sender

L = 2
REMOTE = (5, 6)


def _p(engine: str, slot: int) -> PrefillEndpoint:
    """P engine ``engine`` (one rank) listening at the harness's address ``slot``."""
    return PrefillEndpoint(Sender(engine, 0, 1, f"{P_ADDR}/{slot}"), L)


def _pair(retry: int = 1, avoid: str = "lost") -> Pair:
    d = DecodeEndpoint(d_sender(), d_layout(L),
                       DecodeConfig(prefill_timeout_s=10.0, lease_s=30.0, retry_prefill=retry,
                                    retry_prefill_avoid=avoid))
    pair = Pair([_p("P0", 0), _p("P1", 1)], d)
    pair.absorb("d", d.add_request("r", REMOTE, 1, 0.0))
    return pair


def _start(pair: Pair, slot: int, epoch: int = 0) -> None:
    """The driver sends epoch ``epoch``'s prefill to P ``slot`` and tells D where it went."""
    p = pair.ps[slot]
    pair.absorb("d", pair.d.prefill_routed("r", p.me.engine_id, p.me.addr, epoch, pair.now))
    pair.absorb(slot, p.add_request(PrefillRequest("r", D_ADDR, (1, 2), REMOTE, epoch=epoch),
                                    pair.now))


def _compute(pair: Pair, slot: int) -> None:
    for layer in range(L):
        pair.absorb(slot, pair.ps[slot].layer_computed(layer, ["r"], pair.now))


def _reprefills(pair: Pair) -> list[Reprefill]:
    return [e for e in pair.other if isinstance(e, Reprefill)]


def test_an_orphan_of_a_lost_p_is_prefilled_again_at_once_and_completes() -> None:
    """The P the prefill went to never claimed it: heartbeats watch it (awaited_peers), its
    loss starts epoch 1 at once into the same blocks (no byte of epoch 0 can exist), the new
    P completes it, and the old P, alive after all, is refused when its claim comes late."""
    pair = _pair()
    p0 = pair.ps[0]
    _start(pair, 0)  # its claim is lost with it: nothing delivered
    pair.queue.clear()
    assert pair.d.awaited_peers() == {p0.me.addr: "P0"}
    pair.now = 1.0
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", pair.now))
    (rp,) = _reprefills(pair)
    assert (rp.epoch, rp.block_ids, rp.avoid, rp.fenced) == (1, REMOTE, ("P0",), False)
    assert pair.d.state_of("r") == PREFILL_REQUESTED
    assert pair.timers[("d", ("deadline", "r"))] == 11.0  # a full deadline for the new epoch
    assert not any(isinstance(e, Quarantine) for e in pair.other)
    _start(pair, 1, epoch=1)
    pair.deliver_all()
    _compute(pair, 1)
    pair.complete_writes()
    pair.deliver_all()
    assert pair.recv == [RecvDone("r")]
    # The old P's claim of epoch 0 arrives now (it was only partitioned): refused, no write.
    pair.absorb(0, p0.on_timer(("meta", "r"), pair.now))  # its claim, sent again
    pair.deliver_all()
    _compute(pair, 0)
    assert not pair.writes and p0.state_of("r") == "FAILED"


def test_a_claimed_epoch_is_fenced_until_its_sender_stops() -> None:
    """P claimed and has a write in flight when it is lost: D cannot refuse its bytes, so it
    aborts it (epoch 0) and asks for no new prefill until it confirmed it stopped."""
    pair = _pair()
    _start(pair, 0)
    pair.deliver_all()  # claim accepted
    pair.absorb(0, pair.ps[0].layer_computed(0, ["r"], pair.now))
    assert pair.writes  # in flight
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    assert pair.d.state_of("r") == FENCING
    assert not _reprefills(pair)
    aborts = [s.msg for s in pair.queue if isinstance(s.msg, Abort)]
    assert [(a.req_id, a.epoch) for a in aborts] == [("r", 0)]
    assert ("d", ("lease", "r")) in pair.timers
    pair.complete_writes()  # the write lands: P's abort answer waits for nothing more
    pair.deliver_all()
    (rp,) = _reprefills(pair)
    assert rp.epoch == 1 and ("d", ("lease", "r")) not in pair.timers


def test_a_fenced_epoch_whose_sender_is_dead_waits_for_the_lease() -> None:
    pair = _pair()
    _start(pair, 0)
    pair.deliver_all()
    pair.absorb(0, pair.ps[0].layer_computed(0, ["r"], pair.now))
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    pair.queue.clear()  # P is dead: nobody answers the abort
    pair.writes.clear()
    pair.advance(30.5)
    assert not _reprefills(pair)
    pair.advance(31.0)
    (rp,) = _reprefills(pair)
    assert rp.epoch == 1 and rp.fenced and pair.d.state_of("r") == PREFILL_REQUESTED


def test_messages_of_an_old_epoch_never_count() -> None:
    """After the retry, epoch 0's DONE is refused (Ack not accepted), its claim is refused,
    and its AbortAck is dropped: only epoch 1's sender completes the request."""
    pair = _pair()
    d = pair.d
    pair.absorb("d", d.prefill_routed("r", "P0", f"{P_ADDR}/0", 0, 0.0))
    pair.absorb("d", d.peer_lost("P0", "lost", 0.0))  # orphan: epoch 1 at once
    old = Sender("P0", 0, 1, f"{P_ADDR}/0")
    out = d.on_message(DoneSending(PROTOCOL_VERSION, "r", old, 1, L, num_blocks=2), 1.0)
    assert [(type(s.msg), s.msg.accepted) for s in out if isinstance(s, Send)
            and isinstance(s.msg, Ack)] == [(Ack, False)]
    assert d.on_message(AbortAck(PROTOCOL_VERSION, "r", old, True), 1.0) == []
    assert d.counters["stale_epoch"] == 2
    assert d.state_of("r") == PREFILL_REQUESTED and not pair.recv


def test_a_budget_of_two_retries_twice_and_each_retry_says_why() -> None:
    """Each loss spends one retry (two losses, two new epochs, the third fails), the retry
    carries the loss's reason, the new epoch watches no P until it is routed, and the old
    epoch's deadline is cancelled when the request is fenced."""
    pair = _pair(retry=2)
    _start(pair, 0)
    pair.absorb("d", pair.d.peer_lost("P0", "P0 went silent", 0.0))
    (rp,) = _reprefills(pair)
    assert rp.epoch == 1 and "P0 went silent" in rp.reason
    assert pair.d.awaited_peers() == {}  # epoch 1 not routed yet: the lost P is not watched
    _start(pair, 1, epoch=1)
    pair.deliver_all()  # P1 claims epoch 1
    pair.absorb(1, pair.ps[1].layer_computed(0, ["r"], pair.now))  # a write in flight
    pair.other.clear()
    pair.absorb("d", pair.d.peer_lost("P1", "P1 went silent", 1.0))
    assert pair.d.state_of("r") == FENCING
    assert ("d", ("deadline", "r")) not in pair.timers  # the lease decides now
    pair.complete_writes()
    pair.deliver_all()  # P1 confirms it stopped: epoch 2 at once
    assert [r.epoch for r in _reprefills(pair)] == [2]
    pair.absorb("d", pair.d.prefill_routed("r", "P0", pair.ps[0].me.addr, 2, 2.0))
    pair.absorb("d", pair.d.peer_lost("P0", "again", 2.0))
    assert pair.d.state_of("r") != PREFILL_REQUESTED and len(_reprefills(pair)) == 1


def test_a_message_of_another_epoch_is_in_the_timeline() -> None:
    pair = _pair()
    d = pair.d
    pair.absorb("d", d.prefill_routed("r", "P0", f"{P_ADDR}/0", 0, 0.0))
    pair.absorb("d", d.peer_lost("P0", "lost", 0.0))
    old = Sender("P0", 0, 1, f"{P_ADDR}/0")
    d.on_message(DoneSending(PROTOCOL_VERSION, "r", old, 1, L, num_blocks=2), 1.0)
    assert [e[2] for e in d.timeline.ring if e[1] == "r"][-1] == "stale_epoch"


def test_the_budget_bounds_the_retries_then_the_old_failure_path() -> None:
    pair = _pair(retry=1)
    _start(pair, 0)
    pair.absorb("d", pair.d.peer_lost("P0", "lost", 0.0))
    _start(pair, 1, epoch=1)
    pair.absorb("d", pair.d.peer_lost("P1", "lost too", 1.0))
    assert len(_reprefills(pair)) == 1
    assert [type(e) for e in pair.recv] == [RecvFailed]
    assert "P1 lost" in pair.recv[0].reason


def test_only_a_live_request_with_a_route_has_its_p_watched() -> None:
    """Before the driver says where the prefill went there is no P to watch; once the request
    has ended, its route is no one's concern either."""
    pair = _pair()
    assert pair.d.awaited_peers() == {}  # allocated, not routed yet
    _start(pair, 0)
    assert pair.d.awaited_peers() == {pair.ps[0].me.addr: "P0"}
    pair.absorb("d", pair.d.abort("r", "client went away", 0.5))
    assert pair.d.awaited_peers() == {}


def test_without_a_budget_a_lost_p_fails_the_request_as_before() -> None:
    """A claimed request fails at its P's loss; an unclaimed one is not watched (its deadline
    decides, as before: a partition that heals in time lets its P finish it)."""
    pair = _pair(retry=0)
    _start(pair, 0)
    assert pair.d.awaited_peers() == {}
    pair.absorb("d", pair.d.peer_lost("P0", "lost", 0.0))
    assert not pair.recv and pair.d.state_of("r") == PREFILL_REQUESTED
    pair.deliver_all()  # P0 claims it
    pair.absorb("d", pair.d.peer_lost("P0", "lost", 0.0))
    assert not _reprefills(pair) and pair.d.state_of("r") == "FAILED"
    assert [type(e) for e in pair.other] == [Quarantine]  # its bytes may land: the lease


def test_a_failure_report_of_the_sender_is_retried_elsewhere() -> None:
    """P's FailedSending (it stopped, nothing in doubt) starts the next epoch at once."""
    pair = _pair()
    _start(pair, 0)
    pair.deliver_all()
    pair.absorb(0, pair.ps[0].abort("r", "client went away", pair.now))
    pair.deliver_all()
    (rp,) = _reprefills(pair)
    assert rp.epoch == 1 and rp.avoid == ("P0",)


def test_avoid_none_lets_the_router_pick_any_p() -> None:
    pair = _pair(avoid="none")
    pair.absorb("d", pair.d.peer_lost("P0", "lost", 0.0))  # routed nowhere: not affected
    assert not _reprefills(pair)
    _start(pair, 0)
    pair.absorb("d", pair.d.peer_lost("P0", "lost", 0.0))
    assert _reprefills(pair)[0].avoid == ()


def test_an_old_epoch_reply_carries_its_epoch() -> None:
    pair = _pair()
    pair.absorb("d", pair.d.prefill_routed("r", "P0", f"{P_ADDR}/0", 0, 0.0))
    pair.absorb("d", pair.d.peer_lost("P0", "lost", 0.0))
    _start(pair, 0)  # a P started with epoch 0 (a stale proxy): refused, with the epoch
    claim = pair.queue[0].msg
    (reply,) = [s.msg for s in pair.d.on_message(claim, 0.0)]
    assert isinstance(reply, MetaReply) and (reply.status, reply.epoch) == ("refused", 0)


@pytest.mark.parametrize("bad", [{"retry_prefill": -1}, {"retry_prefill_avoid": "dead"}])
def test_failover_settings_are_checked(bad: dict) -> None:
    with pytest.raises(ValueError, match="retry_prefill"):
        DecodeConfig(**bad)


def test_p_ignores_a_reply_to_another_epochs_claim() -> None:
    """A P worker prefilling epoch 1 gets D's answer to an epoch-0 claim: not about its own
    claim (it neither writes nor fails on it); an acceptance is answered with a failure of
    that epoch, so D never waits for a sender of it."""
    p = _p("P0", 0)
    p.add_request(PrefillRequest("r", D_ADDR, (1, 2), REMOTE, epoch=1), 0.0)
    for status in ("refused", "accepted"):
        reply = MetaReply(PROTOCOL_VERSION, "r", status, d_sender(), d_layout(L), "", 0)
        out = p.on_message(reply, 0.0)
        assert p.state_of("r") == "AWAIT_DECODER_META"
        sent = [s.msg for s in out if isinstance(s, Send)]
        assert [(type(m).__name__, m.epoch) for m in sent] == (
            [("FailedSending", 0)] if status == "accepted" else [])


def test_a_failure_report_of_an_old_epoch_is_answered_not_accepted() -> None:
    """P0 never claimed; D moved to epoch 1 when it lost P0; P0's late FailedSending of epoch 0
    is answered (so P0 stops retrying it) and changes nothing."""
    pair = _pair()
    _start(pair, 0)
    pair.queue.clear()  # P0's claim is lost
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    msg = FailedSending(PROTOCOL_VERSION, "r", pair.ps[0].me, 1, "gave up", epoch=0)
    out = pair.d.on_message(msg, 1.5)
    assert [(s.dest, s.msg.of, s.msg.accepted) for s in out if isinstance(s, Send)] == [
        (pair.ps[0].me.addr, "failed", False)]
    assert pair.d.state_of("r") == PREFILL_REQUESTED and len(_reprefills(pair)) == 1


def test_a_fenced_senders_clean_failure_ends_the_fence_at_once() -> None:
    """D fenced epoch 0 (its sender had claimed); the sender's FailedSending, not in doubt, says
    nothing more of it can land: the retry starts at once, not after the lease."""
    pair = _pair()
    _start(pair, 0)
    pair.deliver_all()  # claimed
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    assert pair.d.state_of("r") == FENCING and not _reprefills(pair)
    msg = FailedSending(PROTOCOL_VERSION, "r", pair.ps[0].me, 1, "write failed", epoch=0)
    out = pair.d.on_message(msg, 1.5)
    assert [(s.msg.of, s.msg.accepted) for s in out if isinstance(s, Send)] == [
        ("failed", False)]
    assert [e.epoch for e in out if isinstance(e, Reprefill)] == [1]


def test_the_retry_budget_is_at_most_64() -> None:
    assert DecodeConfig(retry_prefill=64).retry_prefill == 64
    with pytest.raises(ValueError, match="0..64"):
        DecodeConfig(retry_prefill=65)


def test_a_reprefill_is_not_fenced_unless_said() -> None:
    assert Reprefill("r", 1, (1,), (), "lost").fenced is False


def test_a_write_is_numbered_by_its_layer_unless_given_a_number() -> None:
    """WriteLayer's defaults: seq is the layer (one chunk) unless the core gives one (0
    included), no checksum is kept, and no deadline bounds it."""
    from lw.fsm import WriteLayer

    lay = d_layout(L)
    w = WriteLayer("r", 1, lay, (1,), (5,))
    assert (w.seq, w.checksum, w.not_after) == (1, False, float("inf"))
    assert WriteLayer("r", 1, lay, (1,), (5,), seq=0).seq == 0
