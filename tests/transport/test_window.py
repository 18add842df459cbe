"""The byte window keeps no more in flight to a peer than its link moves in a fraction of the
transfer timeout: a transfer's time then measures its own bytes, not a queue ahead of it."""

from __future__ import annotations

import pytest

from lw.transport.dataplane.window import ByteWindow

MiB = 1 << 20


def test_one_entry_may_always_go_however_large() -> None:
    w = ByteWindow(5.0, initial=MiB, floor=MiB)
    assert w.room(64 * MiB)
    w.sent(64 * MiB, 0.0)
    assert not w.room(1)


def test_on_a_slow_link_the_limit_falls_to_what_it_moves_in_a_quarter_timeout() -> None:
    w = ByteWindow(5.0)  # 8 MiB until measured
    t = 0.0
    w.sent(8 * MiB, t)
    for _ in range(40):  # 3 MB/s: 64 KiB lands every ~22 ms
        t += 65536 / 3e6
        w.resolved(65536, t)
    assert w.rate == pytest.approx(3e6, rel=0.05)
    assert w.limit == pytest.approx(3e6 * 5.0 * 0.25, rel=0.05)  # 3.75 MB, not 8 MiB


def test_on_a_fast_link_the_limit_opens_and_never_falls_under_the_floor() -> None:
    w = ByteWindow(5.0)
    w.sent(8 * MiB, 0.0)
    w.resolved(8 * MiB, 0.06)  # ~140 MB/s
    assert w.limit > 100 * MiB
    slow = ByteWindow(5.0, floor=MiB)
    slow.sent(65536, 0.0)
    slow.resolved(1024, 10.0)  # ~100 B/s
    assert slow.limit == MiB


def test_timed_out_bytes_leave_flight_without_being_a_rate_sample() -> None:
    w = ByteWindow(5.0)
    w.sent(4 * MiB, 0.0)
    w.dropped(4 * MiB)
    assert w.inflight == 0 and w.rate == 0.0 and w.limit == 8 * MiB


def _busy(w: ByteWindow, rate: float, rtt: float, entry: int = 65536, n: int = 40) -> None:
    """Entries of ``entry`` bytes landing at ``rate``, the first ``rtt`` after an idle link."""
    t = 0.0
    w.sent(entry * n, t)
    t += rtt
    for _ in range(n):
        t += entry / rate
        w.resolved(entry, t)


def test_a_span_keeps_in_flight_what_the_link_moves_in_that_long_behind_a_backlog() -> None:
    """50 MB/s and a 10 ms span: with 100 ms of bytes to carry, 500 kB go in flight, not the
    quarter timeout's 62.5 MB; with less than the 30 ms threshold the span does not bind."""
    w = ByteWindow(5.0, span_s=0.010, span_after_s=0.030)
    _busy(w, 50e6, rtt=0.0005)
    assert w.span_limit == pytest.approx(50e6 * 0.010, rel=0.1)
    w.inflight, w.queued = 300_000, 4_700_000  # 100 ms of link in all
    assert w.room(100_000) and not w.room(300_000)
    w.queued = 600_000  # 20 ms in all: below the threshold
    assert w.room(5_000_000)
    slow = ByteWindow(5.0, span_s=0.010, span_floor=256 << 10)
    _busy(slow, 1e6, rtt=0.0005)
    assert slow.span_limit == 256 << 10
    plain = ByteWindow(5.0)  # no span unless asked
    _busy(plain, 50e6, rtt=0.0005)
    plain.inflight, plain.queued = 400_000, 50_000_000
    assert plain.span_limit == 0 and plain.room(5_000_000)


def test_sent_bytes_leave_the_queue() -> None:
    w = ByteWindow(5.0)
    w.queued = 1000
    w.sent(600, 0.0)
    assert (w.inflight, w.queued) == (600, 400)
    w.sent(600, 0.0)
    assert w.queued == 0


def test_a_long_round_trip_widens_the_span_to_twice_it() -> None:
    """A 200 ms route at 20 MB/s: a 10 ms window would idle the link between landings and the
    rate measured then shrink it further; it holds twice the round trip instead."""
    w = ByteWindow(30.0, span_s=0.010)
    _busy(w, 20e6, rtt=0.2)
    assert w.rtt == pytest.approx(0.2 + 65536 / 20e6, rel=0.01)
    assert w.span_limit >= int(w.rate * 2 * 0.2)


def test_the_round_trip_is_a_low_watermark_that_may_rise_slowly() -> None:
    w = ByteWindow(5.0)
    for took, expect in ((0.010, 0.010), (0.002, 0.002), (0.100, 0.0025)):
        w.sent(1, 0.0)
        w.resolved(1, took)
        assert w.rtt == pytest.approx(expect)


def test_the_queue_counts_bytes_waiting_for_room() -> None:
    """What waits behind a narrow window still has to cross the link: the inbox batches layer
    events on the whole of it; the sender's nap on what is in flight."""
    w = ByteWindow(5.0, span_s=0.010)
    w.inflight, w.queued, w.rate = 500_000, 4_500_000, 50e6
    assert w.backlog_s() == pytest.approx(0.010)
    assert w.queue_s() == pytest.approx(0.100)
    assert ByteWindow(5.0).queue_s() == 0.0  # rate unknown


@pytest.mark.parametrize("kw", [{"timeout_s": 0}, {"timeout_s": 5, "fraction": 0},
                                {"timeout_s": 5, "floor": 0}, {"timeout_s": 5, "initial": 1},
                                {"timeout_s": 5, "span_s": -0.01},
                                {"timeout_s": 5, "span_s": float("nan")},
                                {"timeout_s": 5, "span_after_s": -1},
                                {"timeout_s": 5, "span_floor": 0}])
def test_bad_settings_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="ByteWindow needs"):
        ByteWindow(**kw)  # type: ignore[arg-type]
