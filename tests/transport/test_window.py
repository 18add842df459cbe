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


@pytest.mark.parametrize("kw", [{"timeout_s": 0}, {"timeout_s": 5, "fraction": 0},
                                {"timeout_s": 5, "floor": 0}, {"timeout_s": 5, "initial": 1}])
def test_bad_settings_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="ByteWindow needs"):
        ByteWindow(**kw)  # type: ignore[arg-type]
