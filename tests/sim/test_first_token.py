"""P's first token in the checker world (issue 59): the configurations of the strong check that
turn it on hold and are not vacuous, and each first-token variant's counterexample, replayed
against lw's design, ends with the token used only as its claim allows."""

from __future__ import annotations

import pytest

from lw.sim.cli import STRONG
from lw.sim.config import WorldConfig
from lw.sim.explorer import explore, replay
from lw.sim.tokens import d_token, origin, p_token, spec_of
from lw.sim.variants import DESIGNS

FIRST_TOKEN = [kw for kw in STRONG if kw.get("first_token_from_p")]


def test_tokens_say_whose_they_are() -> None:
    assert origin(p_token(3, 1)) == (3, 1, spec_of(3), False)
    assert origin(p_token(0, 2, other_spec=True)).spec != spec_of(0)
    assert origin(d_token(1, 0)).by_d and p_token(1, 0) != d_token(1, 0)


def test_other_spec_needs_the_token_and_a_request() -> None:
    with pytest.raises(ValueError, match="needs first_token_from_p"):
        WorldConfig(first_token_other_spec=(0,))
    with pytest.raises(ValueError, match="outside"):
        WorldConfig(first_token_from_p=True, first_token_other_spec=(2,))


def test_without_the_token_nothing_is_sampled() -> None:
    res = explore(WorldConfig(), check_cycles=True)
    assert res.complete and res.counterexample is None and "first-token" not in res.seen


@pytest.mark.parametrize("kw", FIRST_TOKEN, ids=lambda kw: kw.get("design", "d-first"))
def test_strong_first_token_configurations_hold_and_stream_tokens(kw: dict) -> None:
    """lw holds there, and some run streams P's token to a client (not vacuous)."""
    cfg = WorldConfig(**kw)
    res = explore(cfg, max_seconds=60, check_cycles=True)
    assert res.counterexample is None, res.counterexample.violation.headline()
    assert res.complete and "first-token" in res.seen


def _replayed(name: str) -> tuple:
    """A first-token variant's counterexample replayed against lw's design (the same actions,
    then a fair drain): the world at the end, and any violation."""
    d = DESIGNS[name]
    res = explore(WorldConfig(design=name, **d.config_overrides()), check_cycles=True)
    assert res.counterexample is not None
    cfg = WorldConfig(**d.config_overrides())
    w, _run, _texts, v = replay(cfg, res.counterexample.actions, record=False,
                                drain_after=True)
    return w, v


def test_slot_race_lw_hands_the_token_to_its_own_request() -> None:
    """r0's token comes after r0 decoded and r1 took its block: lw discards it (r0's client
    holds D's own token), and r1 gets a token of its own."""
    w, v = _replayed("token-slot-race")
    assert v is None
    r0, r1 = w.reqs
    assert origin(r0.client).by_d and origin(r1.client).idx == 1


def test_stale_epoch_lw_refuses_the_token_of_the_epoch_it_left() -> None:
    w, v = _replayed("stale-epoch-token")
    assert v is None
    assert w.d[0].counters["stale_epoch"] >= 1
    q = w.reqs[0]
    assert q.epoch == 1 and origin(q.client).epoch == 1


def test_recompute_lw_continues_from_the_clients_token() -> None:
    w, v = _replayed("recompute-own-token")
    assert v is None
    q = w.reqs[0]
    assert q.d_stage == "failed" and q.base == q.client == p_token(0, 0)


def test_spec_mismatch_lw_samples_the_first_token_itself() -> None:
    w, v = _replayed("token-spec-unchecked")
    assert v is None
    q = w.reqs[0]
    assert q.client == q.base == d_token(0, 0)
