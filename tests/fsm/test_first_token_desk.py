"""D's scheduler-side first-token decisions (lw.fsm.first_token_desk), without vLLM."""

from __future__ import annotations

import pytest

from lw.fsm.first_token_desk import FirstTokenDesk, TokenCase, Verdict

WAITING = TokenCase(live=True, awaiting_kv=True, outputs=0, ineligible=None)


def fits() -> None:
    return None


def test_a_waiting_eligible_request_takes_its_token_once_and_a_resample_is_discarded() -> None:
    desk = FirstTokenDesk(0.05)
    assert desk.arrived("r", WAITING, fits) == (Verdict.TAKE, None)
    holding = TokenCase(live=True, awaiting_kv=True, outputs=1, ineligible=None)
    # a re-prefill's P sampled again: the client holds token 1 already
    assert desk.arrived("r", holding, fits) == (Verdict.RESAMPLED, None)


def test_a_token_after_d_computed_its_own_is_late() -> None:
    desk = FirstTokenDesk(0.05)
    running = TokenCase(live=True, awaiting_kv=False, outputs=0, ineligible=None)
    assert desk.arrived("r", running, fits) == (Verdict.LATE, "late")


@pytest.mark.parametrize("reason", ["logprobs", "off", "structured_output"])
def test_an_ineligible_request_falls_back_with_its_reason_before_the_spec_is_asked(
        reason: str) -> None:
    desk = FirstTokenDesk(0.05)

    def never() -> str | None:
        raise AssertionError("the spec must not be asked for an ineligible request")

    case = TokenCase(live=True, awaiting_kv=False, outputs=1, ineligible=reason)
    assert desk.arrived("r", case, never) == (Verdict.FALLBACK, reason)


def test_a_spec_that_does_not_fit_falls_back_and_an_ended_request_is_left_alone() -> None:
    desk = FirstTokenDesk(0.05)
    assert desk.arrived("r", WAITING, lambda: "spec_mismatch") == \
        (Verdict.FALLBACK, "spec_mismatch")
    gone = TokenCase(live=False, awaiting_kv=False, outputs=0, ineligible=None)
    assert desk.arrived("x", gone, fits) == (Verdict.ENDED, None)
    assert not desk.holds("x")


def test_kv_before_the_token_waits_then_goes_and_says_the_wait_expired() -> None:
    desk = FirstTokenDesk(0.05)
    assert desk.may_schedule("r", 10.0) == (False, False)
    assert desk.may_schedule("r", 10.04) == (False, False)
    assert desk.may_schedule("r", 10.06) == (True, True)
    # a token heard ends the wait at once
    assert desk.may_schedule("q", 10.0) == (False, False)
    desk.arrived("q", WAITING, fits)
    assert desk.may_schedule("q", 10.01) == (True, False)


def test_seeds_are_given_once_to_the_requests_scheduled_and_ended_ones_forgotten() -> None:
    desk = FirstTokenDesk(0.05)
    for rid, token in (("a", 7), ("b", 8), ("c", 9)):
        desk.arrived(rid, WAITING, fits)
        desk.seed(rid, token)
    assert desk.seeds_for(["a", "z"]) == [("a", 7)]
    assert desk.seeds_for(["a"]) == []
    desk.may_schedule("d", 1.0)
    desk.forget({"b"})
    assert desk.holds("b") and not any(desk.holds(r) for r in "acd")
    assert desk.seeds_for(["b", "c"]) == [("b", 8)]


def test_a_negative_wait_is_refused() -> None:
    with pytest.raises(ValueError, match="first-token wait"):
        FirstTokenDesk(-1.0)
