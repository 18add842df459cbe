"""The worker loop's parts of their own: timers (re-arming replaces, cancelling forgets, due in
time order), heartbeat liveness (probe the quiet, lose the silent, forgive our own stall) and
its settings (LoopConfig: each checked once, on creation)."""

from __future__ import annotations

import pytest

from lw.transport.liveness import Liveness
from lw.transport.loopconfig import LoopConfig
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
    # a silent peer is still asked: an answer would end its silence
    assert seen == [(["d2"], [], False)] * 3 + [(["d2"], [("d2", 4.0)], False)]
    hb.lost("d2")
    assert hb.round(["d1"], 5.0) == (["d1"], [], False)  # quiet for about an interval


def test_a_peer_lost_with_its_connection_down_earns_no_budget_from_that_silence() -> None:
    """A frozen peer that comes back teaches its budget the pause it showed; a peer lost with
    our connection to it down (killed, then restarted at the same address) teaches nothing:
    its next death is found at the floor again, not at the cap (seen on real engines: a
    restarted prefill server killed again was found only by D's prefill deadline)."""
    for learn, budget in ((True, 30.0), (False, 3.0)):
        hb = Liveness(1.0, 3, cap_s=30.0)
        hb.round(["p"], 0.0)
        hb.heard("p", 0.0)
        hb.lost("p", learn=learn)
        hb.heard("p", 60.0)  # speaks again a minute later
        assert hb.budget("p", 60.0) == budget


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


@pytest.mark.parametrize(("bad", "needle"), [
    ({"heartbeat_s": -1.0}, "LoopConfig.heartbeat_s must be >= 0 and finite (0: off), got -1.0"),
    ({"heartbeat_s": float("nan")}, "LoopConfig.heartbeat_s must be >= 0"),
    ({"heartbeat_misses": 0}, "LoopConfig.heartbeat_misses must be >= 1 (an integer), got 0"),
    ({"heartbeat_misses": 2.5}, "heartbeat_misses must be >= 1 (an integer), got 2.5"),
    ({"layer_batch_s": -0.001}, "LoopConfig.layer_batch_s must be >= 0"),
    ({"hot_poll_s": float("inf")}, "LoopConfig.hot_poll_s must be >= 0 and finite"),
    ({"hot_window_s": -1}, "LoopConfig.hot_window_s"),
    ({"stuck_check_s": -1}, "LoopConfig.stuck_check_s"),
    ({"max_inbox": 0}, "LoopConfig.max_inbox must be >= 1"),
    ({"tail_samples": True}, "LoopConfig.tail_samples must be >= 1"),
    ({"name": ""}, "LoopConfig.name must be a non-empty string"),
])
def test_loop_config_refuses_each_bad_setting_by_name(bad: dict, needle: str) -> None:
    with pytest.raises(ValueError) as exc:
        LoopConfig(**bad)
    assert needle in str(exc.value)


def test_loop_config_defaults_and_offs_are_valid() -> None:
    cfg = LoopConfig(heartbeat_s=0, hot_poll_s=0, stuck_check_s=0, layer_batch_s=0.015)
    assert (cfg.heartbeat_s, cfg.layer_batch_s, LoopConfig().heartbeat_misses) == (0, 0.015, 3)
