"""D's data-plane fence (``fence_data``, issue 40): a lease that ends while a sender never
confirmed it stopped asks the driver to fence (FenceData) and frees or reuses the blocks only
once the fence holds; a failed fence keeps them and asks again."""

from __future__ import annotations

from lw.fsm import (
    DecodeConfig,
    DecodeEndpoint,
    FenceData,
    PrefillEndpoint,
    PrefillRequest,
    RecvFailed,
    ReleaseBlocks,
    Reprefill,
)
from lw.fsm.decode_ghosts import Ghosts, lease_key
from lw.fsm.effects import ArmTimer
from lw.fsm.lifecycles import FAILED, FENCING, PREFILL_REQUESTED
from lw.fsm.messages import Sender
from lw.fsm.timeline import Timeline
from tests.fsm.harness import D_ADDR, P_ADDR, Pair, d_layout, d_sender

L = 2
REMOTE = (5, 6)


def _pair(retry: int = 1, fence: bool = True) -> Pair:
    d = DecodeEndpoint(d_sender(), d_layout(L),
                       DecodeConfig(prefill_timeout_s=10.0, lease_s=30.0, retry_prefill=retry,
                                    fence_data=fence, fence_retry_s=2.0))
    ps = [PrefillEndpoint(Sender(f"P{i}", 0, 1, f"{P_ADDR}/{i}"), L) for i in range(2)]
    pair = Pair(ps, d)
    pair.absorb("d", d.add_request("r", REMOTE, 1, 0.0))
    p = ps[0]
    pair.absorb("d", d.prefill_routed("r", p.me.engine_id, p.me.addr, 0, pair.now))
    pair.absorb(0, p.add_request(PrefillRequest("r", D_ADDR, (1, 2), REMOTE), pair.now))
    pair.deliver_all()  # P0 claims; D accepts
    pair.absorb(0, p.layer_computed(0, ["r"], pair.now))  # a write in flight
    return pair


def _lose_p0(pair: Pair) -> None:
    """P0 dies with a write in flight: nobody answers D's abort, its bytes may still land."""
    pair.absorb("d", pair.d.peer_lost("P0", "heartbeats lost", 1.0))
    pair.queue.clear()
    pair.writes.clear()


def _of(pair: Pair, kind: type) -> list:
    return [e for e in pair.other if isinstance(e, kind)]


def test_a_fenced_epoch_goes_on_only_once_the_data_plane_fence_holds() -> None:
    pair = _pair()
    _lose_p0(pair)
    assert pair.d.state_of("r") == FENCING
    pair.advance(31.0)  # the lease ends: a fence, not yet the next epoch
    (fence,) = _of(pair, FenceData)
    assert (fence.req_id, fence.epoch) == ("r", 0)
    assert [s.engine_id for s in fence.senders] == ["P0"]
    assert not _of(pair, Reprefill) and pair.d.state_of("r") == FENCING
    (row,) = pair.d.status(31.0, "r")
    assert "the data-plane fence" in row.waiting_for and row.quarantined
    pair.absorb("d", pair.d.data_fenced("r", 0, True, "", 31.5))
    (rp,) = _of(pair, Reprefill)
    assert rp.epoch == 1 and rp.fenced and pair.d.state_of("r") == PREFILL_REQUESTED
    assert pair.d.counters["fences"] == 1 and pair.d.counters["leases_expired"] == 1
    # a second answer to the same fence changes nothing
    assert pair.d.data_fenced("r", 0, True, "", 32.0) == []
    assert pair.d.counters["stale_fences"] == 1


def test_a_failed_fence_keeps_the_blocks_and_is_asked_again() -> None:
    pair = _pair()
    _lose_p0(pair)
    pair.advance(31.0)
    out = pair.d.data_fenced("r", 0, False, "2 connection(s) still open after 5 s", 31.2)
    assert out == [ArmTimer(("lease", "r"), 33.2)]
    assert pair.d.counters["fence_failures"] == 1 and pair.d.state_of("r") == FENCING
    pair.absorb("d", out)
    pair.advance(33.2)
    assert len(_of(pair, FenceData)) == 2 and not _of(pair, Reprefill)
    pair.absorb("d", pair.d.data_fenced("r", 0, True, "", 33.5))
    assert len(_of(pair, Reprefill)) == 1


def test_a_failed_request_is_released_once_fenced() -> None:
    pair = _pair(retry=0)
    _lose_p0(pair)
    assert pair.d.state_of("r") == FAILED and "r" in pair.d.quarantined()
    pair.advance(31.0)
    assert _of(pair, FenceData) and not pair.recv
    assert "r" in pair.d.quarantined()
    pair.absorb("d", pair.d.data_fenced("r", 0, True, "", 31.1))
    (failed,) = pair.recv
    assert isinstance(failed, RecvFailed)
    assert failed.block_ids == REMOTE and "r" not in pair.d.quarantined()


def test_without_fence_data_the_lease_alone_decides() -> None:
    pair = _pair(retry=0, fence=False)
    _lose_p0(pair)
    pair.advance(31.0)
    assert not _of(pair, FenceData) and [type(e) for e in pair.recv] == [RecvFailed]


def test_a_ghost_is_released_once_fenced_and_fenced_again_after_a_failure() -> None:
    counters = dict.fromkeys(("stale_epoch", "leases_expired", "ghosts_released", "fences",
                              "fence_failures", "stale_fences"), 0)
    g = Ghosts(Sender("D", 0, 1, "tcp://d0"), 30.0, counters, Timeline(64), fence=True)
    p0 = Sender("P0", 0, 1, "tcp://p0/0")
    g.hold("r", 0, (5, 6), {("P0", 0): p0}, "lost", 1.0)
    (fence,) = g.on_timer(lease_key("r", 0), 31.0)
    assert fence == FenceData("r", 0, (p0,)) and g.blocks() == {("r", 0): (5, 6)}
    assert g.fenced("r", 0, False, "timed out", 31.5, 2.0) == [ArmTimer(lease_key("r", 0), 33.5)]
    assert g.blocks() == {("r", 0): (5, 6)}
    assert g.on_timer(lease_key("r", 0), 33.5) == [fence]
    (rel,) = g.fenced("r", 0, True, "", 34.0, 2.0)
    assert isinstance(rel, ReleaseBlocks) and rel.block_ids == (5, 6) and g.blocks() == {}
    assert counters["fences"] == 2 and counters["fence_failures"] == 1
