"""LinkMeter: goodput per decode host over the time writes were in flight."""

from __future__ import annotations

import pytest

from lw.transport.linkmeter import LinkMeter, host_of

MiB = 1 << 20


def test_a_busy_period_measures_bytes_over_its_length_with_overlapping_writes() -> None:
    m = LinkMeter(min_bytes=MiB, trust_bytes=MiB)
    m.submitted("h", 10.0)
    m.submitted("h", 10.1)  # overlaps the first: one busy period
    m.completed("h", MiB, 10.5)
    assert m.goodput == {}  # a write still in flight: the period goes on
    m.completed("h", MiB, 11.0)
    assert m.goodput == {"h": pytest.approx(2 * MiB / 1.0)}
    assert m.samples == 1


def _period(m: LinkMeter, t: float, nbytes: int, seconds: float, writes: int = 2) -> None:
    """``writes`` queued writes at ``t`` moving ``nbytes`` in ``seconds``: one busy period."""
    for _ in range(writes):
        m.submitted("h", t)
    for i in range(writes):
        share = nbytes // writes if i < writes - 1 else nbytes - (writes - 1) * (nbytes // writes)
        m.completed("h", share, t + seconds * (i + 1) / writes)


def test_idle_time_between_periods_is_left_out_and_small_periods_are_pooled() -> None:
    m = LinkMeter(min_bytes=MiB, trust_bytes=MiB // 4, hold_s=0)
    _period(m, 0.0, 4 * MiB, 0.5)  # 8 MiB/s
    assert m.goodput == {"h": pytest.approx(8 * MiB)}
    # Four periods of 256 KiB, each 0.125 s, with long idle gaps: pooled into one sample of
    # 1 MiB over 0.5 s of busy time (the gaps do not count).
    for i in range(4):
        assert m.samples == 1
        _period(m, 100.0 * (i + 1), MiB // 4, 0.125)
    assert m.samples == 2
    assert m.goodput == {"h": pytest.approx(2 * MiB)}


def test_the_best_measurement_of_the_last_hold_s_counts() -> None:
    """A slow period on a fast link (a sender starved by the forward) does not make it slow;
    a link that stays slow is believed once its faster measurements are hold_s old."""
    m = LinkMeter(min_bytes=MiB, trust_bytes=4 * MiB, hold_s=5.0)
    seen = []
    for t, rate in ((0.0, 100), (1.0, 10), (2.0, 60), (10.0, 10), (11.0, 20), (12.0, 15)):
        _period(m, t, 8 * MiB, 8 / rate)
        seen.append(m.goodput["h"] / MiB)
    assert seen == pytest.approx([100, 100, 100, 10, 20, 20])


def test_a_link_that_got_slower_is_believed_after_two_agreeing_measurements() -> None:
    m = LinkMeter(min_bytes=MiB, trust_bytes=4 * MiB, hold_s=5.0)
    seen = []
    for t, rate in ((0.0, 100), (1.0, 50), (2.0, 45), (3.0, 48), (4.0, 100)):
        _period(m, t, 8 * MiB, 8 / rate)
        seen.append(m.goodput["h"] / MiB)
    assert seen == pytest.approx([100, 100, 50, 50, 100])  # faster again: shown at once


def _small(m: LinkMeter, t: float, rate: float) -> None:
    _period(m, t, MiB, 1.0 / rate)


def test_small_periods_only_bound_the_link_from_below() -> None:
    """Periods of small writes show their fixed costs (and a shaper's burst), not the link:
    they raise an estimate no recent measurement backs and never lower one; while a
    measurement of the last hold_s backs it they say nothing."""
    m = LinkMeter(min_bytes=MiB, trust_bytes=4 * MiB, hold_s=100)
    for t, rate in ((0.0, 1), (10.0, 4), (20.0, 2)):
        _small(m, t, rate)
    assert m.goodput == {"h": pytest.approx(4 * MiB)}  # the best they showed
    _period(m, 30.0, 8 * MiB, 4.0)  # a large period measures it: 2 MiB/s
    assert m.goodput == {"h": pytest.approx(2 * MiB)}
    _small(m, 40.0, 10)  # 10 MiB/s in a small period (a burst let through): no news
    assert m.goodput == {"h": pytest.approx(2 * MiB)}
    assert m.samples == 5


def test_a_link_that_got_faster_shows_it_once_its_measurement_is_old() -> None:
    m = LinkMeter(min_bytes=MiB, trust_bytes=4 * MiB, hold_s=5.0)
    _period(m, 0.0, 8 * MiB, 8.0)  # 1 MiB/s, measured at t=8
    _small(m, 10.0, 10)  # 10 MiB/s in a small period, 2.1 s later: the measurement holds
    assert m.goodput == {"h": pytest.approx(MiB)}
    _small(m, 20.0, 10)  # 12 s later: the link shows it is faster
    assert m.goodput == {"h": pytest.approx(10 * MiB)}
    _period(m, 30.0, 8 * MiB, 4.0)  # measured again (2 MiB/s), nothing recent beside it
    assert m.goodput == {"h": pytest.approx(2 * MiB)}
    with pytest.raises(ValueError, match="hold_s"):
        LinkMeter(hold_s=-1)


def test_writes_submitted_together_count_once_in_flight() -> None:
    m = LinkMeter(min_bytes=MiB, trust_bytes=MiB)
    m.submitted("h", 0.0, writes=2)  # D's two TP ranks, one tick
    m.completed("h", MiB, 0.5)
    assert m.goodput == {}  # the other is still in flight
    m.completed("h", MiB, 1.0)
    assert m.goodput == {"h": pytest.approx(2 * MiB)}


def test_hosts_are_separate_and_failed_writes_move_no_bytes() -> None:
    m = LinkMeter(min_bytes=MiB, trust_bytes=MiB)
    m.submitted("a", 0.0)
    m.submitted("b", 0.0)
    m.completed("b", 0, 0.2)  # failed: nothing measured
    m.completed("a", 2 * MiB, 1.0)
    m.completed("c", 2 * MiB, 1.0)  # never submitted: ignored
    assert m.goodput == {"a": pytest.approx(2 * MiB)}


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="min_bytes"):
        LinkMeter(min_bytes=0)
    with pytest.raises(ValueError, match="trust_bytes"):
        LinkMeter(trust_bytes=0)
    with pytest.raises(ValueError, match="writes"):
        LinkMeter().submitted("h", 0.0, writes=0)


@pytest.mark.parametrize(("addr", "host"), [
    ("tcp://10.0.0.2:5600", "10.0.0.2"), ("tcp://[::1]:5600", "::1"),
    ("127.0.0.1:9", "127.0.0.1"), ("node-a", "node-a")])
def test_host_of(addr: str, host: str) -> None:
    assert host_of(addr) == host
