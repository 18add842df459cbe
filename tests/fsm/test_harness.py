"""The endpoint test harness itself (tests/fsm/harness.py)."""

from __future__ import annotations

from lw.fsm import ArmTimer, DecodeEndpoint, PrefillEndpoint

from .harness import Pair, d_layout, d_sender, p_sender


def test_a_p_and_a_d_timer_due_at_the_same_instant_both_fire() -> None:
    """P workers are ints and D is "d": sorting their due timers compared the two and raised
    TypeError when the instants were equal (found by a helper's fresh-block tests)."""
    pair = Pair([PrefillEndpoint(p_sender(0), 2)], DecodeEndpoint(d_sender(), d_layout(2)))
    pair.absorb(0, [ArmTimer(("deadline", "r1"), 5.0)])
    pair.absorb("d", [ArmTimer(("deadline", "r1"), 5.0)])
    pair.advance(6.0)
    assert pair.timers == {} and pair.now == 6.0
