"""The checker covers the glue: every driver performs the core's effects through the one
interpreter (lw.fsm.interpreter.perform), so a defect planted there is a defect ``lw check``
finds — in the same function the runtime runs."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import lw.fsm.interpreter as interpreter
import lw.lab.synthetic.decoder
import lw.lab.synthetic.prefill_rank
import lw.sim.ports
import lw.transport.runtime
from lw.fsm.effects import KeptSums, SumPlan, Sums
from lw.sim.explorer import explore
from lw.sim.world import WorldConfig


def test_every_driver_uses_the_one_interpreter() -> None:
    assert lw.sim.ports.perform is interpreter.perform
    assert lw.transport.runtime.perform is interpreter.perform
    assert lw.lab.synthetic.prefill_rank.WorkerLoop is lw.transport.runtime.WorkerLoop
    assert lw.lab.synthetic.decoder.WorkerLoop is lw.transport.runtime.WorkerLoop


# Planted defects, written against lw.fsm.interpreter's own globals (their code replaces
# perform's; the names they use resolve in that module). Each is the real loop with one branch
# changed; the checksum branches are ordinary functions, called from the planted loop.
def _drops_timers(effects, ports, on_error=None):  # type: ignore[no-untyped-def]
    work = deque([effects])
    while work:
        writes = []
        for e in work.popleft():
            if isinstance(e, Send):  # noqa: F821
                ports.send(e.dest, e.msg)
            elif isinstance(e, WriteLayer):  # noqa: F821
                writes.append(e)
            elif isinstance(e, _REPORTS):  # noqa: F821
                ports.report(e)
            elif isinstance(e, FenceData):  # noqa: F821
                ports.fence(e)
            elif isinstance(e, SumBlocks):  # noqa: F821
                got = tuple(ports.sum_blocks(e.layout, plan) for plan in e.plans)
                work.append(ports.answer(Sums(e, got)))  # noqa: F821
            elif isinstance(e, KeptSums):  # noqa: F821
                got = tuple(ports.kept_sums(e.req_id, t, e.layers) for t in e.targets)
                work.append(ports.answer(Sums(e, got)))  # noqa: F821
        if writes:
            work.extend(ports.write(writes))


def _sums_defect(effects, ports, on_error=None):  # type: ignore[no-untyped-def]
    """The real loop but for the checksum branches, which ``_sums_branches`` replaces."""
    work = deque([effects])
    while work:
        writes = []
        for e in work.popleft():
            if isinstance(e, Send):  # noqa: F821
                ports.send(e.dest, e.msg)
            elif isinstance(e, WriteLayer):  # noqa: F821
                writes.append(e)
            elif isinstance(e, ArmTimer):  # noqa: F821
                ports.arm(e.key, e.at)
            elif isinstance(e, CancelTimer):  # noqa: F821
                ports.cancel(e.key)
            elif isinstance(e, _REPORTS):  # noqa: F821
                ports.report(e)
            elif isinstance(e, FenceData):  # noqa: F821
                ports.fence(e)
            else:
                work.extend(_sums_branches(e, ports))  # noqa: F821
        if writes:
            work.extend(ports.write(writes))


def _done_without_checksums(e, ports):  # type: ignore[no-untyped-def]
    """P's question is answered with nothing kept: its DONE leaves without checksums."""
    if isinstance(e, KeptSums):
        return [ports.answer(Sums(e, tuple([] for _ in e.targets)))]
    got = tuple(ports.sum_blocks(e.layout, plan) for plan in e.plans)
    return [ports.answer(Sums(e, got))]


def _sums_dropped(e, ports):  # type: ignore[no-untyped-def]
    """D's question is never answered: the DONE that asked is never counted."""
    if isinstance(e, KeptSums):
        got = tuple(ports.kept_sums(e.req_id, t, e.layers) for t in e.targets)
        return [ports.answer(Sums(e, got))]
    return []


def _sums_one_block_off(e, ports):  # type: ignore[no-untyped-def]
    """D sums the blocks after the ones the core named (an off-by-one in the glue)."""
    if isinstance(e, KeptSums):
        got = tuple(ports.kept_sums(e.req_id, t, e.layers) for t in e.targets)
        return [ports.answer(Sums(e, got))]
    got = tuple(ports.sum_blocks(e.layout, SumPlan(
        plan.sender, tuple(b + 1 for b in plan.blocks), plan.runs)) for plan in e.plans)
    return [ports.answer(Sums(e, got))]


@pytest.fixture
def plant() -> Iterator[Callable[[Callable[..., Any]], None]]:
    """Put a defect into the interpreter: a whole loop, or the checksum branches of one."""
    original = interpreter.perform.__code__

    def put(defect: Callable[..., Any]) -> None:
        if defect.__code__.co_argcount == 2:  # the checksum branches only
            interpreter._sums_branches = defect  # type: ignore[attr-defined]
            defect = _sums_defect
        interpreter.perform.__code__ = defect.__code__

    yield put
    interpreter.perform.__code__ = original
    vars(interpreter).pop("_sums_branches", None)


@functools.cache
def _holds_as_built(cfg: WorldConfig) -> bool:
    """The configuration holds with the interpreter as built (explored once per module: two
    cases share one)."""
    return explore(cfg, max_seconds=60).counterexample is None


_CHECKSUMS = WorldConfig(design="d-first", dp=1, requests=1, layers=1, faults=True,
                         kv_checksum=True)


@pytest.mark.parametrize(("defect", "cfg", "props"), [
    (_drops_timers, WorldConfig(design="d-first", dp=1, requests=1, layers=1, faults=True),
     {"progress", "deadlock", "request-ends", "blocks-return"}),
    (_done_without_checksums, WorldConfig(design="d-first", dp=1, requests=1, layers=1,
                                          faults=True, late_writes=True, kv_checksum=True),
     {"stale-kv", "partial-kv", "sometimes-done"}),
    (_sums_dropped, _CHECKSUMS, {"sometimes-done", "no-deadline-without-faults"}),
    (_sums_one_block_off, _CHECKSUMS, {"sometimes-done", "no-deadline-without-faults"}),
], ids=["timers-dropped", "done-without-checksums", "sums-dropped", "sums-one-block-off"])
def test_a_defect_planted_in_the_interpreter_is_caught(
        plant: Callable[[Callable[..., Any]], None], defect: Callable[..., Any],
        cfg: WorldConfig, props: set[str]) -> None:
    assert _holds_as_built(cfg)
    plant(defect)
    ce = explore(cfg, max_seconds=60).counterexample
    assert ce is not None, f"{defect.__name__} planted in the interpreter went unnoticed"
    assert ce.violation.prop in props, ce.violation.headline()
