"""The checker covers the glue: every driver performs the core's effects through the one
interpreter (lw.fsm.interpreter.perform), so a defect planted there is a defect ``lw check``
finds — in the same function the runtime runs."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import pytest

import lw.fsm.interpreter as interpreter
import lw.sim.world
import lw.synthetic.workers
import lw.transport.runtime
from lw.sim.explorer import explore
from lw.sim.world import WorldConfig


def test_every_driver_uses_the_one_interpreter() -> None:
    assert lw.sim.world.perform is interpreter.perform
    assert lw.transport.runtime.perform is interpreter.perform
    assert lw.synthetic.workers.WorkerLoop is lw.transport.runtime.WorkerLoop


# Planted defects, written against lw.fsm.interpreter's own globals (their code replaces
# perform's; the names they use resolve in that module).
def _drops_timers(effects, ports, on_error=None):  # type: ignore[no-untyped-def]
    work = deque([effects])
    while work:
        writes = []
        for e in work.popleft():
            if isinstance(e, Send):  # noqa: F821
                msg = e.msg
                if isinstance(msg, DoneSending):  # noqa: F821
                    msg = ports.checksummed(msg, e.dest) or msg
                ports.send(e.dest, msg)
            elif isinstance(e, WriteLayer):  # noqa: F821
                writes.append(e)
            elif isinstance(e, _REPORTS):  # noqa: F821
                ports.report(e)
        if writes:
            work.extend(ports.write(writes))


def _done_before_sums(effects, ports, on_error=None):  # type: ignore[no-untyped-def]
    work = deque([effects])
    while work:
        writes = []
        for e in work.popleft():
            if isinstance(e, Send):  # noqa: F821
                ports.send(e.dest, e.msg)  # the DONE leaves without the sender's checksums
            elif isinstance(e, WriteLayer):  # noqa: F821
                writes.append(e)
            elif isinstance(e, ArmTimer):  # noqa: F821
                ports.arm(e.key, e.at)
            elif isinstance(e, CancelTimer):  # noqa: F821
                ports.cancel(e.key)
            elif isinstance(e, _REPORTS):  # noqa: F821
                ports.report(e)
        if writes:
            work.extend(ports.write(writes))


@pytest.fixture
def plant() -> Iterator[Callable[[Callable[..., None]], None]]:
    original = interpreter.perform.__code__

    def put(defect: Callable[..., None]) -> None:
        interpreter.perform.__code__ = defect.__code__

    yield put
    interpreter.perform.__code__ = original


@pytest.mark.parametrize(("defect", "cfg", "props"), [
    (_drops_timers, WorldConfig(design="d-first", dp=1, requests=1, layers=1, faults=True),
     {"progress", "deadlock", "request-ends", "blocks-return"}),
    (_done_before_sums, WorldConfig(design="d-first", dp=1, requests=1, layers=1, faults=True,
                                    late_writes=True, kv_checksum=True),
     {"stale-kv", "partial-kv", "sometimes-done"}),
], ids=["timers-dropped", "done-without-checksums"])
def test_a_defect_planted_in_the_interpreter_is_caught(
        plant: Callable[[Callable[..., None]], None], defect: Callable[..., None],
        cfg: WorldConfig, props: set[str]) -> None:
    assert explore(cfg, max_seconds=60).counterexample is None  # holds as built
    plant(defect)
    ce = explore(cfg, max_seconds=60).counterexample
    assert ce is not None, f"{defect.__name__} planted in the interpreter went unnoticed"
    assert ce.violation.prop in props, ce.violation.headline()
