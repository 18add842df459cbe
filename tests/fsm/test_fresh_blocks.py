"""Prefill failover into fresh blocks (DecodeConfig.retry_fresh_blocks): when a sender of the
lost epoch may still write, D asks its driver for fresh blocks (FreshBlocks, answered at once
through on_fresh); granted, the old blocks and senders become a ghost of that epoch,
quarantined until every sender stopped or the lease passed, while the request goes on at once;
refused, D fences as without the setting (docs/protocol.md, "Prefill failover")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from lw.fsm import (
    DecodeConfig,
    DecodeEndpoint,
    Effect,
    FailureKind,
    FreshBlocks,
    Granted,
    PrefillEndpoint,
    PrefillRequest,
    ProtocolError,
    RecvDone,
    RecvFailed,
    ReleaseBlocks,
    Reprefill,
)
from lw.fsm.decode_ghosts import lease_key
from lw.fsm.lifecycles import FAILED, FENCING, PREFILL_REQUESTED
from lw.fsm.messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    Ack,
    DoneSending,
    FailedSending,
    Sender,
)
from tests.fsm.harness import D_ADDR, P_ADDR, Pair, d_layout, d_sender

L = 2
REMOTE = (5, 6)
FRESH = (7, 8)


@dataclass
class FreshPair(Pair):
    """The harness's pair whose driver answers D's FreshBlocks with ``grant``."""

    grant: Callable[[str, int], tuple[int, ...] | None] = lambda _r, _n: None
    asked: list[FreshBlocks] = field(default_factory=list)

    def absorb(self, who: int | str, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, FreshBlocks):
                self.asked.append(e)
                super().absorb("d", self.d.on_fresh(Granted(e, self.grant(e.req_id, e.count)),
                                                     self.now))
            else:
                super().absorb(who, [e])


def _p(engine: str, slot: int) -> PrefillEndpoint:
    return PrefillEndpoint(Sender(engine, 0, 1, f"{P_ADDR}/{slot}"), L)


def _pair(grants: list[tuple[int, ...] | None], retry: int = 1,
          fresh: bool = True) -> FreshPair:
    d = DecodeEndpoint(d_sender(), d_layout(L),
                       DecodeConfig(prefill_timeout_s=10.0, lease_s=30.0, retry_prefill=retry,
                                    retry_fresh_blocks=fresh))
    left = list(grants)
    pair = FreshPair([_p("P0", 0), _p("P1", 1), _p("P2", 2)], d,
                     grant=lambda _r, _n: left.pop(0))
    pair.absorb("d", d.add_request("r", REMOTE, 1, 0.0))
    return pair


def _start(pair: Pair, slot: int, blocks: tuple[int, ...], epoch: int = 0) -> None:
    p = pair.ps[slot]
    pair.absorb("d", pair.d.prefill_routed("r", p.me.engine_id, p.me.addr, epoch, pair.now))
    pair.absorb(slot, p.add_request(PrefillRequest("r", D_ADDR, (1, 2), blocks, epoch=epoch),
                                    pair.now))


def _claimed_with_write_in_flight(pair: FreshPair, slot: int = 0,
                                  blocks: tuple[int, ...] = REMOTE, epoch: int = 0) -> None:
    _start(pair, slot, blocks, epoch)
    pair.deliver_all()  # claim accepted
    pair.absorb(slot, pair.ps[slot].layer_computed(0, ["r"], pair.now))
    assert pair.writes


def _d_timers_only(pair: Pair) -> None:
    """The P ranks are dead: only D's timers fire from here on."""
    pair.timers = {k: at for k, at in pair.timers.items() if k[0] == "d"}


def _of(pair: Pair, kind: type) -> list:
    return [e for e in pair.other if isinstance(e, kind)]


def test_granted_the_request_goes_on_at_once_in_fresh_blocks_and_the_old_are_quarantined() -> None:
    pair = _pair([FRESH])
    _claimed_with_write_in_flight(pair)
    pair.now = 1.0
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", pair.now))
    assert [(a.req_id, a.epoch, a.count) for a in pair.asked] == [("r", 1, 2)]
    (rp,) = _of(pair, Reprefill)
    assert (rp.epoch, rp.block_ids, rp.fenced) == (1, FRESH, False)
    assert pair.d.state_of("r") == PREFILL_REQUESTED
    assert pair.d.ghosts() == {("r", 0): REMOTE}
    assert pair.timers[("d", lease_key("r", 0))] == 31.0  # the old epoch's lease
    assert pair.timers[("d", ("deadline", "r"))] == 11.0  # a full deadline for the new epoch
    aborts = [(s.msg.req_id, s.msg.epoch) for s in pair.queue if isinstance(s.msg, Abort)]
    assert aborts == [("r", 0)]
    # The new epoch claims the fresh blocks and completes, while the old write is in flight.
    old_writes, pair.writes = pair.writes, []
    _start(pair, 1, FRESH, epoch=1)
    pair.deliver_all()
    for layer in range(L):
        pair.absorb(1, pair.ps[1].layer_computed(layer, ["r"], pair.now))
    assert {w.remote_blocks for _r, w in pair.writes} == {FRESH}
    pair.complete_writes()
    pair.deliver_all()
    assert pair.recv == [RecvDone("r")]
    assert pair.d.ghosts() == {("r", 0): REMOTE}  # the request ended; its old blocks wait
    assert not _of(pair, ReleaseBlocks)
    # The old write lands; P0's answer to the abort says it stopped: the ghost is released.
    pair.writes = old_writes
    pair.complete_writes()
    pair.deliver_all()
    (rel,) = _of(pair, ReleaseBlocks)
    assert (rel.req_id, rel.epoch, rel.block_ids) == ("r", 0, REMOTE)
    assert pair.d.ghosts() == {} and ("d", lease_key("r", 0)) not in pair.timers
    assert pair.d.counters["fresh_blocks"] == 1 and pair.d.counters["ghosts_released"] == 1


def test_refused_the_epoch_is_fenced_as_without_the_setting() -> None:
    pair = _pair([None])
    _claimed_with_write_in_flight(pair)
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    assert len(pair.asked) == 1
    assert pair.d.state_of("r") == FENCING and not _of(pair, Reprefill)
    assert pair.d.ghosts() == {} and ("d", ("lease", "r")) in pair.timers
    assert ("d", ("deadline", "r")) not in pair.timers
    assert pair.d.counters["fresh_refused"] == 1


def test_without_the_setting_nothing_is_asked() -> None:
    pair = _pair([FRESH], fresh=False)
    _claimed_with_write_in_flight(pair)
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    assert not pair.asked and pair.d.state_of("r") == FENCING


def test_nothing_is_asked_when_no_old_sender_can_write() -> None:
    """An unclaimed epoch: the same blocks at once, as always (no ghost, no question)."""
    pair = _pair([FRESH])
    _start(pair, 0, REMOTE)
    pair.queue.clear()
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    (rp,) = _of(pair, Reprefill)
    assert not pair.asked and rp.block_ids == REMOTE


def test_a_dead_senders_ghost_is_released_by_its_lease() -> None:
    pair = _pair([FRESH])
    _claimed_with_write_in_flight(pair)
    pair.now = 1.0
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", pair.now))
    pair.queue.clear()  # P0 is dead: the abort is lost, no answer ever comes
    pair.writes.clear()
    pair.d.abort("r", "client went away", 2.0)  # the request itself ends meanwhile
    assert pair.d.ghosts() == {("r", 0): REMOTE}
    _d_timers_only(pair)
    pair.advance(30.9)
    assert not _of(pair, ReleaseBlocks)
    pair.advance(31.0)
    (rel,) = _of(pair, ReleaseBlocks)
    assert rel.block_ids == REMOTE and "lease expired" in rel.reason
    assert pair.d.counters["leases_expired"] == 1
    pair.advance(200.0)
    assert len(_of(pair, ReleaseBlocks)) == 1  # exactly once


def _old_sender(pair: Pair) -> Sender:
    return pair.ps[0].me


@pytest.mark.parametrize("msg, released", [
    (lambda s: DoneSending(PROTOCOL_VERSION, "r", s, 1, L, epoch=0), True),
    (lambda s: FailedSending(PROTOCOL_VERSION, "r", s, 1, "write failed", False, epoch=0), True),
    (lambda s: FailedSending(PROTOCOL_VERSION, "r", s, 1, "timed out", True, epoch=0), False),
    (lambda s: AbortAck(PROTOCOL_VERSION, "r", s, True, epoch=0), True),
    (lambda s: AbortAck(PROTOCOL_VERSION, "r", s, True, True, epoch=0), False),
])
def test_old_epoch_messages_reach_the_ghost(msg: Callable[[Sender], object],
                                            released: bool) -> None:
    """A DONE, a clean failure or a clean AbortAck of the old epoch says its sender stopped
    (released); in doubt it says nothing (the lease decides). DONE and failures are answered
    "not accepted"; the current epoch is untouched."""
    pair = _pair([FRESH])
    _claimed_with_write_in_flight(pair)
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    pair.queue.clear()
    m = msg(_old_sender(pair))
    out = pair.d.on_message(m, 2.0)  # type: ignore[arg-type]
    rels = [e for e in out if isinstance(e, ReleaseBlocks)]
    assert bool(rels) == released
    assert (pair.d.ghosts() == {}) == released
    acks = [e.msg for e in out if isinstance(getattr(e, "msg", None), Ack)]
    assert all(not a.accepted for a in acks)
    assert len(acks) == (0 if isinstance(m, AbortAck) else 1)
    assert pair.d.state_of("r") == PREFILL_REQUESTED and pair.d.record("r").epoch == 1


def test_a_second_loss_makes_a_second_ghost() -> None:
    pair = _pair([FRESH, (9, 10)], retry=2)
    _claimed_with_write_in_flight(pair)
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    pair.queue.clear()
    pair.writes.clear()
    _claimed_with_write_in_flight(pair, 1, FRESH, epoch=1)
    pair.absorb("d", pair.d.peer_lost("P1", "heartbeats lost", 2.0))
    rps = _of(pair, Reprefill)
    assert [(r.epoch, r.block_ids, r.avoid) for r in rps] == [
        (1, FRESH, ("P0",)), (2, (9, 10), ("P0", "P1"))]
    assert pair.d.ghosts() == {("r", 0): REMOTE, ("r", 1): FRESH}
    # Each ghost is released on its own: epoch 1's sender stops first.
    out = pair.d.on_message(AbortAck(PROTOCOL_VERSION, "r", pair.ps[1].me, True, epoch=1), 3.0)
    assert [(e.epoch, e.block_ids) for e in out if isinstance(e, ReleaseBlocks)] == [(1, FRESH)]
    assert pair.d.ghosts() == {("r", 0): REMOTE}
    # The request fails under epoch 2: its own (fresh) blocks go back with RecvFailed.
    pair.absorb("d", pair.d.abort("r", "client went away", 4.0))
    assert pair.recv == [RecvFailed("r", (9, 10), "aborted locally: client went away",
                                    FailureKind.ABORTED)]
    _d_timers_only(pair)
    pair.advance(31.0)
    assert [(e.epoch, e.block_ids) for e in _of(pair, ReleaseBlocks)] == [(0, REMOTE)]
    assert pair.d.ghosts() == {}


def test_the_snapshot_holds_the_ghosts() -> None:
    pair = _pair([FRESH])
    _claimed_with_write_in_flight(pair)
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    with_ghost = pair.d.snapshot()
    pair.d.on_message(AbortAck(PROTOCOL_VERSION, "r", _old_sender(pair), True, epoch=0), 2.0)
    assert pair.d.snapshot() != with_ghost


@pytest.mark.parametrize("grant, why", [
    ((7,), "not as many distinct blocks"),
    ((7, 7), "not as many distinct blocks"),
    ((6, 7), "held here already"),
])
def test_a_grant_of_blocks_held_here_is_a_protocol_error(grant: tuple[int, ...],
                                                         why: str) -> None:
    pair = _pair([grant])
    _claimed_with_write_in_flight(pair)
    with pytest.raises(ProtocolError, match=why):
        out = pair.d.peer_lost("P0", "heartbeats lost", 1.0)
        (ask,) = [e for e in out if isinstance(e, FreshBlocks)]
        pair.d.on_fresh(Granted(ask, grant), 1.0)


def test_an_answer_nobody_asked_for_is_a_protocol_error() -> None:
    pair = _pair([])
    with pytest.raises(ProtocolError, match="nobody asked"):
        pair.d.on_fresh(Granted(FreshBlocks("r", 1, 2), FRESH), 1.0)


def test_a_failed_request_keeps_nothing_of_a_ghost_in_its_own_release() -> None:
    """The request fails after the ghost: RecvFailed frees the fresh blocks, the ghost its
    own, each once (never the same block twice)."""
    pair = _pair([FRESH])
    _claimed_with_write_in_flight(pair)
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    pair.absorb("d", pair.d.on_timer(("deadline", "r"), 11.0))
    assert pair.d.state_of("r") == FAILED
    (failed,) = [e for e in pair.recv if isinstance(e, RecvFailed)]
    assert failed.block_ids == FRESH
    pair.writes.clear()
    pair.queue.clear()
    pair.absorb("d", pair.d.on_message(AbortAck(PROTOCOL_VERSION, "r", _old_sender(pair),
                                                 True, epoch=0), 12.0))
    assert [e.block_ids for e in _of(pair, ReleaseBlocks)] == [REMOTE]


# ---------------------------------------------------------------- the question and its answer
def _asked(pair: FreshPair) -> FreshBlocks:
    """P0, with a write in flight, is lost: D asks (nobody answers yet)."""
    _claimed_with_write_in_flight(pair)
    (ask,) = [e for e in pair.d.peer_lost("P0", "heartbeats lost", 1.0)
              if isinstance(e, FreshBlocks)]
    return ask


@pytest.mark.parametrize("grant", [FRESH, None])
def test_an_answer_ends_the_question(grant: tuple[int, ...] | None) -> None:
    """Granted or refused, the question is answered: no other answer is taken for it, not even
    one that would fit the request's next epoch."""
    pair = _pair([])
    ask = _asked(pair)
    pair.d.on_fresh(Granted(ask, grant), 1.0)
    later = FreshBlocks("r", pair.d.record("r").epoch + 1, 2)
    for again in (ask, later):
        with pytest.raises(ProtocolError, match="nobody asked"):
            pair.d.on_fresh(Granted(again, (9, 10)), 1.0)


def test_an_answer_for_another_epoch_or_request_is_refused_and_the_question_stays() -> None:
    pair = _pair([])
    ask = _asked(pair)
    with pytest.raises(ProtocolError, match="nobody asked") as err:
        pair.d.on_fresh(Granted(FreshBlocks("r", 2, 2), FRESH), 1.0)
    assert err.value.state == "RECEIVING"
    with pytest.raises(ProtocolError, match="nobody asked") as err:
        pair.d.on_fresh(Granted(FreshBlocks("other", 1, 2), FRESH), 1.0)
    assert err.value.state == "UNKNOWN"
    out = pair.d.on_fresh(Granted(ask, FRESH), 1.0)  # the right answer still goes through
    assert [r.block_ids for r in out if isinstance(r, Reprefill)] == [FRESH]


def test_a_grant_of_a_block_a_ghost_holds_is_a_protocol_error() -> None:
    """The lost epoch's blocks are the ghost's until released, not free for the next grant."""
    pair = _pair([FRESH, (REMOTE[0], 9)], retry=2)
    _claimed_with_write_in_flight(pair)
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    pair.queue.clear()
    pair.writes.clear()
    _claimed_with_write_in_flight(pair, 1, FRESH, epoch=1)
    with pytest.raises(ProtocolError, match=r"block\(s\) \[5\] \(1\) that are held here"):
        pair.absorb("d", pair.d.peer_lost("P1", "heartbeats lost", 2.0))


def test_the_timeline_shows_a_ghost_from_quarantine_to_release() -> None:
    """The milestones lw status and trace validation read (fresh, ghost, ghost_released)."""
    pair = _pair([FRESH])
    _claimed_with_write_in_flight(pair)
    pair.now = 1.0
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", pair.now))
    pair.d.on_message(AbortAck(PROTOCOL_VERSION, "r", _old_sender(pair), True, epoch=0), 2.0)
    seen = [(e[0], e[2], e[5]) for e in pair.d.timeline.of("r")
            if e[2] in ("fresh", "ghost", "ghost_released")]
    assert seen == [
        (1.0, "fresh", "epoch 0: 2 block(s) quarantined until 1 sender(s) stopped"),
        (2.0, "ghost", "epoch 0: AbortAck from P P0 rank 0, 0 sender(s) left"),
        (2.0, "ghost_released", "epoch 0: every sender stopped")]


def _reused_id(pair: FreshPair) -> None:
    """r's epoch 0 is a ghost (P0 dead), r ends DONE under epoch 1, and D is given a new
    request under the same id: its epoch 0 is live while the old epoch 0's ghost is held."""
    _claimed_with_write_in_flight(pair)
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    pair.queue.clear()
    pair.writes.clear()
    _start(pair, 1, FRESH, epoch=1)
    pair.deliver_all()
    for layer in range(L):
        pair.absorb(1, pair.ps[1].layer_computed(layer, ["r"], pair.now))
    pair.complete_writes()
    pair.deliver_all()
    assert pair.recv == [RecvDone("r")] and pair.d.ghosts() == {("r", 0): REMOTE}
    pair.recv.clear()
    pair.absorb("d", pair.d.add_request("r", (9, 10), 1, pair.now))
    _start(pair, 2, (9, 10))
    pair.deliver_all()


def test_a_new_request_under_the_id_of_a_ghost_gets_its_own_epochs_messages() -> None:
    pair = _pair([FRESH])
    _reused_id(pair)
    for layer in range(L):
        pair.absorb(2, pair.ps[2].layer_computed(layer, ["r"], pair.now))
    pair.complete_writes()
    pair.deliver_all()
    assert pair.recv == [RecvDone("r")]
    assert pair.d.ghosts() == {("r", 0): REMOTE} and pair.d.counters["stale_epoch"] == 0


def test_a_new_request_under_the_id_of_a_ghost_fences_its_epoch_instead() -> None:
    """Its epoch 0 lost with a write in flight: a ghost of (r, 0) is held already, so D fences
    (asks for no fresh blocks) rather than hold a second ghost under the same key."""
    pair = _pair([FRESH, (11, 12)], retry=2)
    _reused_id(pair)
    pair.absorb(2, pair.ps[2].layer_computed(0, ["r"], pair.now))
    pair.absorb("d", pair.d.peer_lost("P2", "heartbeats lost", 3.0))
    assert len(pair.asked) == 1 and pair.d.state_of("r") == FENCING
    assert pair.d.ghosts() == {("r", 0): REMOTE}
