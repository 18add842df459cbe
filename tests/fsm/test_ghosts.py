"""The ghosts part of D (lw.fsm.decode_ghosts) on its own: what it holds, the events it takes
and the effects it returns, its timer key, and the check of granted blocks."""

from __future__ import annotations

import pytest

from lw.fsm.decode_ghosts import GHOST_LEASE, Ghosts, grant_problem, lease_key
from lw.fsm.effects import ArmTimer, CancelTimer, EpochTimer, ReleaseBlocks, Send, timer_name
from lw.fsm.messages import PROTOCOL_VERSION, Abort, AbortAck, Ack, DoneSending, Sender
from lw.fsm.timeline import Timeline

D = Sender("D", 0, 1, "tcp://d0")
P0, P1 = Sender("P0", 0, 1, "tcp://p0/0"), Sender("P1", 0, 1, "tcp://p1/0")


def _ghosts() -> Ghosts:
    counters = dict.fromkeys(("stale_epoch", "leases_expired", "ghosts_released"), 0)
    return Ghosts(D, 30.0, counters, Timeline(64))


def _held(g: Ghosts, *senders: Sender) -> list:
    return g.hold("r", 0, (5, 6), {(s.engine_id, s.rank): s for s in senders}, "lost", 1.0)


def _stopped(sender: Sender, in_doubt: bool = False) -> AbortAck:
    return AbortAck(PROTOCOL_VERSION, "r", sender, True, in_doubt, epoch=0)


def test_the_lease_key_carries_the_epoch_as_a_number() -> None:
    key = lease_key("r", 3)
    assert isinstance(key, EpochTimer) and key == (GHOST_LEASE, "r", 3) and key.epoch == 3
    assert timer_name(key) == "ghost:3(r)"  # the text the checker's traces always showed
    assert timer_name(("deadline", "r")) == "deadline(r)"
    assert sorted([key, ("deadline", "r")]) == [("deadline", "r"), key]  # sorts with the rest


def test_hold_aborts_the_senders_and_arms_the_lease() -> None:
    g = _ghosts()
    out = _held(g, P0, P1)
    assert [(e.dest, type(e.msg), e.msg.epoch) for e in out if isinstance(e, Send)] == [
        (P0.addr, Abort, 0), (P1.addr, Abort, 0)]
    assert out[-1] == ArmTimer(("ghost", "r", 0), 31.0)
    assert g.blocks() == {("r", 0): (5, 6)} and g.held_blocks() == {5, 6}


def test_each_sender_counts_once_and_the_last_one_releases() -> None:
    """A sender's second answer changes nothing (it stopped already); the ghost goes when the
    last pending sender stopped, its lease cancelled."""
    g = _ghosts()
    _held(g, P0, P1)
    assert g.take(_stopped(P0), None, 2.0) == []
    assert g.take(_stopped(P0), None, 2.5) == []
    assert g.blocks() == {("r", 0): (5, 6)}
    out = g.take(_stopped(P1), None, 3.0)
    assert out is not None and out[0] == CancelTimer(lease_key("r", 0))
    (rel,) = [e for e in out if isinstance(e, ReleaseBlocks)]
    assert (rel.req_id, rel.epoch, rel.block_ids) == ("r", 0, (5, 6))
    assert rel.reason == "claim epoch 0 abandoned (every sender stopped): lost"
    assert g.blocks() == {} and g.counters == {"stale_epoch": 3, "leases_expired": 0,
                                               "ghosts_released": 1}


def test_an_in_doubt_answer_leaves_the_blocks_to_the_lease() -> None:
    g = _ghosts()
    _held(g, P0)
    assert g.take(_stopped(P0, in_doubt=True), None, 2.0) == []
    assert g.blocks() == {("r", 0): (5, 6)}
    assert g.on_timer(lease_key("r", 0), 31.0) == [
        ReleaseBlocks("r", 0, (5, 6), "claim epoch 0 abandoned (lease expired): lost")]
    assert g.blocks() == {} and g.counters["leases_expired"] == 1
    assert g.on_timer(lease_key("r", 0), 32.0) == []  # released already: nothing, counted once
    assert g.counters["leases_expired"] == 1 and g.counters["ghosts_released"] == 1


def test_messages_that_are_not_the_ghosts_go_back_to_the_endpoint() -> None:
    """Another epoch, or the epoch a live request of that id is in now: None."""
    g = _ghosts()
    _held(g, P0)
    done = DoneSending(PROTOCOL_VERSION, "r", P0, 1, 2, epoch=0)
    assert g.take(AbortAck(PROTOCOL_VERSION, "r", P0, True, epoch=1), None, 2.0) is None
    assert g.take(done, 0, 2.0) is None
    assert g.counters["stale_epoch"] == 0
    out = g.take(done, 1, 2.0)
    assert out is not None and isinstance(out[0].msg, Ack) and not out[0].msg.accepted


def test_a_timer_of_another_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown timer kind 'lease'"):
        _ghosts().on_timer(EpochTimer("lease", "r", 0), 1.0)


def test_release_cancels_the_lease() -> None:
    g = _ghosts()
    _held(g, P0)
    out = g.release("r", 0, "released at once", 2.0)
    assert out[0] == CancelTimer(lease_key("r", 0)) and isinstance(out[1], ReleaseBlocks)
    assert g.blocks() == {}


@pytest.mark.parametrize("blocks, problem", [
    ((7, 8), ""),
    ((7,), "granted [7] (1) for 2 block(s): not as many distinct blocks as asked"),
    ((7, 7), "granted [7, 7] (2) for 2 block(s): not as many distinct blocks as asked"),
    ((6, 7), "granted block(s) [6] (1) that are held here already"),
])
def test_grant_problem(blocks: tuple[int, ...], problem: str) -> None:
    assert grant_problem(blocks, 2, {5, 6}) == problem
