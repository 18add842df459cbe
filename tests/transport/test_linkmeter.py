"""LinkMeter: goodput per decode host over the time writes were in flight."""

from __future__ import annotations

import pytest

from lw.transport.linkmeter import LinkMeter, host_of

MiB = 1 << 20


def test_a_busy_period_measures_bytes_over_its_length_with_overlapping_writes() -> None:
    m = LinkMeter(min_bytes=MiB)
    m.submitted("h", 10.0)
    m.submitted("h", 10.1)  # overlaps the first: one busy period
    m.completed("h", MiB, 10.5)
    assert m.goodput == {}  # a write still in flight: the period goes on
    m.completed("h", MiB, 11.0)
    assert m.goodput == {"h": pytest.approx(2 * MiB / 1.0)}
    assert m.samples == 1


def _backlogged(m: LinkMeter, t: float, nbytes: int, seconds: float) -> None:
    """Two writes queued on the link at ``t``, moving ``nbytes`` in ``seconds``."""
    m.submitted("h", t)
    m.submitted("h", t)
    m.completed("h", nbytes // 2, t + seconds / 2)
    m.completed("h", nbytes - nbytes // 2, t + seconds)


def test_idle_time_between_periods_is_left_out_and_small_periods_are_pooled() -> None:
    m = LinkMeter(min_bytes=MiB, alpha=1.0)
    _backlogged(m, 0.0, 4 * MiB, 0.5)  # 8 MiB/s
    assert m.goodput == {"h": pytest.approx(8 * MiB)}
    # Four backlogged periods of 256 KiB, each 0.125 s, with long idle gaps: pooled into one
    # sample of 1 MiB over 0.5 s of busy time (the gaps do not count).
    for i in range(4):
        assert m.samples == 1
        _backlogged(m, 100.0 * (i + 1), MiB // 4, 0.125)
    assert m.samples == 2
    assert m.goodput == {"h": pytest.approx(2 * MiB)}


def test_a_slower_backlogged_period_is_believed_at_once_a_faster_one_gradually() -> None:
    m = LinkMeter(min_bytes=MiB, alpha=0.5)
    seen = []
    for i, rate in enumerate((100, 10, 100, 100)):
        _backlogged(m, 10.0 * i, rate * MiB, 1.0)
        seen.append(m.goodput["h"] / MiB)
    assert seen == pytest.approx([100, 10, 55, 77.5])


def test_a_link_that_kept_pace_only_bounds_the_estimate_from_below() -> None:
    """Writes that each ended before the next came say the link carries at least their rate
    (small writes show their fixed costs, not the link): they raise an estimate no backlog has
    set and never lower one; once a backlog measured the link they say nothing."""
    m = LinkMeter(min_bytes=MiB, alpha=0.5)
    for t, seconds in ((0.0, 1.0), (10.0, 0.25), (20.0, 0.5)):  # 1, 4, then 2 MiB/s
        m.submitted("h", t)
        m.completed("h", MiB, t + seconds)
    assert m.goodput == {"h": pytest.approx(4 * MiB)}  # the best it has shown
    _backlogged(m, 30.0, MiB, 0.5)  # queued writes measure it: 2 MiB/s, believed at once
    assert m.goodput == {"h": pytest.approx(2 * MiB)}
    m.submitted("h", 40.0)
    m.completed("h", MiB, 40.1)  # 10 MiB/s alone (a burst the shaper let through): no news
    assert m.goodput == {"h": pytest.approx(2 * MiB)}
    assert m.samples == 5


def test_writes_submitted_together_are_not_a_backlog() -> None:
    m = LinkMeter(min_bytes=MiB)
    m.submitted("h", 0.0, writes=2)  # D's two TP ranks, one tick
    m.completed("h", MiB, 0.5)
    m.completed("h", MiB, 1.0)
    assert m.goodput == {"h": pytest.approx(2 * MiB)}
    m.submitted("h", 5.0)
    m.completed("h", MiB, 6.0)  # slower, but the link kept pace: no news
    assert m.goodput == {"h": pytest.approx(2 * MiB)}


def test_hosts_are_separate_and_failed_writes_move_no_bytes() -> None:
    m = LinkMeter(min_bytes=MiB, alpha=1.0)
    m.submitted("a", 0.0)
    m.submitted("b", 0.0)
    m.completed("b", 0, 0.2)  # failed: nothing measured
    m.completed("a", 2 * MiB, 1.0)
    m.completed("c", 2 * MiB, 1.0)  # never submitted: ignored
    assert m.goodput == {"a": pytest.approx(2 * MiB)}


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="alpha"):
        LinkMeter(alpha=0)
    with pytest.raises(ValueError, match="min_bytes"):
        LinkMeter(min_bytes=0)
    with pytest.raises(ValueError, match="writes"):
        LinkMeter().submitted("h", 0.0, writes=0)


@pytest.mark.parametrize(("addr", "host"), [
    ("tcp://10.0.0.2:5600", "10.0.0.2"), ("tcp://[::1]:5600", "::1"),
    ("127.0.0.1:9", "127.0.0.1"), ("node-a", "node-a")])
def test_host_of(addr: str, host: str) -> None:
    assert host_of(addr) == host
