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


def test_idle_time_between_periods_is_left_out_and_small_periods_are_pooled() -> None:
    m = LinkMeter(min_bytes=MiB, alpha=1.0)
    m.submitted("h", 0.0)
    m.completed("h", 4 * MiB, 0.5)  # 8 MiB/s
    assert m.goodput == {"h": pytest.approx(8 * MiB)}
    # Four writes of 256 KiB, each alone on the link for 0.125 s, with long idle gaps: pooled
    # into one sample of 1 MiB over 0.5 s of busy time (the gaps do not count).
    for i in range(4):
        m.submitted("h", 100.0 * (i + 1))
        assert m.samples == 1
        m.completed("h", MiB // 4, 100.0 * (i + 1) + 0.125)
    assert m.samples == 2
    assert m.goodput == {"h": pytest.approx(2 * MiB)}


def test_a_slower_period_is_believed_at_once_a_faster_one_gradually() -> None:
    m = LinkMeter(min_bytes=MiB, alpha=0.5)
    t = 0.0
    seen = []
    for rate in (100, 10, 100, 100):
        m.submitted("h", t)
        t += 1.0
        m.completed("h", rate * MiB, t)
        seen.append(m.goodput["h"] / MiB)
    assert seen == pytest.approx([100, 10, 55, 77.5])


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


@pytest.mark.parametrize(("addr", "host"), [
    ("tcp://10.0.0.2:5600", "10.0.0.2"), ("tcp://[::1]:5600", "::1"),
    ("127.0.0.1:9", "127.0.0.1"), ("node-a", "node-a")])
def test_host_of(addr: str, host: str) -> None:
    assert host_of(addr) == host
