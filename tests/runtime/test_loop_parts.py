"""The worker loop's parts of their own: timers (re-arming replaces, cancelling forgets, due in
time order) and heartbeat liveness (probe the quiet, lose the silent, forgive our own stall)."""

from __future__ import annotations

import pytest

from lw.transport.liveness import Liveness
from lw.transport.timers import Timers


def test_timers_fire_in_time_order_once_and_replace_on_rearm() -> None:
    t = Timers()
    t.arm(("meta", "a"), 3.0)
    t.arm(("deadline", "b"), 1.0)
    t.arm(("meta", "a"), 2.0)  # replaces 3.0
    t.arm(("ack", "c"), 1.5)
    t.cancel(("ack", "c"))
    assert len(t) == 2 and t.next_at() == 1.0
    assert list(t.due(0.5)) == []
    assert list(t.due(2.5)) == [("deadline", "b"), ("meta", "a")]
    assert list(t.due(10.0)) == [] and len(t) == 0  # the stale 3.0 entry is skipped


def test_timers_drop_cancelled_entries_now_and_then() -> None:
    t = Timers()
    for i in range(5000):
        t.arm(("meta", f"r{i}"), float(i))
        t.cancel(("meta", f"r{i}"))
    t.arm(("meta", "live"), 1e9)
    assert list(t.due(0.0)) == []
    assert len(t._heap) < 2000  # compacted


def test_liveness_probes_the_quiet_and_loses_the_silent_in_order() -> None:
    hb = Liveness(1.0, 3)
    assert hb.due(0.0) and not hb.due(0.5) and hb.due(1.0)
    assert hb.round(["d1", "d2"], 0.0) == ([], [], False)
    seen = []
    for t in (1.0, 2.0, 3.0, 4.0):
        hb.heard("d1", t - 0.05)
        seen.append(hb.round(["d2", "d1"], t))
    assert seen == [(["d2"], [], False)] * 3 + [([], [("d2", 4.0)], False)]
    assert hb.round(["d1"], 5.0) == (["d1"], [], False)  # quiet for about an interval


def test_liveness_forgives_a_late_round_and_forgets_peers_no_longer_needed() -> None:
    hb = Liveness(1.0, 2)
    hb.round(["d1"], 0.0)
    assert hb.round(["d1"], 10.0) == ([], [], True)  # we were stopped: the clock restarts
    hb.round([], 11.0)  # d1 no longer needed: forgotten
    assert hb.round(["d1"], 12.0) == ([], [], False)  # its clock starts again now


def test_liveness_refuses_bad_settings() -> None:
    with pytest.raises(ValueError):
        Liveness(-1.0, 3)
    with pytest.raises(ValueError):
        Liveness(1.0, 0)
    assert not Liveness(0.0, 3).on and not Liveness(0.0, 3).due(5.0)
