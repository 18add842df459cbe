"""The world's own head placement (lw.sim.heads), independent of lw.fsm.kvmap: a wrong head
offset planted in the byte runs the core gets from kvmap is caught by it, and passed every
other property (why the world needs its own model)."""

from __future__ import annotations

from typing import Any

import pytest

import lw.fsm.prefill_layouts as layouts
import lw.sim.datapath as datapath
from lw.sim.config import WorldConfig
from lw.sim.explorer import explore
from lw.sim.heads import held, write_problem

HB = 4096


def test_held_heads_follow_vllms_rule() -> None:
    assert [held(r, 2, 4, False) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [held(r, 4, 2, False) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert held(3, 4, 8, True) == range(1)


def wp(*args: Any) -> str:
    return write_problem(*args, HB)


def test_write_problems() -> None:
    # P TP 2 -> D TP 1, 2 heads: P rank 1's head goes into D's second slot
    assert wp(1, 2, 0, 1, 2, False, ((0, HB, HB),), HB, 2 * HB) == ""
    assert "P's head 1 into the slot of D's head 0" in wp(
        1, 2, 0, 1, 2, False, ((0, 0, HB),), HB, 2 * HB)
    assert "not whole heads" in wp(0, 2, 0, 1, 2, False, ((0, 0, 100),), HB, 2 * HB)
    assert "writes past D's heads" in wp(0, 1, 1, 2, 2, False, ((HB, 0, HB), (HB, HB, HB)),
                                         2 * HB, HB)
    assert "reads past P's heads" in wp(0, 1, 1, 2, 2, False, ((HB, 0, 2 * HB),), 2 * HB, HB)
    assert "twice" in wp(0, 1, 0, 1, 2, False, ((0, 0, HB), (0, 0, HB)), 2 * HB,
                                    2 * HB)
    assert wp(0, 2, 0, 1, 1, True, None, HB, HB) == ""  # MLA: the whole latent
    assert "whole block" in wp(0, 2, 0, 1, 2, False, None, HB, 2 * HB)


def _dst_from_p_heads(real: Any) -> Any:
    """kvmap with an easy slip: the destination offset counted from P's first head, not D's."""

    def wrong(p_fmt: Any, p_len: int, d_fmt: Any, d_len: int) -> tuple:
        return tuple((src, src, n) for src, _dst, n in real(p_fmt, p_len, d_fmt, d_len))

    return wrong


CFG = WorldConfig(dp=1, tp=2, requests=1, layers=1)  # P TP 2 into D TP 1: two senders


def test_a_wrong_head_offset_in_kvmap_is_caught_by_the_worlds_placement(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert explore(CFG, max_seconds=60).counterexample is None
    monkeypatch.setattr(layouts, "block_segments", _dst_from_p_heads(layouts.block_segments))
    ce = explore(CFG, max_seconds=60).counterexample
    assert ce is not None and ce.violation.prop == "kv-placement", ce and ce.violation
    assert "P's head 1 into the slot of D's head 0" in ce.violation.message


def test_without_its_own_model_the_world_passed_that_offset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layouts, "block_segments", _dst_from_p_heads(layouts.block_segments))
    monkeypatch.setattr(datapath, "write_problem", lambda *a: "")
    res = explore(CFG, max_seconds=60)
    assert res.counterexample is None and res.complete


def _plan_without_rank_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvmap's sender plan with a slip: P TP rank 1 writes nowhere and D expects only rank 0
    (so head 1 has no writer), while everything else stays consistent with it (D's claim check
    reads the same plan, so it does not refuse rank 0 for it)."""
    import lw.fsm.decode_claims as claims
    import lw.sim.config as config

    monkeypatch.setattr(config, "expected_senders", lambda fmt, tp: frozenset({0}))
    monkeypatch.setattr(claims, "expected_senders", lambda fmt, tp: frozenset({0}))
    monkeypatch.setattr(config, "targets_of", lambda fmt, d_tp: (0,) if fmt.tp_rank == 0 else ())


def test_a_head_nobody_writes_is_caught_by_the_worlds_coverage(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _plan_without_rank_1(monkeypatch)
    ce = explore(CFG, max_seconds=60).counterexample
    assert ce is not None and ce.violation.prop == "partial-kv", ce and ce.violation
    assert "no write carried head(s) [1]" in ce.violation.message


def test_without_its_own_coverage_the_world_passed_that_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import lw.sim.dnode as dnode

    _plan_without_rank_1(monkeypatch)
    monkeypatch.setattr(dnode.DNode, "_check_heads_covered", lambda self, q, v: None)
    res = explore(CFG, max_seconds=60)
    assert res.counterexample is None and res.complete
