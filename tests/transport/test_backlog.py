"""A link-bound push wakes P's threads less: the Mooncake sender sleeps in step with what its
link still has to drain, and layer events wait for company while that backlog lasts (each
wake-up on the forward's core is a preemption of the forward: benchmarks/push_cpu.py)."""

from __future__ import annotations

import pytest

from lw.transport.dataplane.base import _Peer, _QueuedDataPlane
from lw.transport.dataplane.window import MAX_DRAIN_NAP_S, ByteWindow
from lw.transport.inbox import MAX_BACKLOG_BATCH_S, Inbox
from lw.transport.loopconfig import LoopConfig


def _window(inflight: int, rate: float) -> ByteWindow:
    w = ByteWindow(10.0)
    w.inflight, w.rate = inflight, rate
    return w


def test_the_nap_is_unchanged_while_the_rate_or_the_bytes_in_flight_are_unknown() -> None:
    """No rate measured yet, or nothing in flight: the sender's own nap, as before."""
    assert _window(8 << 20, 0.0).nap(0.002) == 0.002
    assert _window(0, 50e6).nap(0.002) == 0.002
    assert _window(8 << 20, 0.0).backlog_s() == 0.0


def test_the_nap_is_a_quarter_of_the_drain_time_up_to_its_cap() -> None:
    """8 MB in flight at 50 MB/s drain in 160 ms: the sender sleeps the cap (20 ms), not 2 ms;
    400 kB drain in 8 ms: it sleeps 2 ms; 100 kB (the tail): its own nap, so the last entry is
    still seen within that."""
    assert _window(8_000_000, 50e6).backlog_s() == pytest.approx(0.16)
    assert _window(8_000_000, 50e6).nap(0.002) == MAX_DRAIN_NAP_S
    assert _window(400_000, 50e6).nap(0.0005) == pytest.approx(0.002)
    assert _window(100_000, 50e6).nap(0.0005) == 0.0005


def test_a_fast_link_keeps_the_short_nap() -> None:
    """On loopback (a GB/s) 8 MB drain in 8 ms: a 2 ms nap is what it was."""
    assert _window(8_000_000, 1e9).nap(0.002) == pytest.approx(0.002)


class _Plane(_QueuedDataPlane):
    """Only the peers' bookkeeping of the base class (no thread is started)."""


def test_the_planes_backlog_is_its_slowest_peers_and_zero_without_peers() -> None:
    plane = _Plane(max_batch_entries=4, join_timeout_s=1.0)
    assert plane.backlog_s() == 0.0
    for session, backlog in (("a:1", 0.03), ("b:2", 0.2)):
        peer = _Peer(session)
        peer.backlog_s = backlog
        plane._peers[session] = peer
    assert plane.backlog_s() == 0.2


def _inbox(backlog: list[float]) -> Inbox:
    counters: dict[str, int | float] = {"inbox_overflow": 0}
    return Inbox(LoopConfig(layer_batch_s=0.015, hot_poll_s=0), 32, counters,
                 lambda: backlog[0])


def test_layer_events_wait_for_company_while_the_link_drains_a_backlog(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers 25 ms apart: with no backlog each wakes the loop (past the 15 ms batch); with
    the link 120 ms behind, one in three (a 60 ms batch), and the last layer at once."""
    import lw.transport.inbox as inbox_mod

    clock = [100.0]
    monkeypatch.setattr(inbox_mod.time, "monotonic", lambda: clock[0])

    def run(backlog_s: float) -> list[int]:
        inbox = _inbox([backlog_s])
        woke = []
        for layer in range(32):
            clock[0] += 0.025
            inbox.layer(layer, ["r"])
            if inbox.wake_pending:
                woke.append(layer)
                inbox.turn_started({inbox.pipe.fd})
        return woke

    assert run(0.0) == list(range(32))
    behind = run(0.12)
    assert behind[:3] == [0, 3, 6] and behind[-1] == 31 and len(behind) == 12


def test_a_backlog_never_holds_a_layer_longer_than_the_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A link minutes behind holds a layer event at most MAX_BACKLOG_BATCH_S."""
    import lw.transport.inbox as inbox_mod

    clock = [0.0]
    monkeypatch.setattr(inbox_mod.time, "monotonic", lambda: clock[0])
    inbox = _inbox([300.0])
    woke = []
    for layer in range(31):
        clock[0] += 0.01
        inbox.layer(layer, ["r"])
        if inbox.wake_pending:
            woke.append(round(clock[0], 3))
            inbox.turn_started({inbox.pipe.fd})
    gaps = [b - a for a, b in zip(woke, woke[1:], strict=False)]
    assert gaps and max(gaps) <= MAX_BACKLOG_BATCH_S + 0.01 + 1e-9
